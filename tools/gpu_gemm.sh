#!/usr/bin/env bash
# GEMM tuning runs on the GPU machine, one stage per call, after the bundle is in:
#   bash tools/gpu_gemm.sh sweep   # tools/sweep_gemm.py (SIZES, CASES, CONFIGS, BUDGET env)
#   bash tools/gpu_gemm.sh ncu     # ncu of our gate/up GEMM and cuBLAS's (launches 3 and 4: after warm-up)
#   bash tools/gpu_gemm.sh test    # the GEMM and swiglu GPU tiers
#   bash tools/gpu_gemm.sh bench   # bench_swiglu_mlp (ROUNDS, WARMUP, REP) then bench_gemm
#   bash tools/gpu_gemm.sh final   # the tiers, then bench_swiglu_mlp: one call
#   bash tools/gpu_gemm.sh prof    # tools/prof_swiglu_mlp.py: the MLP's kernels, each epilogue vs eager (ROUNDS)
#   bash tools/gpu_gemm.sh epi     # the tiers, then prof: one call
#   bash tools/gpu_gemm.sh ewg     # dSwiGLU's epilogue on the producer warp group's idle warps: its GPU cases and
#                                  # the dSwiGLU ones (EWG_K: another -k), then the dSwiGLU GEMM under each variant
#                                  # (sweep_gemm, twice; CONFIGS=none: no sweep)
source /tmp/gpu-bundle/device.sh || exit 3
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc
case "$1" in
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
test)  # the GEMM and swiglu GPU tiers
  timeout -k 10 ${TEST_S:-240} python3 -m pytest -p no:cacheprovider -m gpu -q -rfE -n 8 tests/kernels/test_gemm_sm90.py \
    tests/fused/test_swiglu_mlp.py tests/layers/test_mlp.py > $OUT/test.log 2>&1
  echo "pytest rc=$?"; grep -E " (FAILED|ERROR) |passed|failed" $OUT/test.log | tail -15 ;;
bench)  # bench_swiglu_mlp (ROUNDS, default 2; WARMUP / REP in ms, default 100 / 400: about 20 calls a timing, the
        # card near its sustained clock) first, then bench_gemm
  timeout -k 5 ${MLP_S:-300} python3 -m benchmarks.bench_swiglu_mlp --warmup ${WARMUP:-100} --rep ${REP:-400} --rounds ${ROUNDS:-2} \
    --json $OUT/bench_mlp.json > $OUT/bench_mlp.log 2>&1
  echo "bench_mlp rc=$?"; tail -n 25 $OUT/bench_mlp.log | cut -c1-260
  timeout -k 5 ${GEMM_S:-240} python3 -m benchmarks.bench_gemm --warmup 10 --rep 50 --json $OUT/bench_gemm.json \
    > $OUT/bench_gemm.log 2>&1
  echo "bench_gemm rc=$?"; tail -n 25 $OUT/bench_gemm.log | cut -c1-260 ;;
final)  # one call: the GEMM and swiglu tiers, then bench_swiglu_mlp alone (ROUNDS)
  timeout -k 10 ${TEST_S:-170} python3 -m pytest -p no:cacheprovider -m gpu -q -rfE -n 8 tests/kernels/test_gemm_sm90.py \
    tests/fused/test_swiglu_mlp.py > $OUT/test.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f pytest 2>/dev/null; grep -E " (FAILED|ERROR) |passed|failed" $OUT/test.log | tail -15
  timeout -k 5 ${MLP_S:-320} python3 -m benchmarks.bench_swiglu_mlp --warmup 10 --rep 40 --rounds ${ROUNDS:-2} \
    --json $OUT/bench_mlp.json > $OUT/bench_mlp.log 2>&1
  echo "bench_mlp rc=$?"; tail -n 25 $OUT/bench_mlp.log | cut -c1-260 ;;
prof)
  timeout -k 5 ${PROF_S:-300} python3 tools/prof_swiglu_mlp.py --rounds ${ROUNDS:-3} > $OUT/prof.log 2>&1
  echo "prof rc=$?"; grep -E "^(##|\||ours|torch)" $OUT/prof.log | cut -c1-200 ;;
epi)  # one call: the GEMM and swiglu tiers, then prof
  timeout -k 10 ${TEST_S:-200} python3 -m pytest -p no:cacheprovider -m gpu -q -rfE -n 8 tests/kernels/test_gemm_sm90.py \
    tests/fused/test_swiglu_mlp.py > $OUT/test.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f pytest 2>/dev/null; grep -E " (FAILED|ERROR) |passed|failed" $OUT/test.log | tail -15
  bash "$0" prof ;;
ewg)
  timeout -k 10 ${TEST_S:-200} python3 -m pytest -p no:cacheprovider -m gpu -q -rfE -n 4 tests/kernels/test_gemm_sm90.py \
    -k "${EWG_K:-epilogue_warps or dswiglu or tma_store_epilogue}" > $OUT/test.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f pytest 2>/dev/null; grep -E " (FAILED|ERROR) |passed|failed" $OUT/test.log | tail -15
  C=${CONFIGS:-w0,default,w1_r2}; [ "$C" = none ] && exit 0  # CONFIGS=none: the cases alone
  timeout -k 5 ${BUDGET_S:-300} python3 tools/sweep_gemm.py --sizes ${SIZES:-0,1} --cases bwd_dswiglu --configs $C,$C \
    --budget $(( ${BUDGET_S:-300} - 20 )) > $OUT/sweep.log 2>&1
  echo "sweep rc=$?"; cut -c1-120 $OUT/sweep.log ;;
*) echo "usage: bash tools/gpu_gemm.sh sweep|ncu|test|bench|final|prof|epi|ewg"; exit 2 ;;
esac
