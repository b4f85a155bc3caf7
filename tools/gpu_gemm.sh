#!/usr/bin/env bash
# GEMM tuning runs on the GPU machine, one stage per call, after the bundle is in:
#   bash tools/gpu_gemm.sh sweep1  # the first look (three sweeps, ~7 min)
#   bash tools/gpu_gemm.sh sweep   # tools/sweep_gemm.py (SIZES, CASES, CONFIGS, BUDGET env)
#   bash tools/gpu_gemm.sh ncu     # ncu of our gate/up GEMM and cuBLAS's (launches 3 and 4: after warm-up)
#   bash tools/gpu_gemm.sh test    # the GEMM and swiglu GPU tiers
#   bash tools/gpu_gemm.sh bench   # bench_gemm then bench_swiglu_mlp (ROUNDS)
source /tmp/gpu-bundle/device.sh || exit 3
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc
case "$1" in
sweep1)  # the first look: every MLP GEMM at both sizes and 8192^3, cooperative vs ping-pong tiles
  timeout -k 5 45 python3 tools/smoke_pingpong.py > $OUT/smoke.log 2>&1; echo "smoke rc=$?"; tail -n 4 $OUT/smoke.log
  S="timeout -k 5 120 python3 tools/sweep_gemm.py --sizes 0,1 --budget 100"
  $S --cases fwd_gateup,fwd_down,bwd_dx,bwd_wgrad_gu,bwd_wgrad_down --configs default,pp1_bn128,bn128 > $OUT/sweep_a.log 2>&1
  echo "a rc=$?"; cut -c1-200 $OUT/sweep_a.log
  $S --cases fwd_swiglu,bwd_dswiglu,bwd_dx_acc --configs default,pp1_bn64 > $OUT/sweep_b.log 2>&1
  echo "b rc=$?"; cut -c1-200 $OUT/sweep_b.log
  timeout -k 5 70 python3 tools/sweep_gemm.py --sizes 0,1 --budget 55 --cases bwd_dx_tail,bwd_wgrad_stacked --configs default,pp1_bn128 > $OUT/sweep_b2.log 2>&1
  echo "b2 rc=$?"; cut -c1-200 $OUT/sweep_b2.log
  timeout -k 5 45 python3 tools/sweep_gemm.py --sizes 2 --configs default,pp1_bn128,bn256_g16 > $OUT/sweep_c.log 2>&1
  echo "c rc=$?"; cut -c1-200 $OUT/sweep_c.log ;;
sweep)
  timeout -k 5 ${BUDGET_S:-500} python3 tools/sweep_gemm.py --sizes ${SIZES:-0,1} ${CASES:+--cases $CASES} \
    --configs ${CONFIGS:-default} --budget $(( ${BUDGET_S:-500} - 40 )) > $OUT/sweep.log 2>&1
  echo "sweep rc=$?"; cat $OUT/sweep.log | cut -c1-220 ;;
ncu)
  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
  timeout 200 ncu --clock-control none --launch-skip 2 --launch-count 2 --section SpeedOfLight --section WarpStateStats \
    --section Occupancy --metrics sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    python3 tools/ncu_gemm.py ${NCU_SHAPE:-} > $OUT/ncu.log 2>&1
  echo "ncu rc=$?"; grep -vE "^\s*$|----" $OUT/ncu.log | grep -E "==PROF==|gemm|Kernel|kernel|Throughput|Duration|Frequency|hmma|Stall|Warp Cycles|Issued|Eligible|Active Warps|Registers|Achieved" | cut -c1-160 | head -80 ;;
test)  # the GEMM and swiglu GPU tiers on the default schedule, then the GEMM tier with ping-pong everywhere
  P="python3 -m pytest -p no:cacheprovider -m gpu -q -rfE -n 8"
  timeout -k 10 ${TEST_S:-280} $P tests/kernels/test_gemm_sm90.py tests/fused/test_swiglu_mlp.py tests/layers/test_mlp.py \
    > $OUT/test.log 2>&1
  echo "pytest rc=$?"; grep -E " (FAILED|ERROR) |passed|failed" $OUT/test.log | tail -15
  CUDNN_TRAIN_GEMM_PINGPONG=all timeout -k 10 ${TEST_S:-200} $P tests/kernels/test_gemm_sm90.py tests/fused/test_swiglu_mlp.py \
    > $OUT/test_pp.log 2>&1
  echo "pytest pingpong rc=$?"; grep -E " (FAILED|ERROR) |passed|failed" $OUT/test_pp.log | tail -15 ;;
bench)
  timeout -k 5 250 python3 -m benchmarks.bench_gemm --warmup 10 --rep 50 --json $OUT/bench_gemm.json > $OUT/bench_gemm.log 2>&1
  echo "bench_gemm rc=$?"; tail -n 25 $OUT/bench_gemm.log | cut -c1-260
  timeout -k 5 330 python3 -m benchmarks.bench_swiglu_mlp --warmup 10 --rep 40 --rounds ${ROUNDS:-2} --json $OUT/bench_mlp.json > $OUT/bench_mlp.log 2>&1
  echo "bench_mlp rc=$?"; tail -n 25 $OUT/bench_mlp.log | cut -c1-260 ;;
*) echo "usage: bash tools/gpu_gemm.sh sweep|ncu|test|bench"; exit 2 ;;
esac
