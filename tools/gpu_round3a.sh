#!/usr/bin/env bash
# GPU call A: RMSNormGated tuning, host overhead and benchmark; GEMM GPU tier and benchmark; GDN forward kernel tier.
source /tmp/gpu-bundle/device.sh || exit 3
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc
timeout 60 python3 tools/sweep_rms.py 128,4,8 128,4,12 256,4,4 > $OUT/sweep.log 2>&1; cat $OUT/sweep.log
timeout 50 python3 tools/profile_rms.py 2>&1 | head -16 > $OUT/prof.log; cat $OUT/prof.log
timeout 120 python3 -m benchmarks.bench_rms_norm_gated --warmup 10 --rep 60 --json $OUT/bench_rms.json > $OUT/bench_rms.log 2>&1; tail -22 $OUT/bench_rms.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gemm_sm90.py > $OUT/gemm.log 2>&1; tail -6 $OUT/gemm.log
timeout 150 python3 -m benchmarks.bench_gemm --warmup 10 --rep 50 --json $OUT/bench_gemm.json > $OUT/bench_gemm.log 2>&1; tail -14 $OUT/bench_gemm.log
timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/kernels/test_gated_delta_rule_sm90.py > $OUT/gdn.log 2>&1; tail -6 $OUT/gdn.log
