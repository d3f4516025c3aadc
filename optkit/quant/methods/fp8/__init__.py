"""FP8 (E4M3) W8A8: math.py (per-channel weights), method.py."""
