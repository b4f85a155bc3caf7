#!/usr/bin/env bash
# GPU call A: every GPU tier except GEMM's (unchanged, 54 passed) and the GDN forward kernel's, in parallel
# with per-test lines (-v) so a run cut short still says what passed; then the DSA baseline benchmark.
source /tmp/gpu-bundle/device.sh || exit 3
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc
python3 -c "import tilelang, fla; print('tilelang', tilelang.__version__, 'fla', fla.__version__)" 2>&1 | tail -1
timeout 370 python3 -m pytest -p no:cacheprovider -p no:benchmark -m gpu -n 15 --timeout 340 -v -rfE --durations=25 \
  tests/fused tests/layers tests/test_fla.py tests/test_demo.py > $OUT/tiers.log 2>&1
echo "pytest rc=$?"; grep -cE " PASSED " $OUT/tiers.log; grep -E " (FAILED|ERROR) |^(FAILED|ERROR)|passed|failed" $OUT/tiers.log | tail -30
timeout 90 python3 -m benchmarks.bench_dsa --warmup 5 --rep 20 --json $OUT/bench_dsa.json > $OUT/bench_dsa.log 2>&1; echo "bench_dsa rc=$?"; tail -n 16 $OUT/bench_dsa.log
