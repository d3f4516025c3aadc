"""IBM Granite 3: Llama's decoder layer names, with embedding, residual, attention and logit
multipliers (config fields; the runtime reads them in models/config.py)."""

from dataclasses import replace

from optkit.families import register_family
from optkit.families.llama import LLAMA_LAYOUT

GRANITE = register_family(
    replace(
        LLAMA_LAYOUT,
        name="granite",
        model_types=("granite",),
        embedding_scale=lambda config: config.embedding_multiplier,
    )
)
