"""Output tokens/s and mean acceptance length of speculative decoding against plain decoding,
measured in the same run, over proposers x k x temperature x batch size.

Workloads (--workload):
  quote    "repeat this passage": a held-out passage of Python source, then its first line again,
           so a continuation that quotes the passage is what the prompt invites; prompt lookup
           (n-gram) finds the passage, a draft model or an EAGLE head has to predict it.
  heldout  windows of held-out text (prompt-len tokens): an ordinary continuation, where n-gram
           has little to find and a proposer must model the target.
Every run decodes the same requests with EOS ignored (so every run produces the same number of
tokens). Greedy runs are checked token for token against the plain run; sampled runs (T > 0) use
one seed per request, so their outputs are reproducible, not equal.

Runs, at each --batch (requests one after another at 1, in groups otherwise): plain decoding, then
every --speculative proposer (default: ngram, draft:DRAFT, and eagle:HEAD when --eagle names a
head directory) at every k in --ks. Each run is repeated (--repeats, interleaved with the others)
and its fastest time kept, so that other load on the machine does not decide the ratios. On a
machine shared with other jobs, pass --threads 1.

mean_acceptance_length: accepted tokens + 1 per target step (sequence verification step), the
figure EAGLE's and vLLM's papers report.

Step costs, from timers around every engine step and every proposal (all repeats): step_ms, the
median engine step (plain: the target's decode step, prefill steps are few); propose_ms_per_token,
the proposer's time per proposed token (EAGLE: its passes over the head, the stable-KV rows
included, and the LM head's logits). At batch 1 their ratio is the head's step against the target's.

Usage: python bench/speculative.py [--target small] [--draft draft] [--eagle HEAD_DIR]
                                   [--speculative ngram draft:draft eagle:DIR] [--ks 2 3 4 5 6]
                                   [--temperatures 0 0.8] [--batches 1 8] [--workload heldout]
                                   [--max-tokens 64] [--threads 1] [--json]
"""

import argparse
import json
import random
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.modeldir import load_tokenizer, resolve_model_dir
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams


def quoting_prompts(tokenizer, n: int, seed: int, lines: int = 12) -> list[list[int]]:
    """A passage of `lines` consecutive non-blank lines of held-out source, then its first line again."""
    rng = random.Random(seed)
    source = [line for text in load_text_set("heldout").texts for line in text.splitlines() if line.strip()]
    prompts = []
    while len(prompts) < n:
        start = rng.randrange(0, len(source) - lines)
        passage = source[start : start + lines]
        if len(passage[0].strip()) < 12:  # a first line too short to point at the passage
            continue
        prompts.append(tokenizer.encode("\n".join(passage) + "\n\n" + passage[0] + "\n"))
    return prompts


def heldout_prompts(tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """`n` windows of `prompt_len` held-out tokens, spread evenly over the set."""
    windows = pack_windows(tokenize_stream(tokenizer, load_text_set("heldout").texts), prompt_len)
    picks = torch.linspace(0, len(windows) - 1, n).round().long()
    return windows[picks].tolist()


def run(engine, prompts, batch: int, max_tokens: int, temperature: float) -> tuple[float, list[list[int]]]:
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=i if temperature else None)
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outputs = []
    for b in range(0, len(prompts), batch):
        outputs += engine.generate(prompts[b : b + batch], params[b : b + batch])
    return time.perf_counter() - start, outputs


class StepTimer:
    """Wraps an engine's `step` and its proposer's `propose` (if speculative) with wall-clock timers."""

    def __init__(self, engine):
        self.step_seconds: list[float] = []
        self.propose_seconds = 0.0
        engine.step = self._timed(engine.step, self.step_seconds.append)
        proposer = getattr(engine.decoding, "proposer", None)
        if proposer is not None:
            proposer.propose = self._timed(proposer.propose, self._add_propose)

    def _add_propose(self, seconds: float) -> None:
        self.propose_seconds += seconds

    @staticmethod
    def _timed(function, record):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            record(time.perf_counter() - start)
            return result

        return timed

    def reset(self) -> None:
        self.step_seconds.clear()
        self.propose_seconds = 0.0


