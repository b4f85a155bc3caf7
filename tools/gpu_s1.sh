#!/usr/bin/env bash
# GPU call (session 2, first): host-overhead diagnosis, every GPU tier but GEMM's in parallel, DSA/CSA/GNN baselines.
source /tmp/gpu-bundle/device.sh || exit 3
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc
timeout 60 python3 tools/diag_autograd.py > $OUT/diag.log 2>&1; cat $OUT/diag.log
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -n 14 --timeout 300 -rfE --durations=12 \
  tests/fused tests/layers tests/test_fla.py tests/test_demo.py tests/kernels/test_gated_delta_rule_sm90.py > $OUT/tiers.log 2>&1
grep -E "passed|failed|FAILED|ERROR|Timeout" $OUT/tiers.log | tail -40
for b in dsa csa gnn; do
  timeout 45 python3 -m benchmarks.bench_$b --warmup 5 --rep 20 --json $OUT/bench_$b.json > $OUT/bench_$b.log 2>&1; echo "bench_$b rc=$?"
done
tail -n 12 $OUT/bench_*.log
