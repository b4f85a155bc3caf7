#!/usr/bin/env bash
# GPU call B: RMSNormGated and SwiGLU MLP benchmarks, then the demo's GPU preset on the default backends and on torch.
source /tmp/gpu-bundle/device.sh || exit 3
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc
timeout 95 python3 -m benchmarks.bench_rms_norm_gated --warmup 10 --rep 40 --json $OUT/bench_rms.json > $OUT/bench_rms.log 2>&1; echo "bench_rms rc=$?"; tail -n 26 $OUT/bench_rms.log
timeout 130 python3 -m benchmarks.bench_swiglu_mlp --warmup 10 --rep 40 --json $OUT/bench_swiglu.json > $OUT/bench_swiglu.log 2>&1; echo "bench_swiglu rc=$?"; tail -n 14 $OUT/bench_swiglu.log
for b in default torch; do
  if [ $b = torch ]; then export CUDNN_TRAIN_BACKEND=torch; steps=16; lim=70; else steps=30; lim=160; fi
  timeout $lim python3 -m cudnn_train.demo --preset gpu --steps $steps --out /tmp/demo_$b > $OUT/demo_$b.log 2>&1; echo "demo $b rc=$?"
  cp /tmp/demo_$b/log.json $OUT/demo_$b.json 2>/dev/null; grep -v "train:" $OUT/demo_$b.log | tail -n 22
done
