"""AWQ: options.py, math.py (scales, clipping), step.py (one decoder layer), method.py."""
