"""The compatibility matrix as data: artifact kinds, loaders, and the upstream breakages measured.

Data and small functions: `optkit quantize` warns from it before work starts, `optkit inspect`
says where an artifact loads, tests/compat asserts every entry, and bench/compat_matrix.py renders
docs/compatibility.md from the test results. What only a format knows (which loaders read it, and
vLLM's loader for a kind) its `CheckpointFormat` says (LOADERS, vllm_loader): a plug-in format
gets its rows without an entry here.
"""

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from optkit.families import family_for
from optkit.quant.formats import get_format, reader_for
from optkit.quant.formats.kind import ArtifactKind

TRANSFORMERS = "transformers (+ compressed-tensors)"
GPTQMODEL = "transformers + gptqmodel"
OPTKIT = "optkit runtime"
VLLM = "vLLM"
LLAMA_CPP = "llama.cpp"  # GGUF files only (quant/formats/gguf.py)
LOADERS = (OPTKIT, TRANSFORMERS, GPTQMODEL, VLLM, LLAMA_CPP)
# each loader by the name a format's LOADERS gives it (vLLM: the format's `vllm_loader`)
LOADER_NAMES = {OPTKIT: "optkit", TRANSFORMERS: "transformers", GPTQMODEL: "gptqmodel", LLAMA_CPP: "llama.cpp"}


@dataclass(frozen=True)
class Breakage:
    """A loader that fails on a kind of artifact when every package named in `broken` is installed
    at a version in its range."""

    loader: str
    broken: dict[str, str]  # package -> PEP 440 specifier; all must match
    applies_format: str
    applies_symmetric: bool | None  # None: either
    summary: str  # what fails, in a few words
    upstream: str  # the source locations (or link) that explain it
    remedy: str  # what the user can do, in one clause
    measured_ok: tuple[dict[str, str], ...] = ()  # version sets where it was seen to load
    measured_broken: tuple[dict[str, str], ...] = ()  # version sets where it was seen to fail

    def applies(self, kind: ArtifactKind) -> bool:
        return (
            kind.format == self.applies_format
            and not kind.w8a8
            and (self.applies_symmetric is None or kind.symmetric == self.applies_symmetric)
        )

    def is_broken(self, versions: dict[str, str | None]) -> bool:
        return all(
            versions.get(package) is not None
            and SpecifierSet(spec).contains(Version(versions[package]), prereleases=True)
            for package, spec in self.broken.items()
        )


def _with_compressed_tensors(pairs: str) -> tuple[dict[str, str], ...]:
    """Version sets from "TRANSFORMERS COMPRESSED_TENSORS, ..." (the versions of the two packages)."""
    return tuple(
        dict(zip(("transformers", "compressed-tensors"), pair.split(), strict=True)) for pair in pairs.split(", ")
    )


# Measured in scratch environments (torch 2.13.0, docs/compatibility.md) and by tests/compat.
# transformers 5.23 builds the compressed modules on the meta device before loading
# (`CompressedTensorsHfQuantizer._process_model_before_weight_loading` -> `compress_model`), and
# compressed-tensors 0.18.0 gave `PackedQuantizationCompressor.compress` a meta branch that
# returns before packing `weight_zero_point`: the model expects [out, groups] where the checkpoint
# holds the standard packed [ceil(out * bits / 32), groups]. Either version alone is harmless.
CT_ASYM_TRANSFORMERS_5_23 = Breakage(
    loader=TRANSFORMERS,
    broken={"transformers": ">=5.23.0", "compressed-tensors": ">=0.18.0"},
    applies_format="compressed-tensors",
    applies_symmetric=False,
    summary="asymmetric pack-quantized: weight_zero_point size MISMATCH in from_pretrained",
    upstream=(
        "compressed-tensors >= 0.18 compressors/pack_quantized/base.py PackedQuantizationCompressor.compress "
        "(the meta branch returns before packing weight_zero_point), reached since transformers 5.23 "
        "through quantizers/quantizer_compressed_tensors.py _process_model_before_weight_loading"
    ),
    remedy="load with quantization_config=CompressedTensorsConfig(dequantize=True), or pass --sym",
    measured_ok=_with_compressed_tensors(
        "5.21.1 0.20.1, 5.22.2 0.20.1, 5.22.2 0.17.1, 5.22.2 0.19.0, 5.20.2 0.20.0, 5.23.0 0.17.1, 5.24.0 0.17.1"
    ),
    measured_broken=_with_compressed_tensors(
        "5.23.0 0.18.0, 5.23.0 0.19.0, 5.23.0 0.20.1, 5.24.0 0.18.0, 5.24.0 0.19.0, 5.24.0 0.20.1"
    ),
)
BREAKAGES = (CT_ASYM_TRANSFORMERS_5_23,)

