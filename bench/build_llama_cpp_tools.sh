#!/usr/bin/env bash
# Builds llama.cpp's command-line tools from the sources vendored in llama-cpp-python's sdist, the same
# llama.cpp the `gguf` extra links: llama-quantize and llama-imatrix (an importance matrix reaches the
# quantizer only through them: llama_model_quantize's `imatrix` is a C++ map ctypes cannot build),
# llama-perplexity (its --kl-divergence) and llama-bench (decode speed). An optional bench step, never CI.
#
# Usage: bench/build_llama_cpp_tools.sh [OUT_DIR]   (default .cache/llama.cpp-tools, gitignored)
# Env: LLAMA_CPP_PYTHON_VERSION (default: the installed one), JOBS (default 2), SDIST (a downloaded
# llama_cpp_python-*.tar.gz; otherwise pip downloads it, from its cache when it has it).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/.cache/llama.cpp-tools}")"
PY="${PY:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-2}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-$("$PY" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')}"
TOOLS=(llama-quantize llama-imatrix llama-perplexity llama-bench)

mkdir -p "$OUT"
if [ -z "${SDIST:-}" ]; then
    "$PY" -m pip download -q "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$OUT/sdist"
    SDIST="$OUT/sdist/llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$OUT/src-$VERSION"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    rm -rf "$SRC.partial" && mkdir -p "$SRC.partial"
    tar xzf "$SDIST" -C "$SRC.partial" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
    mv "$SRC.partial" "$SRC"
fi
cmake -S "$SRC" -B "$OUT/build-$VERSION" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
cmake --build "$OUT/build-$VERSION" -j "$JOBS" --target "${TOOLS[@]}"
mkdir -p "$OUT/bin"
for tool in "${TOOLS[@]}"; do
    cp "$OUT/build-$VERSION/bin/$tool" "$OUT/bin/$tool"
done
echo "$VERSION" > "$OUT/bin/VERSION"
echo "llama.cpp tools (llama-cpp-python $VERSION's sources) in $OUT/bin"
