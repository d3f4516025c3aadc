#!/usr/bin/env bash
# The runtime's GPU benchmarks on the H200, from the repository root (target: under 8 minutes):
#   1. random-weight 1.24B Llama, bf16, and its W4A16 RTN g128 gptq artifact (bench/gpu/make_models.py)
#   2. bench/gpu/kernels.py --quick (the Triton kernel micro-benchmarks)
#   3. optkit bench, bf16, batch 1,16,64, against transformers generate (--baseline hf)
#   4. optkit bench, W4A16, batch 1,16,64
#   5. CUDA graphs against --enforce-eager, decode at batch 8 (--baseline eager), bf16
#   6. FP8 W8A8 through torch._scaled_mm (cc >= 8.9) against its exact emulation, and NF4 through the
#      W4A16 Triton kernel's code-book mode against the reference: one PASS/FAIL line
#   7. multi-step decoding on CUDA (opt-in, --num-scheduler-steps 4): greedy tokens equal one step at a
#      time's (tests/runtime/test_multi_step.py -k cuda), eager, bf16: one PASS/FAIL line
#   8. EAGLE speculative decoding on a trained target (issue 35): `deep` (12 layers, ~42 MB in fp32)
#      and its trained head, carried in $EAGLE_TARGET and $EAGLE_HEAD (default shared/eagle/deep and
#      shared/eagle/deep-head: copy them there from `optkit zoo build deep` and `optkit speculator
#      train DEEP --out HEAD`), CUDA bf16, batch 1 greedy, k=2..4: PASS when the best EAGLE run is
#      >= 2x plain decoding's tokens/s; FAIL (with why) when it is not or the files are absent
# Each step has its own timeout, so one failure keeps the others. JSON goes to $OUT (else bench/results/).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
OUT="${OUT:-bench/results}"
MODELS="${MODELS:-/tmp/optkit-gpu-models}"
mkdir -p "$OUT" "$MODELS"
status=0
step() {  # step NAME SECONDS CMD...: runs CMD with a timeout, logs to $OUT/NAME.log, never stops the script
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s"
  [ $rc -eq 0 ] || status=1
}
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
# The image lacks optkit's pure-Python dependencies (typer, rich, pydantic, compressed-tensors, ...):
# install the wheels carried in .whl/ (see bench/gpu/README or the device command) when present.
if [ -d .whl ] && ! python3 -c "import typer, rich, pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/optkit-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/optkit-site"
fi
BENCH=(python3 -m optkit.cli.main bench --prompt-len 128 --gen-len 128 --device cuda --dtype bfloat16 --json)
step make_models 150 python3 bench/gpu/make_models.py "$MODELS"
step kernels 120 bash -c "python3 bench/gpu/kernels.py --quick --json > '$OUT/kernels.json'"
step bench_bf16 180 bash -c "${BENCH[*]} $MODELS/llama-1b --batch-sizes 1,16,64 --baseline hf > '$OUT/bench_bf16.json'"
step bench_w4a16 90 bash -c "${BENCH[*]} $MODELS/llama-1b-w4 --batch-sizes 1,16,64 > '$OUT/bench_w4a16.json'"
step graphs_vs_eager 60 bash -c "${BENCH[*]} $MODELS/llama-1b --batch-sizes 8 --baseline eager > '$OUT/graphs_vs_eager.json'"
step fp8_nf4 120 bash -c "python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8.py tests/kernels/test_nf4.py \
  && echo 'fp8 torch._scaled_mm vs emulation, nf4 triton vs reference: PASS' \
  || { echo 'fp8 torch._scaled_mm vs emulation, nf4 triton vs reference: FAIL'; exit 1; }"
step multi_step 90 bash -c "python3 -m pytest -q -p no:cacheprovider tests/runtime/test_multi_step.py -k cuda \
  && echo 'multi-step decoding on CUDA, greedy tokens as one step at a time: PASS' \
  || { echo 'multi-step decoding on CUDA, greedy tokens as one step at a time: FAIL'; exit 1; }"
EAGLE_TARGET="${EAGLE_TARGET:-shared/eagle/deep}" EAGLE_HEAD="${EAGLE_HEAD:-shared/eagle/deep-head}"
if [ -f "$EAGLE_TARGET/config.json" ] && [ -f "$EAGLE_HEAD/config.json" ]; then
  step eagle_deep 150 bash -c "python3 bench/speculative.py --target '$EAGLE_TARGET' --speculative 'eagle:$EAGLE_HEAD' \
    --ks 2 3 4 --batches 1 --temperatures 0 --requests 4 --max-tokens 128 --repeats 2 --workload heldout \
    --device cuda --dtype bfloat16 --json > '$OUT/eagle_deep.json' && python3 bench/gpu/eagle_check.py '$OUT/eagle_deep.json'"
else
  echo "== eagle_deep: FAIL: no trained target and head at $EAGLE_TARGET and $EAGLE_HEAD (optkit zoo build deep;"
  echo "   optkit speculator train DEEP --out HEAD; copy both there, ~46 MB in fp32)"
  status=1
fi
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        data = json.loads(f.read_text())
    except Exception as e:
        print(f"{f.name}: unreadable ({e})"); continue
    for row in data.get("rows", []) if isinstance(data, dict) else []:
        if "batch_size" in row:
            ratios = {k: round(v, 2) for k, v in row.items() if k.startswith("vs ") or k == "fraction_of_ceiling"}
            print(f"{f.name}: batch {row['batch_size']} {row['run']}: {row['tokens_per_s']:.0f} tok/s "
                  f"TPOT p50 {row['tpot_s']['p50'] * 1e3:.2f} ms {ratios}")
PY
exit $status
