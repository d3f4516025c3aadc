"""What shadow mode costs the client, and whether its online numbers match the offline gate's.

One server process (this one), two engines: the RTN 2-bit `small` (QUANT) and the full `small`
(FULL), with `--shadow QUANT=FULL`. Requests for QUANT arrive open-loop at a fixed interval (by
default twice the mean latency measured alone, so the server is busy about half the time and
shadow replays get idle gaps, as they would in real traffic). The run alternates blocks with
shadow off (rate 0) and on (each rate asked for), in the order off, on, on, off, ... so drift of
a shared machine hits both alike, and compares client latency p50 (arrival to the last byte, over
HTTP) on vs off: pooled over all blocks (with a 90% bootstrap interval over rounds), and as the
median over rounds of the on block's p50 / the off block's. Each block's queued replays are drained
before the next block starts.

A shared machine's drift is still large next to 5%, so a second, finer design isolates the cost:
in one stretch of traffic each request is replayed or not at random (rate 0.5), and the p50 of the
requests that arrived right after a replayed one ("exposed": the replay ran in the gap before them,
or was still running when they came) is compared with that of the others. Neighbouring requests
share the machine's state, so the drift cancels; at rate r about r of the requests are exposed.

Torch runs on `--threads` threads (default 1): on a small shared CPU, two OpenMP threads per
engine make every step wait for a descheduled partner and swamp what is measured.

Then every sequence the shadow worker scored is scored again offline, the way `optkit eval` scores
(HF modules from `optkit.quant.formats.load.load_model`, the gate's `TokenStats`), and the online mean KLD
and same-top-token percent (from /metrics) are compared with the offline ones.

Usage: python bench/shadow_overhead.py [--rates 0.05 1.0] [--blocks 16] [--requests 6] [--threads 1] [--json]
"""

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

try:
    import httpx2 as httpx
except ImportError:  # older openai releases depend on httpx itself
    import httpx

from optkit.data.eval_sets import load_text_set
from optkit.modeldir import load_tokenizer, resolve_model_dir
from optkit.quant.formats.load import load_model
from optkit.routing.config import serve_options
from optkit.routing.online import ShadowScore, score_sequence, total
from optkit.routing.startup import start_router
from optkit.runtime.engine import EngineConfig
from optkit.server.app import build_app

QUANT, FULL = "small-w2", "small"


def quantized_small(directory: Path) -> Path:
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    out = directory / QUANT
    quantize_model(resolve_model_dir("small"), out, QuantizeOptions(weights=WeightScheme(bits=2, group_size=-1)))
    return out


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = load_tokenizer("small").encode("\n".join(load_text_set("heldout").texts))
    prompts = []
    for _ in range(n):
        length = rng.randint(16, 64)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


