"""The bundled runtime: paged KV cache, continuous batching, sampling, an async engine loop.

`sequence`, `block_manager` and `scheduler` never import torch (unit-tested in milliseconds);
`model_runner` and `sampler` hold the tensors; `engine` runs the loop on its own thread.
"""
