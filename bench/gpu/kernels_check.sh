#!/usr/bin/env bash
# GPU check of the Triton kernels (run on a CUDA machine from the repository root, ~3-5 minutes):
# the kernel tests on the device (Triton against the PyTorch references), then the micro-benchmarks.
# Writes kernels.json (and the table) to $OUT when set, else to the current directory.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
OUT="${OUT:-.}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
status=0
python3 -m pytest -q -p no:cacheprovider tests/kernels -m gpu 2>&1 | tail -n 40 || status=1
python3 bench/gpu/kernels.py --json > "$OUT/kernels.json" || status=1
python3 - "$OUT/kernels.json" <<'PY'
import json, sys
sys.path.insert(0, "bench/gpu")
from kernels import show
show(json.load(open(sys.argv[1]))["rows"])
PY
exit $status