class Server:
    """The app on a real socket, uvicorn on a thread of its own."""

    def __init__(self, app):
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def request(client: httpx.Client, base: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": QUANT, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    response = client.post(f"{base}/v1/completions", json=body, timeout=120)
    elapsed = time.perf_counter() - start
    assert response.status_code == 200 and response.headers["x-optkit-model"] == QUANT, response.text
    return elapsed


def open_loop(base: str, prompts: list[list[int]], interval_s: float, max_tokens: int) -> list[float]:
    """Send one request every interval_s (whether or not the previous finished); their latencies."""
    with httpx.Client() as client, ThreadPoolExecutor(max_workers=16) as pool:
        futures, start = [], time.perf_counter()
        for i, prompt in enumerate(prompts):
            time.sleep(max(0.0, start + i * interval_s - time.perf_counter()))
            futures.append(pool.submit(request, client, base, prompt, max_tokens))
        return [f.result() for f in futures]


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def offline(quant_dir: Path, sequences: list[tuple[list[int], int]]) -> dict[str, float]:
    """The gate's numbers over the output positions of exactly the sequences scored online."""
    full_model, quant_model = load_model("small"), load_model(quant_dir)
    scores = []
    with torch.inference_mode():
        for token_ids, num_prompt_tokens in sequences:
            x = torch.tensor([token_ids])
            full_logits, quant_logits = full_model(x).logits[0], quant_model(x).logits[0]
            scores.append(score_sequence(full_logits, quant_logits, token_ids, num_prompt_tokens))
    return total(scores).metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.05, 1.0])
    parser.add_argument("--blocks", type=int, default=16, help="rounds of one block per mode")
    parser.add_argument("--requests", type=int, default=6, help="requests per block")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--load", type=float, default=0.5, help="arrival interval = mean latency alone / load")
    parser.add_argument("--exposure-requests", type=int, default=160, help="requests of the exposure design")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        quant_dir = quantized_small(Path(tmp))
        options = serve_options(
            {
                "models": {QUANT: {"path": str(quant_dir)}, FULL: {"path": "small"}},
                "shadow": {"pairs": {QUANT: FULL}, "rate": 0.0, "seed": args.seed},
            }
        )
        router = start_router(options, EngineConfig(max_num_seqs=16, kv_cache_blocks=512))
        scored: list[tuple[list[int], int]] = []
        score = router.shadow.score

        def recording(job, pause) -> ShadowScore:
            scored.append((list(job.token_ids), job.num_prompt_tokens))
            return score(job, pause)

        router.shadow.score = recording
        server = Server(build_app(router, None, shutdown_engine=True))
        try:
            result = run(server.base, router, args)
            result["exposure"] = exposure(server.base, router, args, result["interval_s"])
            online = {"kld_mean": metric(server.base, "optkit:shadow_kld_nats_total")}
            tokens = metric(server.base, "optkit:shadow_tokens_total")
            online = {
                "kld_mean": online["kld_mean"] / tokens,
                "top1_pct": 100 * metric(server.base, "optkit:shadow_top1_matches_total") / tokens,
                "num_tokens": tokens,
            }
        finally:
            server.stop()
            router.shutdown()
        result["quality"] = {"online": online, "offline": offline(quant_dir, scored), "requests": len(scored)}
    report(result, args.json)


def run(base: str, router, args) -> dict:
    prompts = make_prompts(args.requests * args.blocks * (1 + len(args.rates)) * 2 + 8, args.seed)
    with httpx.Client() as client:  # warm-up, and the latency of one request alone
        alone = [request(client, base, p, args.max_tokens) for p in prompts[:8]]
    interval = statistics.mean(alone[2:]) / args.load
    prompts = prompts[8:]
    modes = ["off", *(f"on@{r:g}" for r in args.rates)]
    rounds: dict[str, list[list[float]]] = {mode: [] for mode in modes}  # mode -> each round's latencies
    replays: dict[str, int] = dict.fromkeys(modes, 0)
    for block in range(args.blocks):
        for mode in modes if block % 2 == 0 else modes[::-1]:
            router.shadow.rate = 0.0 if mode == "off" else float(mode[3:])
            before = router.shadow.pairs[QUANT].scored
            batch, prompts = prompts[: args.requests], prompts[args.requests :]
            measured = open_loop(base, batch, interval, args.max_tokens)
            router.shadow.drain(timeout=300)
            rounds[mode].append(measured)
            replays[mode] += router.shadow.pairs[QUANT].scored - before
    latencies = {mode: [x for block in blocks for x in block] for mode, blocks in rounds.items()}
    p50 = {mode: statistics.median(values) for mode, values in latencies.items()}
    paired = {
        mode: statistics.median(
            statistics.median(on) / statistics.median(off) for on, off in zip(rounds[mode], rounds["off"], strict=True)
        )
        for mode in modes
    }
    return {
        "threads": args.threads,
        "alone_s": statistics.mean(alone[2:]),
        "interval_s": interval,
        "requests_per_mode": {mode: len(v) for mode, v in latencies.items()},
        "replays": replays,
        "p50_s": p50,
        "p50_ratio_vs_off": {mode: p50[mode] / p50["off"] for mode in p50},
        "paired_block_p50_ratio": paired,
        "p50_ratio_ci90": {mode: bootstrap_ci(rounds[mode], rounds["off"], args.seed) for mode in modes},
        "p90_s": {mode: statistics.quantiles(v, n=10)[-1] for mode, v in latencies.items()},
    }


