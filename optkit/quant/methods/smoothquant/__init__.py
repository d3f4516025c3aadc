"""SmoothQuant: options.py, math.py (smoothing scales, the α check), step.py (the smoothing stage on
one layer), method.py."""