# Mixture-of-experts artifacts (measured by tests/compat and tests/quant/test_moe.py, transformers
# 5.24.0 with compressed-tensors 0.20.1): transformers 5 builds each MoE block's experts as fused 3D
# parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I]), so it cannot keep the per-expert
# quantized linears (the layout vLLM reads); its loader decompresses the experts into those dense
# tensors through a stand-in module holding only weight_packed, weight_scale and weight_shape, in
# the scales' dtype. Zero points (asymmetric) and g_idx (GPTQ act order) are dropped, every expert
# ends up in bf16 inside an fp32 model, and int8 (W8A8) experts fail the weight conversion.
# optkit's runtime and its gate (quant/formats/load.py: per-expert linears holding the artifact's
# dequantized tensors) read them; vLLM reads them by spec (compat/vllm_spec.py).
MOE_TRANSFORMERS = Breakage(
    loader=TRANSFORMERS,
    broken={"transformers": ">=5.0.0"},
    applies_format="compressed-tensors",
    applies_symmetric=None,
    summary="MoE experts fused into 3D parameters: decompressed without zero points or g_idx, in bf16; "
    "int8 experts fail to convert (logits mismatch)",
    upstream=(
        "transformers 5 integrations/compressed_tensors.py CompressedTensorsDequantize.convert (experts "
        "decompressed through a DummyModule of weight_packed/weight_scale/weight_shape) and "
        "conversion_mapping.py (per-expert keys merged into experts.gate_up_proj/down_proj)"
    ),
    remedy="serve it with optkit or vLLM; optkit eval gates it on its own dequantized tensors",
    measured_broken=({"transformers": "5.24.0", "compressed-tensors": "0.20.1"},),
)


# NF4 (bitsandbytes) MoE artifacts: the same fused 3D experts cannot take the per-expert packed
# uint8 weights and their quant_state (measured: from_pretrained raises a size MISMATCH on
# experts.gate_up_proj / down_proj, transformers 5.24.0, tiny Mixtral, Qwen2-MoE, Qwen3-MoE)
MOE_TRANSFORMERS_NF4 = Breakage(
    loader=TRANSFORMERS,
    broken={"transformers": ">=5.0.0"},
    applies_format="bitsandbytes",
    applies_symmetric=None,
    summary="MoE experts fused into 3D parameters: the per-expert nf4 weights raise a size MISMATCH in from_pretrained",
    upstream="transformers 5 conversion_mapping.py (per-expert keys merged into experts.gate_up_proj/down_proj)",
    remedy="serve it with optkit; optkit eval gates it on its own dequantized tensors",
    measured_broken=({"transformers": "5.24.0"},),
)
FAMILY_BREAKAGES = (MOE_TRANSFORMERS, MOE_TRANSFORMERS_NF4)


def family_breakages(
    model_type: str | None, loader: str, versions: dict[str, str | None] | None = None, fmt: str | None = None
) -> list:
    """Breakages of a whole model family in `loader` (MoE in transformers), for artifacts of
    format `fmt` (None: any format)."""
    if family_for(model_type).moe is None:  # the MoE families (families/: a MoELayout)
        return []
    return [
        b
        for b in FAMILY_BREAKAGES
        if b.loader == loader and fmt in (None, b.applies_format) and b.is_broken(_versions(b, versions))
    ]


def installed_version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _versions(breakage: Breakage, versions: dict[str, str | None] | None) -> dict[str, str | None]:
    if versions is None:
        return {package: installed_version(package) for package in breakage.broken}
    return versions