def exposure(base: str, router, args, interval: float) -> dict:
    """p50 of requests arriving right after a replayed request over that of the others (rate 0.5)."""
    rng = random.Random(args.seed + 1)
    decisions: list[bool] = []  # route() asks once per request, in arrival order

    def sample() -> bool:
        decisions.append(rng.random() < 0.5)
        return decisions[-1]

    router.shadow.sample = sample
    prompts = make_prompts(args.exposure_requests, args.seed + 2)
    latencies = open_loop(base, prompts, interval, args.max_tokens)
    router.shadow.drain(timeout=300)
    exposed = [t for t, after_replay in zip(latencies[1:], decisions, strict=False) if after_replay]
    others = [t for t, after_replay in zip(latencies[1:], decisions, strict=False) if not after_replay]
    ratios = []
    for _ in range(2000):
        a = [exposed[rng.randrange(len(exposed))] for _ in exposed]
        b = [others[rng.randrange(len(others))] for _ in others]
        ratios.append(statistics.median(a) / statistics.median(b))
    ratios.sort()
    return {
        "requests": len(latencies),
        "exposed": len(exposed),
        "p50_exposed_s": statistics.median(exposed),
        "p50_others_s": statistics.median(others),
        "ratio": statistics.median(exposed) / statistics.median(others),
        "ratio_ci90": (ratios[100], ratios[1900]),
    }


def bootstrap_ci(on: list[list[float]], off: list[list[float]], seed: int, n: int = 2000) -> tuple[float, float]:
    """90% interval of the pooled p50 ratio, resampling whole rounds (a round's on and off blocks
    ran side by side, so they are resampled together)."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        picks = [rng.randrange(len(on)) for _ in on]
        on_p50 = statistics.median(x for i in picks for x in on[i])
        off_p50 = statistics.median(x for i in picks for x in off[i])
        ratios.append(on_p50 / off_p50)
    ratios.sort()
    return ratios[int(0.05 * n)], ratios[int(0.95 * n)]


def report(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    alone, interval = result["alone_s"] * 1000, result["interval_s"] * 1000
    print(f"one request alone: {alone:.1f} ms; arrivals every {interval:.1f} ms; {result['threads']} torch thread(s)")
    for mode, p50 in result["p50_s"].items():
        ratio, paired = result["p50_ratio_vs_off"][mode], result["paired_block_p50_ratio"][mode]
        low, high = result["p50_ratio_ci90"][mode]
        print(
            f"{mode:>8}: p50 {p50 * 1000:7.1f} ms ({ratio:.3f}x off, 90% CI {low:.3f}-{high:.3f}; "
            f"per round {paired:.3f}x), "
            f"p90 {result['p90_s'][mode] * 1000:7.1f} ms, "
            f"{result['requests_per_mode'][mode]} requests, {result['replays'][mode]} replays"
        )
    for mode, ratio in result["p50_ratio_vs_off"].items():
        if mode != "off":
            verdict = "within" if ratio <= 1.05 else "OVER"
            print(f"{mode}: shadow adds {100 * (ratio - 1):+.1f}% to client p50 ({verdict} the 5% bound)")
    e = result["exposure"]
    low, high = e["ratio_ci90"]
    print(
        f"exposure: p50 right after a replay {e['p50_exposed_s'] * 1000:.1f} ms ({e['exposed']} requests) vs "
        f"{e['p50_others_s'] * 1000:.1f} ms otherwise: {e['ratio']:.3f}x (90% CI {low:.3f}-{high:.3f})"
    )
    quality = result["quality"]
    online, offline_ = quality["online"], quality["offline"]
    for key in ("kld_mean", "top1_pct"):
        diff = abs(online[key] / offline_[key] - 1) * 100
        print(f"{key}: online {online[key]:.5f}, offline {offline_[key]:.5f} ({diff:.4f}% apart)")
    print(f"over {quality['requests']} replayed requests, {int(online['num_tokens'])} output tokens")


if __name__ == "__main__":
    main()
