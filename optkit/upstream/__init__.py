"""OpenAI-compatible servers (vLLM, another optkit) as engines the router serves beside in-process ones."""
