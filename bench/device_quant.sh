#!/usr/bin/env bash
# GPU check of the quantization pipeline (run on a CUDA machine from the repository root):
# the GPTQ path on the device, the quality table, and peak device memory against the bound.
# Missing Python packages can be installed first from wheels in .whl/ (see the device notes).
set -euo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OPTKIT_CACHE="${OPTKIT_CACHE:-/tmp/optkit-cache}"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
python3 -m pytest -q -x -p no:cacheprovider tests/quant -m "not slow"
python3 -m optkit.cli.main quantize small --method gptq --bits 4 --device cuda --out /tmp/gptq-w4 --overwrite --json \
  | python3 -c "import json,sys; m=json.load(sys.stdin); print('peak', m['peak_memory'], 'wall', m['wall_time_s'])"
python3 -m optkit.cli.main eval /tmp/gptq-w4 --baseline small --json \
  | python3 -c "import json,sys; print(json.load(sys.stdin)['metrics'])"
COLUMNS=200 python3 bench/quant_quality.py --bits 4 3 --group-sizes 128
