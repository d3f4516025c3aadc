"""optkit: quantize a Hugging Face causal LM, prove it kept its quality, and serve it fast."""

__version__ = "0.1.0"
