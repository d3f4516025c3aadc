"""Soak and faults: `optkit serve small` (a subprocess on a free port) under many clients at once.

Sends `--requests` requests from `--concurrency` clients: completions and chat, streamed and not;
`--disconnect` of them are streams whose client hangs up after the first chunk; `--bad` of them are
malformed or oversized (invalid JSON, a lone surrogate, too many stop strings, a wrong type, an
unknown parameter, a body over --max-request-bytes). Meanwhile /health is polled every 50 ms, and
once, halfway, a body just under the size cap (a prompt far over the context, so the server
tokenizes it and refuses it) is sent while /health is timed on its own.

Reports requests/s, latency p50/p95/p99 of the requests answered in full, 5xx (must be 0), transport
errors outside the planned hang-ups and refusals (must be 0), KV blocks in use once the server is
idle again (must be 0), the server's RSS after a warm-up and after the run (growth under 10%), and
/health p99 (under 100 ms) over the run and during the big body.

`--shadow` serves `--model a=small --model b=small --shadow a=b --shadow-rate 1` and sends every
request to `a`, so each one is also replayed on `b`.

Usage: python bench/soak.py [--requests 2000] [--concurrency 64] [--max-tokens 8] [--shadow] [--json]
"""

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

CAP = 4 << 20  # the server's default --max-request-bytes for `small`
PROMPTS = ["Once upon a time", "The cat sat on", "def add(a, b):", "In a small village", "The answer is"]


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)  # requests answered in full, seconds
    statuses: dict[int, int] = field(default_factory=dict)
    hung_up: int = 0  # planned: the client closed a stream after its first chunk
    transport_errors: list[str] = field(default_factory=list)
    refused_while_sending: int = 0  # an oversized body whose connection the server closed (after its 413)

    def status(self, code: int) -> None:
        self.statuses[code] = self.statuses.get(code, 0) + 1


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bad_request(i: int, model: str) -> tuple[str, bytes]:
    """(path, body) of the i-th malformed or oversized request."""
    kinds = [
        ("/v1/completions", b'{"model": "%s", "prompt": "unterminated' % model.encode()),
        ("/v1/completions", b'{"model": "%s", "prompt": "hi \\ud800"}' % model.encode()),
        ("/v1/chat/completions", json.dumps({"model": model, "messages": [{"role": "user", "content": "\ud800"}]})),
        ("/v1/completions", json.dumps({"model": model, "prompt": "hi", "stop": list("abcde")})),
        ("/v1/completions", json.dumps({"model": model, "prompt": "hi", "max_tokens": "8"})),
        ("/v1/completions", json.dumps({"model": model, "prompt": "hi", "repetition_penalty": 1e-300})),
        ("/v1/completions", json.dumps({"model": model, "prompt": "hi", "frobnicate": True})),
        ("/v1/completions", b'{"prompt": "' + b"x" * CAP + b'"}'),
    ]
    path, body = kinds[i % len(kinds)]
    return path, body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")


def good_request(rng: random.Random, model: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    prompt = rng.choice(PROMPTS) + " " + " ".join(rng.choice(PROMPTS) for _ in range(rng.randint(0, 6)))
    body = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]), "stream": stream}
    if rng.random() < 0.5:
        return "/v1/completions", body | {"prompt": prompt}
    return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}


async def one(session: aiohttp.ClientSession, base: str, plan: tuple, tally: Tally) -> None:
    kind, path, body = plan
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    started = time.monotonic()
    try:
        async with session.post(base + path, data=data, headers={"content-type": "application/json"}) as response:
            tally.status(response.status)
            if kind == "hang-up" and response.status == 200:
                await response.content.readany()  # the first chunk, then the connection is dropped
                response.close()
                tally.hung_up += 1
                return
            await response.read()
            if response.status == 200:
                tally.latencies.append(time.monotonic() - started)
    except aiohttp.ClientError as e:
        if kind == "bad" and len(data) > CAP:
            tally.refused_while_sending += 1  # the 413 went out and the connection closed mid-upload
        else:
            tally.transport_errors.append(f"{kind} {path} {data[:60]!r}: {type(e).__name__}: {e}")


