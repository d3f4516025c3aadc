"""The quantized-weight data model that quant/ produces and kernels/ and models/ consume: schemes,
`QuantizedWeight` with its dequantization, and bit packing. It sits below both, as
compressed-tensors sits below llm-compressor and vLLM, and imports nothing of optkit's but errors."""
