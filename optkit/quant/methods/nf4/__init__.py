"""NF4: math.py (NormalFloat codes, blockwise absmax, double quantization), method.py."""
