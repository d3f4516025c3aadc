"""Where optkit's artifacts load: the measured compatibility matrix (`matrix`), the transformers
load check behind `optkit verify --load transformers` (`transformers_load`) and the spec of what
vLLM reads (`vllm_spec`). docs/compatibility.md is generated from the test results."""
