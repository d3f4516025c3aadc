"""What decides whether a loader can read an artifact: its format and the numbers it stores (the
method only changes the values). A format names the kind of what it wrote (`artifact_kind`);
the compatibility matrix (compat/matrix.py) and the vLLM spec (compat/vllm_spec.py) read it."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ArtifactKind:
    format: str  # the format's NAME: compressed-tensors | gptq | awq | bitsandbytes | gguf | a plug-in's
    bits: int
    symmetric: bool
    w8a8: bool = False  # 8-bit weights and activations (compressed-tensors int- or float-quantized)
    type: str = "int"  # the weights' numbers: int, float (FP8 E4M3) or nf4
    label: str | None = field(default=None, compare=False)  # the format's own name for it (GGUF's Q4_0)

    def describe(self) -> str:
        if self.label is not None:
            return f"{self.format} {self.label}"
        if self.w8a8:
            return f"{self.format} W8A8 {'fp8' if self.type == 'float' else 'int8'}"
        if self.type == "nf4":
            return f"{self.format} nf4"
        return f"{self.format} w{self.bits} {'sym' if self.symmetric else 'asym'}"
