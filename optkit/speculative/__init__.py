"""Speculative heads: EAGLE heads on disk (eagle_head.py) and their training."""
