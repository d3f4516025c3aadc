"""`ServeOptions` -> running engines and the `Router` over them (optkit serve).

Everything that can be checked before loading a model is: names (config.check_references), then
each shadow pair's tokenizers (a replay compares the two models token for token, so they must
share one). Then each model gets its own engine and KV cache:
- `kv_cache_blocks`: that many blocks;
- `kv_cache_fraction`: that share of the KV memory budget a single model gets by default
  (runtime/engine.py: KV_CACHE_MEMORY_FRACTION of the machine's memory), capped, as the engine's
  default is, at max_num_seqs sequences of full length;
- neither: an equal share of what the fractions leave (alone: the engine's own default).
"""

import logging
import math
import os
import sys

from optkit.errors import OptkitError
from optkit.routing import LOGGER
from optkit.routing.config import ServeOptions
from optkit.routing.router import Router


def _bytes_per_counted_block(config, base) -> int:
    """The memory one of `kv_cache_blocks`' blocks takes once the engine has built its cache.
    kv_cache_blocks counts blocks at the model's dtype (`full` bytes each); an 8-bit cache turns N of
    them into N·full/data blocks of `data` bytes plus their scale side table (runtime/engine.py), so a
    counted block costs full · (data + table) / data."""
    import torch

    from optkit.kernels.kv_cache import bytes_per_block

    shape = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim, base.block_size)
    dtype = getattr(torch, base.dtype)
    full = bytes_per_block(*shape, "auto", dtype)
    if base.kv_cache_dtype == "auto":
        return full
    data = bytes_per_block(*shape, base.kv_cache_dtype, dtype, scales=False)
    return math.ceil(full * bytes_per_block(*shape, base.kv_cache_dtype, dtype) / data)


def check_tokenizers(options: ServeOptions) -> None:
    from optkit.modeldir import load_tokenizer, read_config, resolve_model_dir

    for quant, full in options.shadow.pairs.items():
        if quant in options.backends or full in options.backends:
            continue  # its tokenizer is known once it answers (check_upstream_pairs)
        dirs = resolve_model_dir(options.models[quant].path), resolve_model_dir(options.models[full].path)
        vocab_sizes = [read_config(d).get("vocab_size") for d in dirs]
        tokenizers = [load_tokenizer(d) for d in dirs]
        vocabs = [t.get_vocab() for t in tokenizers]
        specials = [(t.bos_token_id, t.eos_token_id) for t in tokenizers]
        if vocab_sizes[0] != vocab_sizes[1] or vocabs[0] != vocabs[1] or specials[0] != specials[1]:
            differ = sum(vocabs[0].get(token) != i for token, i in vocabs[1].items())
            raise OptkitError(
                f"--shadow {quant}={full}: the two models have different tokenizers (vocab_size {vocab_sizes[0]} vs "
                f"{vocab_sizes[1]}, {differ} tokens differ): shadow a quantized model with the model it was made from"
            )


