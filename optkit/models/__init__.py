"""The runtime's models: config (`ModelConfig`), the decoder (`CausalLM`), and the loader
(`load_runtime_model`) that keeps quantized layers quantized in memory."""