async def poll_health(session: aiohttp.ClientSession, base: str, until: asyncio.Event, into: list[float]) -> None:
    while not until.is_set():
        started = time.monotonic()
        async with session.get(base + "/health") as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"/health answered {response.status}")
        into.append(time.monotonic() - started)
        await asyncio.sleep(0.05)


async def big_body(session: aiohttp.ClientSession, base: str, model: str) -> tuple[int, list[float]]:
    """A body just under the cap while /health is timed; the status it got and those timings."""
    overhead = len(json.dumps({"model": model, "prompt": ""}))
    words = ("lorem ipsum dolor sit amet " * (CAP // 27 + 1))[: CAP - overhead - 16]
    data = json.dumps({"model": model, "prompt": words}).encode()
    assert len(data) < CAP
    done, timings = asyncio.Event(), []
    poller = asyncio.create_task(poll_health(session, base, done, timings))
    async with session.post(base + "/v1/completions", data=data, headers={"content-type": "application/json"}) as r:
        await r.read()
        status = r.status
    done.set()
    await poller
    return status, timings


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as response:
        text = await response.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


async def drive(base: str, pid: int, args) -> dict:
    rng = random.Random(args.seed)
    model = "a" if args.shadow else "small"
    plans = []
    for i in range(args.requests):
        roll = rng.random()
        if roll < args.bad:
            plans.append(("bad", *bad_request(i, model)))
        elif roll < args.bad + args.disconnect:
            plans.append(("hang-up", *good_request(rng, model, args.max_tokens * 4, stream=True)))
        else:
            plans.append(("good", *good_request(rng, model, args.max_tokens, stream=rng.random() < 0.5)))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for i in range(8):  # warm-up, so RSS "before" is the steady state's, not the import's
            await one(session, base, ("good", *good_request(rng, model, args.max_tokens, stream=i % 2 == 0)), Tally())
        rss_before = psutil.Process(pid).memory_info().rss
        tally, health = Tally(), []
        done = asyncio.Event()
        poller = asyncio.create_task(poll_health(session, base, done, health))
        queue: asyncio.Queue = asyncio.Queue()
        for plan in plans:
            queue.put_nowait(plan)

        async def client() -> None:
            while not queue.empty():
                await one(session, base, queue.get_nowait(), tally)

        started = time.monotonic()
        clients = [asyncio.create_task(client()) for _ in range(args.concurrency)]
        await asyncio.sleep(min(5.0, args.requests / 200))
        big_status, big_health = await big_body(session, base, model)
        await asyncio.gather(*clients)
        elapsed = time.monotonic() - started
        done.set()
        await poller
        deadline = time.monotonic() + 60  # aborted and shadow requests drain
        while True:
            samples = await metrics(session, base)
            idle = samples["optkit:num_requests_running"] == samples["optkit:num_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)
        samples = await metrics(session, base)
        rss_after = psutil.Process(pid).memory_info().rss
    kv_in_use = round(samples["optkit:kv_cache_usage_perc"] * samples["optkit:num_kv_blocks"])
    aborted = samples.get('optkit:request_success_total{finish_reason="abort"}', 0)
    server_errors = sum(n for code, n in tally.statuses.items() if code >= 500)
    return {
        "mode": "shadow a=b" if args.shadow else "small",
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "seconds": round(elapsed, 1),
        "requests_per_s": round(args.requests / elapsed, 1),
        "latency_p50_s": round(percentile(tally.latencies, 50), 3),
        "latency_p95_s": round(percentile(tally.latencies, 95), 3),
        "latency_p99_s": round(percentile(tally.latencies, 99), 3),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "server_errors": server_errors,
        "hung_up": tally.hung_up,
        "aborted_by_server": int(aborted),
        "refused_while_sending": tally.refused_while_sending,
        "transport_errors": len(tally.transport_errors),
        "transport_error_examples": tally.transport_errors[:3],
        "kv_blocks_in_use_at_end": kv_in_use,
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_after_mib": round(rss_after / 2**20, 1),
        "rss_growth_pct": round(100 * (rss_after - rss_before) / rss_before, 1),
        "health_polls": len(health),
        "health_p50_ms": round(1000 * percentile(health, 50), 1),
        "health_p99_ms": round(1000 * percentile(health, 99), 1),
        "big_body_bytes": CAP - 16,
        "big_body_status": big_status,
        "health_during_big_body_polls": len(big_health),
        "health_during_big_body_max_ms": round(1000 * max(big_health, default=float("nan")), 1),
    }


def verdicts(r: dict) -> list[tuple[str, bool, str]]:
    return [
        ("no 5xx", r["server_errors"] == 0, str(r["server_errors"])),
        ("no unplanned transport errors", r["transport_errors"] == 0, str(r["transport_errors"])),
        ("KV blocks in use at the end = 0", r["kv_blocks_in_use_at_end"] == 0, str(r["kv_blocks_in_use_at_end"])),
        ("RSS growth < 10%", r["rss_growth_pct"] < 10, f"{r['rss_growth_pct']}%"),
        ("/health p99 < 100 ms", r["health_p99_ms"] < 100, f"{r['health_p99_ms']} ms"),
        (
            "/health < 100 ms during the big body",
            r["health_during_big_body_max_ms"] < 100,
            f"max {r['health_during_big_body_max_ms']} ms over {r['health_during_big_body_polls']} polls",
        ),
        ("big body refused as a 400, not 413/5xx", r["big_body_status"] == 400, str(r["big_body_status"])),
    ]


def start_server(args, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    models = ["--model", "a=small", "--model", "b=small", "--shadow", "a=b", "--shadow-rate", "1"]
    command = [sys.executable, "-m", "optkit.cli.main", "serve", *(models if args.shadow else ["small"])]
    command += ["--port", str(port), "--max-num-seqs", str(args.concurrency)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"optkit serve exited with code {process.returncode}:\n{log.read_text()}")
        if re.search(r"^serving ", log.read_text(), re.M):
            return process, base
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"optkit serve did not start within 300 s:\n{log.read_text()}")


def show(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"soak: {r['mode']}, {r['requests']} requests at concurrency {r['concurrency']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in r.items():
        if key not in ("mode", "transport_error_examples"):
            table.add_row(key, str(value))
    checks = Table(title="criteria")
    checks.add_column("criterion")
    checks.add_column("value", justify="right")
    checks.add_column("verdict")
    for name, ok, value in verdicts(r):
        checks.add_row(name, value, "[green]pass[/]" if ok else "[red]FAIL[/]")
    console = Console(width=120)
    console.print(table)
    console.print(checks)
    for example in r["transport_error_examples"]:
        console.print(f"transport error: {example}", soft_wrap=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8, help="per request (hang-ups ask 4x, to be mid-stream)")
    parser.add_argument("--disconnect", type=float, default=0.10, help="fraction of clients hanging up mid-stream")
    parser.add_argument("--bad", type=float, default=0.05, help="fraction of malformed or oversized requests")
    parser.add_argument("--shadow", action="store_true", help="serve a=small, b=small with --shadow a=b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        process, base = start_server(args, log)
        try:
            result = asyncio.run(drive(base, process.pid, args))
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        server_log = log.read_text()
    result["server_tracebacks"] = server_log.count("Traceback")
    result["machine"] = f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB"
    result["passed"] = all(ok for _, ok, _ in verdicts(result)) and result["server_tracebacks"] == 0
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        show(result)
        print("PASS" if result["passed"] else "FAIL")
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
