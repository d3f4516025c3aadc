"""GPTQ: options.py, math.py (the column-by-column solver), step.py (one decoder layer), method.py."""
