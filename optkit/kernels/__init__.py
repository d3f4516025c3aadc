"""Compute kernels, each behind one wrapper with a plain-PyTorch reference beside it."""
