#!/usr/bin/env bash
# On the GPU machine: install the bundle (if this run completes it), then run the given
# pytest targets and benchmarks, logging everything under $OUT.
#   bash tools/gpu_session.sh "<pytest args>" "<bench name> [<bench name> ...]"
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if [ -f /tmp/gpu-bundle/device.sh ] && [ ! -d .gpu ]; then source /tmp/gpu-bundle/device.sh; else source .gpu/*/device.sh; fi
rc=$?; [ $rc -eq 0 ] || { echo "bundle not complete (rc=$rc)"; exit $rc; }
export PYTHONPATH="$(pwd):${PYTHONPATH:-}" CUDNN_TRAIN_CACHE_DIR=/tmp/ct-cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, cutlass, tvm_ffi; print('torch', torch.__version__, 'cutlass', cutlass.__version__, 'tvm_ffi', tvm_ffi.__version__)" | tee -a "$OUT/gpu.txt"
if [ -n "${1:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider $1 2>&1 | tee "$OUT/pytest.log" | tail -40
fi
for b in ${2:-}; do
  python3 -m benchmarks.bench_$b --json "$OUT/bench_$b.json" 2>&1 | tee "$OUT/bench_$b.log" | tail -40
done
