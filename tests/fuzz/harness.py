"""The test's side of the fuzzer: one worker process per reader (tests/fuzz/worker.py), restarted
when a mutant kills it or hangs it past the alarm, and the rules every outcome must keep: the reader
answers, or refuses in one short line of text (exit 2); nothing else (exit 3, a signal, a
MemoryError, a run over the alarm)."""

import json
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
SECONDS = 5.0  # the alarm per mutant, in CPU seconds
HUNG_SECONDS = 120  # no answer within this wall time: the worker is stuck where the alarm cannot reach
MEMORY_MIB = 1536  # address space a worker may add to what it holds after its imports
MAX_LINE = 1000  # an error line longer than this echoes a value from the file
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what a terminal acts on (ESC, OSC, CR, ...)


class Worker:
    def __init__(self, reader: str, slot: Path, valid: Path, commands: list[list[str]]):
        self.reader, self.slot, self.valid, self.commands, self.process = reader, slot, valid, commands, None
        self.starts = 0

    def start(self) -> None:
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        env.pop("OPTKIT_DEBUG", None)
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), self.reader, str(self.slot), str(MEMORY_MIB), str(SECONDS)]
            + [str(self.valid), json.dumps(self.commands)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.starts += 1
        ready = self._answer(300)
        assert ready and ready.get("ready"), f"the {self.reader} worker did not start: {ready}"

    def _answer(self, timeout: float) -> dict | None:
        readable, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not readable:
            return None
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def ask(self, request: dict) -> dict:
        if self.process is None or self.process.poll() is not None:
            self.start()
        start = time.perf_counter()
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._answer(HUNG_SECONDS)  # the alarm fires within Python; C code may not return
        if answer is not None:
            return answer
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
            return {"outcome": "hung", "line": "no answer and the alarm did not interrupt it", "seconds": HUNG_SECONDS}
        code = self.process.wait()
        self.process = None
        what = f"killed by signal {-code}" if code < 0 else f"exited with {code}"
        return {"outcome": "died", "line": what, "seconds": round(time.perf_counter() - start, 3)}

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def line_problem(line: str) -> str | None:
    """Why an error line is not one short line of plain text, or None."""
    if "\n" in line or "\r" in line:
        return "several lines"
    if len(line) > MAX_LINE:
        return f"a line of {len(line):,} characters"
    if CONTROL.search(line):
        return f"control character {CONTROL.search(line).group()!r} reaches the terminal"
    return None


def reader_problem(answer: dict) -> str | None:
    if answer["outcome"] == "ok":
        return None if answer["seconds"] <= SECONDS else f"took {answer['seconds']} s"
    if answer["outcome"] == "refused":
        problem = line_problem(answer["line"])
        return f"refusal: {problem}" if problem else None
    return f"{answer['outcome']}: {answer.get('type', '')} {answer.get('line', '')[:300]}".strip()


def cli_problem(answer: dict, allowed: tuple[int, ...], json_output: bool) -> str | None:
    """`optkit ...` exited with an allowed code; on exit 2 one `error:` line (verify's GGUF report: one
    line per problem); --json output a document a strict parser reads."""
    if answer["outcome"] != "exit":
        return f"{answer['outcome']}: {answer.get('line', '')[:300]}"
    code, out, err = answer["exit"], answer["stdout"], answer["stderr"]
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    if code not in allowed:
        return f"exit {code}: {(errors or lines or [''])[-1][:300]}"
    if answer["seconds"] > SECONDS:
        return f"took {answer['seconds']} s"
    if json_output and answer.get("json_error"):
        return f"--json output is not strict JSON: {answer['json_error']}"
    for line in errors:
        problem = line_problem(line)
        if problem:
            return f"error line: {problem}"
    if code == 2 and not (json_output and out.strip()):
        if not errors:
            return f"exit 2 without an error line: {err[-300:]!r}"
        others = [ln for ln in lines if not ln.startswith(("error: ", "warning: "))]
        if others:
            return f"exit 2 and other stderr lines: {others[0][:200]!r}"
    return None


def signature(reader: str, problem: str, where: str = "") -> str:
    """A failure's class: where it was raised, or its message without paths, numbers and quoted values."""
    if where:
        return f"{reader}: {' '.join(problem.split(' ', 2)[:2])} at {where}"
    text = re.sub(r"/\S+", "PATH", problem)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "Q", text)
    text = re.sub(r"\d+", "N", text)
    return f"{reader}: {text[:120]}"


def _traceback_where(stderr: str) -> str:
    """The innermost optkit frame of a traceback the CLI printed (exit 3), as file:line."""
    frames = re.findall(r'File "[^"]*/(optkit/[^"]+)", line (\d+)', stderr)
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""


@dataclass
class Tally:
    reader: str
    mutants: int = 0
    past_header: int = 0
    outcomes: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    refusals: dict = field(default_factory=dict)  # signature of each refusal line -> count
    failures: dict = field(default_factory=dict)  # signature -> (mutant kept, mutations, problem)
    slowest: float = 0.0

    def add(self, answer: dict, problem: str | None, mutant: Path, mutations: list[str]) -> None:
        self.mutants += 1
        self.past_header += bool(answer.get("past_header"))
        key = answer["outcome"] if answer["outcome"] != "exit" else f"exit {answer['exit']}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        for note in answer.get("notes", []):
            self.notes[note] = self.notes.get(note, 0) + 1
        self.slowest = max(self.slowest, answer.get("seconds", 0.0))
        if answer["outcome"] == "refused" or answer.get("exit") == 2:
            refusal = signature(self.reader, answer.get("line") or answer.get("stderr", "").strip()[-200:])
            self.refusals[refusal] = self.refusals.get(refusal, 0) + 1
        if problem is None:
            mutant.unlink(missing_ok=True)
            return
        where = answer.get("where") or _traceback_where(answer.get("stderr", ""))
        sig = signature(self.reader, problem, where)
        if sig not in self.failures:
            self.failures[sig] = (str(mutant), mutations, problem, where)
        else:
            mutant.unlink(missing_ok=True)

    def report(self) -> str:
        lines = [
            f"{self.reader}: {self.mutants} mutants, {self.past_header / max(self.mutants, 1):.0%} past the header, "
            f"outcomes {self.outcomes}, slowest {self.slowest:.2f} s, reached {self.notes}"
        ]
        common = sorted(self.refusals.items(), key=lambda kv: -kv[1])[:12]
        lines += [f"  refused {count}x: {sig}" for sig, count in common]
        for sig, (mutant, mutations, problem, where) in sorted(self.failures.items()):
            lines.append(f"  {sig}\n    {problem[:400]}\n    at {where}; mutant {mutant} ({', '.join(mutations)})")
        return "\n".join(lines)
