"""Decode throughput and latency of the engine against baselines measured in the same run (`optkit bench`).

At each batch size B, B random prompts of prompt_len tokens each generate exactly gen_len tokens
(greedy, EOS ignored), submitted at once. Reported per run: output tokens/s (B * gen_len / wall
time), TTFT (submission to a request's first token) and TPOT ((last - first) / (gen_len - 1)) as
p50/p95/p99 over the requests. Baselines: `hf` (transformers `generate` on the same batch, no
padding since the prompts are equally long), `eager` (the engine with CUDA graphs off) and `vllm`
(vLLM on the same model, at its default settings and eager: runtime/vllm_baseline.py).
On CUDA, the batch-1 ceiling: weight bytes / device-to-device copy bandwidth, both measured here.
With `speculative` (--speculative ngram|draft:PATH|eagle:DIR), the engine's rows speculate and report
mean_acceptance_length (accepted tokens + 1 per sequence verification step) and the acceptance
rate, and the same engine without speculation is the baseline `optkit, no speculation`.
"""

import random
import statistics
import time
from dataclasses import dataclass

import torch

from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams

BASELINES = ("hf", "eager", "vllm")


@dataclass
class BenchConfig:
    batch_sizes: list[int]
    prompt_len: int = 128
    gen_len: int = 128
    device: str = "cpu"
    dtype: str = "float32"
    baselines: tuple[str, ...] = ()
    enforce_eager: bool = False
    seed: int = 0
    vllm_python: str | None = None  # vLLM's venv python, for the vllm baseline
    speculative: str | None = None  # the engine's proposer (EngineArgs.speculative); None: none
    num_speculative_tokens: int = 4
    num_scheduler_steps: int | None = None  # EngineArgs': None, the device's default


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p95/p99 (inclusive method); a single value is every percentile."""
    if len(values) == 1:
        return {"p50": values[0], "p95": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98]}


def random_prompts(vocab_size: int, batch_size: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(batch_size)]


def summarize(wall: float, first: list[float], last: list[float], start: float, gen_len: int) -> dict:
    """One run's row: tokens/s and the TTFT / TPOT percentiles (seconds) from per-request times."""
    ttft = [f - start for f in first]
    tpot = [(lt - f) / (gen_len - 1) for f, lt in zip(first, last, strict=True)] if gen_len > 1 else [0.0]
    return {
        "seconds": wall,
        "tokens_per_s": len(first) * gen_len / wall,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
    }


def timed_generate(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, float, list[float], list[float]]:
    """Runs every prompt at once; (wall seconds, start time, each request's first and last
    token times). Each request must produce exactly its max_tokens (set ignore_eos)."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}

    def on_output(i: int, output) -> None:
        now = time.perf_counter()
        first.setdefault(i, now)
        last[i] = now

    start = time.perf_counter()
    outputs = engine.generate(prompts, params, on_output)
    wall = time.perf_counter() - start
    assert [len(o) for o in outputs] == [p.max_tokens for p in params]
    n = len(prompts)
    return wall, start, [first[i] for i in range(n)], [last[i] for i in range(n)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], gen_len: int) -> dict:
    params = [SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)] * len(prompts)
    before = engine.stats()
    wall, start, first, last = timed_generate(engine, prompts, params)
    row = summarize(wall, first, last, start, gen_len)
    after = engine.stats()
    if after.spec_proposer is not None:  # this run's own verification steps
        steps = after.num_spec_steps - before.num_spec_steps
        drafted = after.num_spec_draft_tokens - before.num_spec_draft_tokens
        accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
        row["mean_acceptance_length"] = accepted / steps + 1 if steps else None
        row["acceptance_rate"] = accepted / drafted if drafted else None
    return row


def load_hf(path, dtype: torch.dtype, device: str):
    """transformers' model: `from_pretrained` for a plain checkpoint, dequantized weights for an artifact."""
    from optkit.quant.formats.load import load_model

    model = load_model(path, dtype=dtype).to(device).eval()  # its weight files checked, safetensors only
    model.generation_config.eos_token_id = None  # every request produces exactly gen_len tokens
    return model