def known_breakages(kind: ArtifactKind, versions: dict[str, str | None] | None = None) -> list[Breakage]:
    """The breakages that hit `kind` with `versions` (package -> version; default: installed)."""
    return [b for b in BREAKAGES if b.applies(kind) and b.is_broken(_versions(b, versions))]


def _installed(breakage: Breakage, versions: dict[str, str | None] | None) -> str:
    found = _versions(breakage, versions)
    return " with ".join(f"{package} {found.get(package)}" for package in breakage.broken)


def check_installed_versions(
    kind: ArtifactKind, versions: dict[str, str | None] | None = None, model_type: str | None = None
) -> str | None:
    """One line for the user when an installed loader cannot read what is about to be written;
    `model_type`: the model's family (transformers loads no quantized MoE artifact)."""
    family = family_breakages(model_type, TRANSFORMERS, versions, kind.format)
    hits = family + known_breakages(kind, versions)
    if not hits:
        return None
    b = hits[0]
    remedy = b.remedy
    if not family:  # a kind's breakage: another format or vLLM may still read the model
        remedy += " or --format awq" if kind.bits == 4 else ""
        remedy += "; vLLM reads it" if vllm_path(kind) else ""
    what = f"{model_type} (mixture-of-experts) {kind.describe()}" if family else kind.describe()
    return (
        f"{_installed(b, versions)} cannot load {what} artifacts by default "
        f"({b.summary}; see docs/compatibility.md): {remedy}"
    )


def vllm_path(kind: ArtifactKind) -> str | None:
    """The vLLM loader that reads `kind` (by spec, optkit/compat/vllm_spec.py), or None."""
    return get_format(kind.format).vllm_loader(kind)


def vllm_runs(model_type: str | None) -> bool:
    """Whether vLLM has a model class for `model_type` (its family names one; None: any model)."""
    return model_type is None or family_for(model_type).model_type(model_type).vllm is not None


def expected_status(
    kind: ArtifactKind, loader: str, versions: dict[str, str | None] | None = None, model_type: str | None = None
) -> str:
    """What the matrix expects: "loads", "fails" (a known breakage), "by spec", "no" (the loader
    does not read this kind) or "untested" (a manual check, or a package the loader needs for this
    format is missing). `model_type`: the artifact's family, where it matters."""
    if loader not in LOADERS:
        raise ValueError(loader)
    needs = get_format(kind.format).LOADERS.get(LOADER_NAMES.get(loader))
    if (vllm_path(kind) is None or not vllm_runs(model_type)) if loader == VLLM else (needs is None):
        return "no"
    if family_breakages(model_type, loader, versions, kind.format):
        return "fails"
    if loader == TRANSFORMERS and known_breakages(kind, versions):
        return "fails"
    if loader == VLLM:
        return "by spec"
    if loader == GPTQMODEL or any(installed_version(package) is None for package in needs):
        return "untested"
    return "loads"


def kind_from_quant_config(quant_config: dict, where: str = "config.json") -> ArtifactKind:
    """The kind of an artifact from its config.json `quantization_config`, as its format says; one
    OptkitError naming `where` for a block no registered format wrote."""
    return reader_for(quant_config, where).artifact_kind(quant_config)


def where_it_loads(
    kind: ArtifactKind, versions: dict[str, str | None] | None = None, model_type: str | None = None
) -> list[tuple[str, str]]:
    """(loader, status with its reason) for every loader, for `optkit inspect`."""
    rows = []
    for loader in LOADERS:
        status = expected_status(kind, loader, versions, model_type)
        if status == "fails":
            b = (family_breakages(model_type, loader, versions, kind.format) or known_breakages(kind, versions))[0]
            status = f"fails with {_installed(b, versions)} ({b.summary}): {b.remedy}"
        elif status == "by spec":
            status = f"by spec ({vllm_path(kind)}; not run here)"
        elif status == "untested" and loader == GPTQMODEL:
            status = "untested here (manual check, docs/compatibility.md)"
        elif status == "no" and loader == VLLM and not vllm_runs(model_type):
            status = f"no (vLLM has no model for {model_type}: its family names none)"
        rows.append((loader, status))
    return rows
