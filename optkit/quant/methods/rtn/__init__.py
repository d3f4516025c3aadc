"""Round to nearest: math.py (the math every integer method shares), method.py (its registration)."""
