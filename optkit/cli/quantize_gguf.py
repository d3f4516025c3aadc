"""`optkit quantize --gguf-type`: llama.cpp's file type (quant/formats/gguf_mix.py) over the other flags."""

from typing import Annotated

import typer

GgufType = Annotated[
    str | None,
    typer.Option(
        help="GGUF file type, as llama-quantize names it: Q8_0, Q4_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, ... "
        "(each tensor in the type llama.cpp's mix gives it: Q4_K_M raises attn_v, part of ffn_down and the "
        "output to Q6_K), or F16, BF16, F32 (nothing quantized). Implies --format gguf."
    ),
]


def gguf_type_fields(options, gguf_type: str, format: str | None, bits, group_size, symmetric: bool) -> dict:
    """QuantizeOptions' fields with `--gguf-type`: format gguf, the type's scheme (gguf_mix.with_file_type);
    a flag it contradicts is one line."""
    from optkit.errors import OptkitError
    from optkit.quant.formats.gguf_mix import FILE_TYPES, FULL_PRECISION, LEGACY_SCHEMES

    if format not in (None, "gguf"):
        raise OptkitError(f"--gguf-type {gguf_type} writes a .gguf: drop --format {format} or use --format gguf")
    if gguf_type not in FILE_TYPES:
        raise OptkitError(f"--gguf-type {gguf_type!r}: choose one of {', '.join(FILE_TYPES)}")
    scheme = LEGACY_SCHEMES.get(gguf_type)
    given = {"bits": bits, "group_size": group_size, "symmetric": None if symmetric else False}
    for key, flag in (("bits", "--bits"), ("group_size", "--group-size"), ("symmetric", "--asym")):
        if given[key] is None or (scheme is not None and given[key] == scheme[key]):
            continue
        if FILE_TYPES[gguf_type].default in FULL_PRECISION:
            raise OptkitError(f"--gguf-type {gguf_type} quantizes no linear: drop {flag}")
        if scheme is None:  # a K type: its super-block fixes bits, sub-blocks and symmetry
            raise OptkitError(
                f"--gguf-type {gguf_type} stores {FILE_TYPES[gguf_type].default}'s super-blocks: drop {flag}"
            )
        stores = {"bits": f"{scheme['bits']}-bit blocks", "group_size": f"blocks of {scheme['group_size']}"}
        raise OptkitError(f"--gguf-type {gguf_type} {stores.get(key, 'is symmetric')}: drop {flag}")
    fields = {k: v for k, v in options.model_dump().items() if k not in ("weights", "format", "gguf")}
    return {**fields, "format": "gguf", "gguf": {"type": gguf_type}}
