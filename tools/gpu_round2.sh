#!/usr/bin/env bash
# One GPU call: kernels' GPU tiers, then RMSNormGated tuning and host-overhead figures.
source /tmp/gpu-bundle/device.sh || exit 3
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc
t() { timeout "$1" python3 -m pytest -q -p no:cacheprovider -m gpu "${@:2}" 2>&1 | tail -30; }
t 120 tests/fused/test_rms_norm_gated.py > $OUT/rms.log; tail -3 $OUT/rms.log
t 200 tests/kernels/test_gemm_sm90.py > $OUT/gemm.log; tail -12 $OUT/gemm.log
t 150 tests/kernels/test_gated_delta_rule_sm90.py > $OUT/gdn.log; tail -12 $OUT/gdn.log
timeout 60 python3 tools/profile_rms.py 2>&1 | head -12 | tee $OUT/prof.log
timeout 90 python3 tools/sweep_rms.py 2>&1 | tee $OUT/sweep.log