def kv_cache_blocks(options: ServeOptions, base, memory_bytes: int | None = None) -> dict[str, int | None]:
    """Blocks per model (None: the engine's own default). `base` is the shared EngineConfig."""
    from optkit.modeldir import read_config, resolve_model_dir
    from optkit.models.config import ModelConfig
    from optkit.runtime.engine import KV_CACHE_MEMORY_FRACTION

    specs = options.models
    unset = [n for n, s in specs.items() if s.kv_cache_blocks is None and s.kv_cache_fraction is None]
    if len(specs) == 1 and unset:
        return {name: base.kv_cache_blocks for name in specs}
    fractions = {n: s.kv_cache_fraction for n, s in specs.items() if s.kv_cache_fraction is not None}
    rest = max(0.0, 1.0 - sum(fractions.values()))
    fractions |= {name: rest / len(unset) for name in unset}
    memory = memory_bytes if memory_bytes is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = memory * KV_CACHE_MEMORY_FRACTION
    blocks: dict[str, int | None] = {}
    for name, spec in specs.items():
        if spec.kv_cache_blocks is not None:
            blocks[name] = spec.kv_cache_blocks
            continue
        if fractions[name] == 0:
            raise OptkitError(f"no KV memory is left for {name}: the --kv-cache-fraction values take all of it")
        config = ModelConfig.from_hf(read_config(resolve_model_dir(spec.path)))
        max_model_len = min(base.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        wanted = base.max_num_seqs * math.ceil(max_model_len / base.block_size)
        blocks[name] = max(1, min(wanted, int(fractions[name] * budget) // _bytes_per_counted_block(config, base)))
    return blocks


def start_router(options: ServeOptions, base) -> Router:
    """Loads every model into its own engine (`base`: the EngineConfig they share) and wires
    shadow scoring and fallback. Engines already started are stopped if a later one fails."""
    from optkit.routing.fallback import FallbackMonitor
    from optkit.routing.forcing import runtime_scorer
    from optkit.routing.load import LoadTracker
    from optkit.routing.shadow import ShadowService
    from optkit.runtime.async_engine import AsyncEngine

    check_tokenizers(options)
    blocks = kv_cache_blocks(options, base)
    upstreams = start_upstreams(options)  # each asked what it serves before any model loads
    engines = {}
    try:
        for name, spec in options.models.items():
            config = base.model_copy(update={"kv_cache_blocks": blocks[name]})
            engines[name] = AsyncEngine.start(spec.path, config, name)
        engines |= upstreams  # after the models: the first --model stays the default
        check_upstream_pairs(options, engines)
    except BaseException:
        for engine in engines.values():
            engine.shutdown()
        raise
    pairs = options.shadow.pairs
    fallbacks = {}
    if options.fallback.threshold is not None:
        fallbacks = {quant: FallbackMonitor(quant, full, options.fallback) for quant, full in pairs.items()}
    load = LoadTracker(list(engines), options.spill_over.window_s)
    shadow = None
    if pairs:
        scorer = runtime_scorer(
            {n: engines[n] for n in options.models}, options.shadow.chunk_tokens, upstreams=upstreams
        )
        shadow = ShadowService(options.shadow, scorer, load.idle_for, fallbacks)
    return Router(engines, options, shadow=shadow, fallbacks=fallbacks, load=load)


def check_upstream_pairs(options: ServeOptions, engines: dict) -> None:
    """A shadow pair with an upstream: the upstream must be vLLM (its prompt_logprobs score the
    replay) and share the other model's tokenizer."""
    for quant, full in options.shadow.pairs.items():
        upstream = quant if quant in options.backends else full if full in options.backends else None
        if upstream is None:
            continue
        if not engines[upstream].token_ids:
            raise OptkitError(
                f"--shadow {quant}={full}: {upstream} is not a vLLM server, whose prompt_logprobs a replay needs"
            )
        a, b = engines[quant].tokenizer, engines[full].tokenizer
        if a.get_vocab() != b.get_vocab() or (a.bos_token_id, a.eos_token_id) != (b.bos_token_id, b.eos_token_id):
            raise OptkitError(f"--shadow {quant}={full}: the two models have different tokenizers")


def upstream_key(name: str, key_env: str | None) -> str | None:
    """The upstream's own API key, from the environment variable its --backend-key names."""
    if key_env is None:
        return None
    key = os.environ.get(key_env)
    if not key:
        raise OptkitError(f"--backend-key {name}={key_env}: the environment variable {key_env} is not set")
    return key


def start_upstreams(options: ServeOptions) -> dict:
    """Each --backend's engine (upstream/engine.py), after asking it what it serves."""
    from optkit.upstream.engine import UpstreamLimits, connect

    engines = {}
    for name, spec in options.backends.items():
        limits = UpstreamLimits(max_concurrency=spec.max_concurrency, read_timeout_s=spec.timeout_s)
        engines[name] = connect(name, spec.url, spec.tokenizer, upstream_key(name, spec.key_env), limits)
    return engines


def log_to_stderr() -> None:
    """Fallback switches (and failed replays) as one line each on stderr."""
    logger = logging.getLogger(LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def describe(router: Router) -> str:
    """One line on what is served: names, route, shadow and fallback."""
    options = router.options
    parts = [", ".join(router.names)]
    if len(router.names) > 1:
        parts.append(f"route {options.route}")
    if options.shadow.pairs:
        shown = ", ".join(f"{q}={f}" for q, f in options.shadow.pairs.items())
        parts.append(f"shadow {shown} at {options.shadow.rate:g}")
    if router.fallbacks:
        parts.append(f"fallback over {options.fallback.window} requests")
    return "; ".join(parts)
