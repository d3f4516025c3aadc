"""The engine's settings, declared once (as vLLM's `EngineArgs`): `optkit generate`, `serve`, `bench`
and `compile` build their engine flags from these fields (cli/options.py), and a recipe's
`serve.engine:` section has the same keys (routing/config.py) but one: `compile_dir` is refused there
(`check_file_engine_section`). The compile cache holds torch pickles, code, so only this machine's
$OPTKIT_CACHE or the command line (`--compile-dir`) may name it, never a recipe or routing config
from somewhere else. Field names are the keys; the flag of `max_num_seqs` is `--max-num-seqs`.

`EngineArgs` is what the user said, where device and dtype may be "auto"; `engine_config()`
resolves them (optkit/devices.py, the one resolver) into the `EngineConfig` that `LLMEngine` runs
with. An `EngineConfig` is an `EngineArgs` whose device and dtype are concrete (cpu, float32 unless
told otherwise: what a test or a script gets when it builds one directly).
"""

from pydantic import BaseModel, ConfigDict, model_validator

from optkit.devices import DTYPES, resolve_device, resolve_dtype
from optkit.errors import OptkitError, shown

# multi-step decoding's default on the CPU: the engine's work around a decode step paid once for this many
CPU_SCHEDULER_STEPS = 8


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str = "auto"  # cpu, cuda, cuda:N; auto: cuda when available, else cpu
    dtype: str = "auto"  # float32, bfloat16, float16; auto: bfloat16 on CUDA, float32 on CPU
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_blocks: int | None = None  # default: max_num_seqs full-length sequences, capped by memory
    # auto: the model's dtype; int8 / fp8: 8 bits with a scale per block and KV head (kernels/kv_cache.py).
    # kv_cache_blocks counts blocks at the model's dtype: an 8-bit cache gets the blocks that data fits
    # (2N at 16 bits), its scale side table (0.4% at head_dim 64) on top.
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_waiting: int = 1024
    speculative: str | None = None  # "ngram", "draft:PATH" or "eagle:DIR" (runtime/speculative.py); None: off
    num_speculative_tokens: int = 4  # proposals per decoding sequence and step
    # multi-step decoding (runtime/multi_step.py): decode steps per schedule when every running
    # sequence decodes and none waits. None: CPU_SCHEDULER_STEPS on the CPU, 1 on CUDA (its decode
    # steps replay CUDA graphs) and with speculative decoding (which excludes it)
    num_scheduler_steps: int | None = None
    # CUDA graphs and the compile cache (runtime/cuda_graphs.py, runtime/compile_cache.py)
    enforce_eager: bool = False  # no CUDA graphs for decode steps (they are always off on CPU)
    torch_compile: bool = False  # torch.compile each decode bucket before capture (CUDA only, experimental)
    compile_dir: str | None = None  # --compile-dir (default: $OPTKIT_CACHE/compile); never a model dir, nor from a file
    # CPU: torch's threads for the process (None: torch's default, every core it sees; set_num_threads
    # is process-wide, so the last engine built sets it). The output head runs as the artifact stores it
    # (quantize --head; models/loader.py picks its kernel).
    threads: int | None = None

    @model_validator(mode="after")
    def _check(self) -> "EngineArgs":
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting", "num_speculative_tokens"):
            if getattr(self, name) < 1:
                raise OptkitError(f"--{name.replace('_', '-')} must be at least 1")
        if self.dtype not in (*DTYPES, "auto"):
            raise OptkitError(f"unknown --dtype {shown(self.dtype)}: choose one of {', '.join(DTYPES)}")
        if self.threads is not None and self.threads < 1:
            raise OptkitError(f"--threads {self.threads}: give a positive number of CPU threads")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise OptkitError(f"unknown --kv-cache-dtype {shown(self.kv_cache_dtype)}: choose auto, int8 or fp8")
        if self.num_scheduler_steps is not None and self.num_scheduler_steps < 1:
            raise OptkitError("--num-scheduler-steps must be at least 1")
        if self.speculative is not None:
            if (self.num_scheduler_steps or 1) > 1:
                raise OptkitError("--num-scheduler-steps above 1 and --speculative exclude each other: drop one")
            from optkit.runtime.proposers import parse_speculative

            parse_speculative(self.speculative)
            if self.num_speculative_tokens >= self.max_num_batched_tokens:
                raise OptkitError(
                    f"--num-speculative-tokens {self.num_speculative_tokens} leaves no room in "
                    f"--max-num-batched-tokens {self.max_num_batched_tokens}: lower the first or raise the second"
                )
        return self

    def scheduler_steps(self) -> int:
        """num_scheduler_steps with its default resolved for the device (on an EngineConfig: an
        EngineArgs' device may still be "auto", which counts as not the CPU here)."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return CPU_SCHEDULER_STEPS if self.speculative is None and self.device == "cpu" else 1

    @classmethod
    def from_cli_args(cls, **flags) -> "EngineArgs":
        """The flags a command was given (None: not given, the field's default holds)."""
        return cls(**given(flags))

    def engine_config(self) -> "EngineConfig":
        """These settings with device and dtype resolved: what LLMEngine runs with."""
        device = resolve_device(self.device)
        return EngineConfig(**{**self.model_dump(), "device": device, "dtype": resolve_dtype(self.dtype, device)})


def check_file_engine_section(section: object) -> None:
    """A recipe's or routing config's `engine:` section takes every key but compile_dir (a ValueError naming it)."""
    if isinstance(section, dict) and "compile_dir" in section:
        raise ValueError(
            "compile_dir cannot come from a recipe or routing config (the compile cache holds code): drop it; "
            "the cache is $OPTKIT_CACHE/compile, or --compile-dir on the command line"
        )


class EngineConfig(EngineArgs):
    """EngineArgs resolved: a concrete device and dtype."""

    device: str = "cpu"
    dtype: str = "float32"

    @model_validator(mode="after")
    def _resolved(self) -> "EngineConfig":
        assert "auto" not in (self.device, self.dtype), "resolve EngineArgs with engine_config()"
        return self


def given(flags: dict) -> dict:
    """The flags that were given: those not None."""
    return {name: value for name, value in flags.items() if value is not None}
