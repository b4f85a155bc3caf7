#!/usr/bin/env bash
# GPU call B: GPU tiers of the op and layer families, the GDN benchmark, the demo's GPU preset on both backends.
source /tmp/gpu-bundle/device.sh || exit 3
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/fused/test_gated_delta_rule.py tests/fused/test_kda.py tests/fused/test_causal_conv1d.py tests/fused/test_dsa.py tests/fused/test_swiglu_mlp.py tests/layers tests/test_fla.py tests/test_demo.py > $OUT/tiers.log 2>&1; grep -E "passed|failed|FAILED|ERROR" $OUT/tiers.log | tail -25
for b in cutedsl torch; do
  if [ $b = torch ]; then export CUDNN_TRAIN_BACKEND=torch; fi
  timeout 100 python3 -m cudnn_train.demo --preset gpu --steps ${DEMO_STEPS:-60} --out /tmp/demo_$b > $OUT/demo_$b.log 2>&1; echo "demo $b rc=$?"; cp /tmp/demo_$b/log.json $OUT/demo_$b.json; tail -c 1200 $OUT/demo_$b.log
done
unset CUDNN_TRAIN_BACKEND
timeout 90 python3 -m benchmarks.bench_gated_delta_rule --warmup 10 --rep 50 --json $OUT/bench_gdn.json > $OUT/bench_gdn.log 2>&1; tail -14 $OUT/bench_gdn.log