def measure(engines: dict, timers: dict, prompts, batch: int, temperature: float, args) -> list[dict]:
    best: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    before = {name: engine.stats() for name, engine in engines.items()}
    for timer in timers.values():
        timer.reset()
    for _ in range(args.repeats):
        for name, engine in engines.items():
            seconds, outputs[name] = run(engine, prompts, batch, args.max_tokens, temperature)
            best[name] = min(seconds, best.get(name, seconds))
    rows = []
    for name, engine in engines.items():
        after, seconds = engine.stats(), best[name]
        steps = after.num_spec_steps - before[name].num_spec_steps
        drafted = after.num_spec_draft_tokens - before[name].num_spec_draft_tokens
        accepted = after.num_spec_accepted_tokens - before[name].num_spec_accepted_tokens
        tokens = sum(len(o) for o in outputs[name])
        timer = timers[name]
        rows.append(
            {
                "batch": batch,
                "temperature": temperature,
                "run": name,
                "seconds": seconds,
                "tokens": tokens,
                "tokens_per_s": tokens / seconds,
                "speedup": best["plain"] / seconds,
                "same_tokens_as_plain": outputs[name] == outputs["plain"] if temperature == 0 else None,
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_acceptance_length": accepted / steps + 1 if steps else None,
                "step_ms": 1e3 * statistics.median(timer.step_seconds),
                "propose_ms_per_token": 1e3 * timer.propose_seconds / drafted if drafted else None,
            }
        )
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="small")
    parser.add_argument("--draft", default="draft", help="the draft model of the default draft run")
    parser.add_argument("--eagle", help="an EAGLE head directory for the target (adds eagle:DIR to the defaults)")
    parser.add_argument("--speculative", nargs="+", help="proposers (default: ngram draft:DRAFT [eagle:HEAD])")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5, 6], help="speculative tokens per step")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workload", choices=("quote", "heldout"), default="quote")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of the heldout workload")
    parser.add_argument("--requests", type=int, default=8, help="requests per run (a multiple of every batch)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration; the fastest counts")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the GPU line: bench/gpu/run.sh)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = resolve_model_dir(args.target)
    proposers = args.speculative or ["ngram", f"draft:{args.draft}", *([f"eagle:{args.eagle}"] if args.eagle else [])]
    tokenizer = load_tokenizer(target)
    if args.workload == "quote":
        prompts = quoting_prompts(tokenizer, args.requests, args.seed)
    else:
        prompts = heldout_prompts(tokenizer, args.requests, args.prompt_len)

    max_seqs = max(args.batches)
    place = {"device": args.device, "dtype": args.dtype}
    configs = {"plain": EngineConfig(max_num_seqs=max_seqs, **place)}
    kinds = [spec.partition(":")[0] for spec in proposers]
    for spec in proposers:
        label = spec.partition(":")[0]
        if kinds.count(label) > 1:  # two EAGLE heads (eagle1 and eagle3): named by their directories
            label = spec.partition(":")[2].rstrip("/").rsplit("/", 1)[-1]
        for k in args.ks:  # rows named "ngram k=4", "eagle k=3"
            name = f"{label} k={k}"
            configs[name] = EngineConfig(max_num_seqs=max_seqs, speculative=spec, num_speculative_tokens=k, **place)
    engines = {name: LLMEngine(target, config) for name, config in configs.items()}
    timers = {name: StepTimer(engine) for name, engine in engines.items()}
    for engine in engines.values():  # warm-up: first-call costs are not throughput
        run(engine, prompts[:2], 2, 8, 0.0)
    rows = []
    for temperature in args.temperatures:
        for batch in args.batches:
            rows += measure(engines, timers, prompts, batch, temperature, args)
    if args.json:
        report = {"target": args.target, "proposers": proposers, "workload": args.workload, "runs": rows}
        print(json.dumps({**report, "max_tokens": args.max_tokens, "threads": torch.get_num_threads()}, indent=2))
        return
    show(rows, args, proposers, len(prompts))


def show(rows: list[dict], args, proposers: list[str], requests: int) -> None:
    title = (
        f"target {args.target}, proposers {' '.join(proposers)}: {requests} {args.workload} requests x "
        f"{args.max_tokens} tokens, {torch.get_num_threads()} threads"
    )
    table = Table(title=title)
    columns = ("T", "batch", "run", "s", "tok/s", "vs plain", "accepted", "mean acc. len", "step ms", "ms/proposal")
    for column in (*columns, "= plain"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=True)
    for row in rows:
        same = row["same_tokens_as_plain"]
        table.add_row(
            f"{row['temperature']:g}",
            str(row["batch"]),
            row["run"],
            f"{row['seconds']:.2f}",
            f"{row['tokens_per_s']:.0f}",
            f"{row['speedup']:.2f}x",
            "" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}",
            "" if row["mean_acceptance_length"] is None else f"{row['mean_acceptance_length']:.2f}",
            f"{row['step_ms']:.1f}",
            "" if row["propose_ms_per_token"] is None else f"{row['propose_ms_per_token']:.2f}",
            "" if same is None else "yes" if same else "NO",
        )
    Console().print(table)
    print("accepted: proposals the target accepted; mean acc. len: accepted tokens + 1 per target step")
    print("step ms: median engine step; ms/proposal: the proposer's time per proposed token")


if __name__ == "__main__":
    main()
