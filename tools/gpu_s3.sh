#!/usr/bin/env bash
# Last short GPU call: the RMSNormGated benchmark with the faster dweight reduction, its GPU tier, the SwiGLU recompute test.
source /tmp/gpu-bundle/device.sh || exit 3
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc
timeout 80 python3 -m benchmarks.bench_rms_norm_gated --warmup 10 --rep 40 --json $OUT/bench_rms.json > $OUT/bench_rms.log 2>&1; echo "bench_rms rc=$?"; tail -n 25 $OUT/bench_rms.log | cut -c1-400
timeout 45 python3 -m pytest -p no:cacheprovider -m gpu -n 8 -q -x tests/fused/test_rms_norm_gated.py tests/fused/test_swiglu_mlp.py > $OUT/tiers.log 2>&1; echo "pytest rc=$?"; tail -n 30 $OUT/tiers.log | grep -v Warning
