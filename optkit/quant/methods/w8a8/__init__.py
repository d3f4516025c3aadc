"""Plain W8A8 (int8 weights per channel, int8 activations): method.py."""