class _Timestamps:
    """A transformers streamer: the time of each `put` (the prompt first, then each step's tokens)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:  # value is on the CPU: the step has finished
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], gen_len: int) -> dict:
    device = next(model.parameters()).device
    input_ids = torch.tensor(prompts, device=device)
    streamer = _Timestamps()
    start = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=gen_len,
        min_new_tokens=gen_len,
        do_sample=False,
        pad_token_id=0,
        streamer=streamer,
    )
    wall = time.perf_counter() - start
    assert out.shape[1] == len(prompts[0]) + gen_len
    tokens = streamer.times[1:]  # the first put is the prompt
    n = len(prompts)
    return summarize(wall, [tokens[0]] * n, [tokens[-1]] * n, start, gen_len)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter and persistent buffer, shared ones once."""
    seen, total = set(), 0
    persistent = {name for name, _ in model.state_dict(keep_vars=True).items()}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name in persistent and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def copy_bandwidth(device: str, size_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy, bytes/s, counting the read and the write (as MEASURED.md's 4.25 TB/s)."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size_bytes / statistics.median(times)


def build_engine(model, config: BenchConfig, enforce_eager: bool, speculate: bool = True) -> LLMEngine:
    """The engine a benchmark run measures (bench scripts build it too): room for the largest batch, no
    prefix caching (random prompts share nothing), the run's dtype, device and proposer."""
    largest = max(config.batch_sizes)
    engine_config = EngineConfig(
        max_num_seqs=largest,
        max_num_batched_tokens=max(2048, config.prompt_len),
        max_model_len=config.prompt_len + config.gen_len,
        dtype=config.dtype,
        device=config.device,
        enable_prefix_caching=False,  # random prompts share nothing; keep every run a full prefill
        enforce_eager=enforce_eager,
        speculative=config.speculative if speculate else None,
        num_speculative_tokens=config.num_speculative_tokens,
        num_scheduler_steps=config.num_scheduler_steps,
    )
    return LLMEngine(model, engine_config)


def run_benchmark(model, config: BenchConfig, log=print) -> dict:
    """All runs at every batch size; the result `optkit bench --json` prints."""
    from optkit.modeldir import resolve_model_dir

    path = resolve_model_dir(model)
    torch.manual_seed(config.seed)
    engine = build_engine(path, config, config.enforce_eager)
    log(f"engine ready: {engine.cuda_graphs_note}")
    vocab = engine.model.config.vocab_size
    runners = {"optkit": lambda prompts: run_engine(engine, prompts, config.gen_len)}
    if "eager" in config.baselines and not config.enforce_eager:
        eager = build_engine(path, config, True)
        runners["optkit --enforce-eager"] = lambda prompts: run_engine(eager, prompts, config.gen_len)
    if config.speculative:
        plain = build_engine(path, config, config.enforce_eager, speculate=False)
        runners["optkit, no speculation"] = lambda prompts: run_engine(plain, prompts, config.gen_len)
    if "hf" in config.baselines:
        hf = load_hf(path, getattr(torch, config.dtype), config.device)
        runners["transformers"] = lambda prompts: run_hf(hf, prompts, config.gen_len)
    warm = random_prompts(vocab, 2, min(config.prompt_len, 8), config.seed + 1)
    for run in runners.values():  # first-call costs (kernel compilation, allocator) are not throughput
        run(warm)
    rows = []
    for batch_size in config.batch_sizes:
        prompts = random_prompts(vocab, batch_size, config.prompt_len, config.seed + batch_size)
        for name, run in runners.items():
            log(f"batch {batch_size}: {name}")
            rows.append({"run": name, "batch_size": batch_size, **run(prompts)})
    vllm = None
    if "vllm" in config.baselines:  # one worker, each setting loaded once for every batch size
        from optkit.runtime.vllm_baseline import vllm_rows

        batches = {b: random_prompts(vocab, b, config.prompt_len, config.seed + b) for b in config.batch_sizes}
        peer_rows, vllm = vllm_rows(path, config, batches, warm, engine.model.config, log)
        rows = sorted(rows + peer_rows, key=lambda row: row["batch_size"])
    for row in rows:  # ratios against the baselines of the same batch size
        for base in rows:
            if base["batch_size"] == row["batch_size"] and base["run"] != "optkit" and row["run"] == "optkit":
                row[f"vs {base['run']}"] = row["tokens_per_s"] / base["tokens_per_s"]
    prompt = random_prompts(vocab, 1, config.prompt_len, config.seed)[0]
    eager = engine.runner.graphs is None  # a replayed CUDA graph never calls forward: no split to measure
    overhead = step_overhead(engine, prompt, steps=config.gen_len - 1) if config.gen_len > 1 and eager else None
    result = {
        "model": str(model),
        "kernels": layer_kernels(engine.model, config.device),
        "decode_operators": decode_operators(engine.model, config.device),
        "step_overhead": overhead,
        "device": config.device,
        "device_name": torch.cuda.get_device_name() if config.device.startswith("cuda") else "cpu",
        "dtype": config.dtype,
        "prompt_len": config.prompt_len,
        "gen_len": config.gen_len,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda_graphs": engine.cuda_graphs_note,
        "speculative": config.speculative,
        "num_speculative_tokens": config.num_speculative_tokens if config.speculative else None,
        "num_scheduler_steps": engine.scheduler.config.num_scheduler_steps,  # multi-step decoding's, resolved
        "rows": rows,
    }
    if vllm is not None:
        result["vllm"] = vllm
    if config.device.startswith("cuda"):
        nbytes, bandwidth = weight_bytes(engine.model), copy_bandwidth(config.device)
        ceiling = bandwidth / nbytes
        result["ceiling"] = {"weight_bytes": nbytes, "copy_bytes_per_s": bandwidth, "batch1_tokens_per_s": ceiling}
        for row in rows:
            if row["batch_size"] == 1:
                row["fraction_of_ceiling"] = row["tokens_per_s"] / ceiling
    return result


def step_overhead(engine: LLMEngine, prompt: list[int], steps: int = 100) -> dict:
    """The engine's own time per decode step (scheduling, packing, metadata, sampling, outputs): wall
    time of `engine.step()` minus the time inside the model (its forward and the logits), per token,
    median over the engine steps that decode `steps` tokens of one request (with multi-step decoding
    an engine step decodes several: the model's time is then that of decode_steps less the sampling
    between its steps)."""
    model, sampler = engine.model, engine.sampler
    inside: list[float] = []  # the model's time in this engine step
    depth = [0]

    def timed(method):  # the model's time: its outermost call
        def run(*args, **kwargs):
            if depth[0]:  # compute_logits inside decode_steps: counted there
                return method(*args, **kwargs)
            depth[0], start = 1, time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] = 0
                inside.append(time.perf_counter() - start)

        return run

    class Sampling:  # between decode_steps' steps: the engine's time, not the model's
        def __call__(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return sampler(*args, **kwargs)
            finally:
                if depth[0]:
                    inside.append(start - time.perf_counter())

        def __getattr__(self, name: str):
            return getattr(sampler, name)

    model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
    model.decode_steps, engine.sampler = timed(model.decode_steps), Sampling()
    try:
        params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
        engine.add_request(prompt, params, f"overhead-{id(prompt)}")
        engine.step()  # the prefill
        walls, models, num_tokens = [], [], 0
        while engine.has_unfinished():
            inside.clear()
            before = engine.num_generation_tokens
            start = time.perf_counter()
            engine.step()
            tokens = max(1, engine.num_generation_tokens - before)
            walls.append((time.perf_counter() - start) / tokens)
            models.append(sum(inside) / tokens)
            num_tokens += tokens
    finally:
        del model.forward, model.compute_logits, model.decode_steps  # back to the class's methods
        engine.sampler = sampler
    overheads = [w - m for w, m in zip(walls, models, strict=True)]
    step, overhead = statistics.median(walls), statistics.median(overheads)
    return {
        "step_s": step, "overhead_s": overhead, "overhead_share": overhead / step, "steps": len(walls),
        "tokens": num_tokens,
    }  # fmt: skip


def decode_operators(model: torch.nn.Module, device: str) -> str | None:
    """What runs RMSNorm, RoPE and decode attention on the CPU (kernels/cpu_decode.py); None elsewhere."""
    if not device.startswith("cpu"):
        return None
    from optkit.kernels import cpu_decode

    return cpu_decode.describe(model.get_input_embeddings().weight.dtype)


def layer_kernels(model: torch.nn.Module, device: str, rows: int = 1) -> dict[str, int]:
    """How many quantized layers take each kernel for `rows` rows of input (1: a decode step)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if hasattr(module, "kernel_for"):
            name = f"{type(module).__name__}: {module.kernel_for(device, rows)}"
            counts[name] = counts.get(name, 0) + 1
    return counts
