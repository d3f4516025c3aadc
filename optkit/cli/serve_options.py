"""`optkit serve`'s options for several models, routing, shadow mode and fallback (cli/serve_flags.py
says how they override a recipe's `serve:` section), and the limits on what one client may send."""

from pathlib import Path
from typing import Annotated

import typer

ModelArgument = Annotated[
    str | None, typer.Argument(help="Model directory, artifact, or reference name (small, draft).")
]
Models = Annotated[
    list[str] | None,
    typer.Option("--model", help="NAME=PATH: serve the model at PATH as NAME (repeatable: several models)."),
]
KvCacheFraction = Annotated[
    list[str] | None,
    typer.Option(help="NAME=F: NAME's share of the KV memory budget (default: an equal share; repeatable)."),
]
Tasks = Annotated[
    list[str] | None,
    typer.Option("--task", help="NAME=TASK: models of one task may answer for each other (spill-over, prefix)."),
]
Recipe = Annotated[
    Path | None, typer.Option(help="A recipe (or YAML file) whose serve: section configures all of this; flags win.")
]
Route = Annotated[
    str | None,
    typer.Option(help="model (the request's model field), tiered (tier rules, --tiers) or prefix (prefix affinity)."),
]
Tiers = Annotated[
    Path | None, typer.Option(help="YAML file of tiered routing: order, default, rules, header (docs/serving.md).")
]
MaxQueueWait = Annotated[
    float | None, typer.Option(help="Seconds: a model waiting longer spills requests to another of its task.")
]
PrefixMinTokens = Annotated[
    int | None, typer.Option(help="With --route prefix: shared prefixes this long stick to one engine (64).")
]
Shadow = Annotated[
    list[str] | None,
    typer.Option(help="QUANT=FULL: replay a sample of QUANT's requests on FULL and measure the drift (repeatable)."),
]
ShadowRate = Annotated[float | None, typer.Option(help="Fraction of QUANT's requests replayed (0.05).")]
FallbackThreshold = Annotated[
    str | None, typer.Option(help="kld=X,top1=Y,ppl_increase=Z: send QUANT's requests to FULL past these.")
]
FallbackWindow = Annotated[int | None, typer.Option(help="Shadowed requests the threshold is checked over (20).")]
FallbackRecovery = Annotated[
    str | None, typer.Option(help="manual (POST /v1/optkit/fallback/reset) or auto (once a window passes).")
]
MaxRequestBytes = Annotated[
    int | None,
    typer.Option(
        min=1024,
        help="Largest request body; larger ones get 413 (default: 32 bytes per context token, from 4 to 16 MiB).",
    ),
]
BodyTimeout = Annotated[
    float, typer.Option(min=0.1, help="Seconds a request body may take to arrive; slower ones get 408.")
]
AllowedHosts = Annotated[
    list[str] | None,
    typer.Option("--allowed-host", help="Another name for this server in the Host header (without --api-key)."),
]
Docs = Annotated[
    bool,
    typer.Option("--docs", help="Serve FastAPI's /docs, /redoc and /openapi.json (behind --api-key when set)."),
]
Backends = Annotated[
    list[str] | None,
    typer.Option(
        "--backend",
        help="NAME=URL: serve an OpenAI-compatible upstream (vLLM, another optkit) as NAME (repeatable).",
    ),
]
BackendKey = Annotated[
    list[str] | None,
    typer.Option(help="NAME=ENVVAR: send the upstream the API key held in ENVVAR (the client's is never sent)."),
]
BackendTokenizer = Annotated[
    list[str] | None,
    typer.Option(help="NAME=DIR: the upstream model's tokenizer (default: the root its /v1/models names)."),
]
BackendConcurrency = Annotated[
    list[str] | None, typer.Option(help="NAME=N: requests in flight to the upstream at most (16).")
]
BackendTimeout = Annotated[
    float | None, typer.Option(help="Seconds an upstream may take to its first token, or between two (120).")
]
Host = Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")]
Port = Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free one).")]
ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="OPTKIT_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1 and /metrics (better: OPTKIT_API_KEY, not shown by ps).",
    ),
]
ServedModelName = Annotated[
    str | None, typer.Option(help="The model's name in the API (default: the model directory's name).")
]
KvCacheBlocks = Annotated[
    list[str] | None,
    typer.Option(help="KV cache blocks: N, or NAME=N per model (default: max-num-seqs full-length sequences)."),
]
