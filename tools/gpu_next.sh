#!/usr/bin/env bash
# The GPU runs still owed (see docs/PERFORMANCE.md), one stage per call, after the bundle is in:
#   bash tools/gpu_next.sh verify   # the GPU tiers that need no FLA chunk kernel (RMSNorm, DSA, CSA, GNN, swiglu,
#                                   # fla gated_mlp), then the RMSNorm benchmark (prefer bench_rms alone for figures)
#   bash tools/gpu_next.sh demo     # ./run demo --preset gpu on the default backends, alone, with minutes to compile
#   bash tools/gpu_next.sh fla1|fla2|fla3  # the FLA-comparison tiers (GDN / KDA / conv, patches, demo, mlp layer),
#                                   # one call each, few workers: FLA's autotuner and TileLang compile per shape
#                                   # (FLA_N workers, FLA_DIST pytest-xdist mode, FLA_S limit)
#   bash tools/gpu_next.sh gdn      # GDN kernel tiers (forward, reverse sweep, stage-3 kernel); GDN_S=limit
#   bash tools/gpu_next.sh gdn_train  # the opt-in GDN training path through the op, vs oracle and FLA
#                                   # (TRAIN_K=1: the stage-3 kernel's half only; TRAIN_S, TRAIN_N)
#   bash tools/gpu_next.sh gdn_fwd  # the GDN forward tier, then tools/time_gdn_fwd.py (each kernel alone, FLA's
#                                   # forward, per-phase cycles; GDN_TIER=0 skips the tier; GDN_S / TIME_S
#                                   # limits, SHAPES=N)
#   bash tools/gpu_next.sh gdn_bwd  # the backward kernel tiers + the forward's chunk-state cases, then gdn_prof
#   bash tools/gpu_next.sh fused    # the fused backward's GPU cases, then tools/time_gdn_fused.py (FUSED_S, TIME_S,
#                                   # SHAPES; FUSED_TIME=0: the cases alone; FUSED_K: a pytest -k selection;
#                                   # FUSED_ARGS: more arguments of the timing, e.g. --profile; FUSED_CASES=0: the
#                                   # timing alone)
#   bash tools/gpu_next.sh fused40  # the fortieth session's: the rows' kernels built side by side, the split-dk and
#                                   # dq1 smokes, time_gdn_fused.py --profile (ROWS), then the cases (FUSED_K,
#                                   # FUSED_S)
#   bash tools/gpu_next.sh dchunk   # the stage-3 kernel's tier, then tools/time_gdn_dchunk.py (one vs two warpgroups)
#   bash tools/gpu_next.sh pending  # all of dchunk / sweep2 / fwd2's new cases, then the three timing tools, one call
#   bash tools/gpu_next.sh s7       # the seventh session's defaults and the sweep's prefetch: tiers, then its timing
#   bash tools/gpu_next.sh gsum     # stage 3's GVA group sum in the kernel: its cases, then time_gdn_dchunk.py
#   bash tools/gpu_next.sh states   # the training forward's chunk-start state cases, then time_gdn_fwd.py
#   bash tools/gpu_next.sh fwd2     # the forward's two-warpgroup state kernel: its cases, then time_gdn_fwd.py
#   bash tools/gpu_next.sh dprof    # stage 3's per-phase cycles (time_gdn_dchunk.py --profile)
#   bash tools/gpu_next.sh s9       # split sweep cases + stage-3 tier, split sweep timing, stage-3 profile
#   bash tools/gpu_next.sh s9b      # stage 3 cp.async loads: cases, timing vs synchronous, profile
#   bash tools/gpu_next.sh s9d      # stage 3 reading the forward's vn: its cases + training cases, timing
#   bash tools/gpu_next.sh s10      # stage 3 reading the forward's Tm (+ vn): cases, training cases, timing
#   bash tools/gpu_next.sh s11      # the tenth session: size-1-dim strides (T = 1) cases, then the training tier's
#                                   # kernel half with Tm read by default (TRAIN_S limit)
#   bash tools/gpu_next.sh s12      # the op's new dispatch (ours unless FLA would hand the call to FlashQLA): its
#                                   # cases and the demo test, then the GPU demo on the defaults (DEMO_S, steps)
#   bash tools/gpu_next.sh s13      # stage 3's persistent variant (CUDNN_TRAIN_GDN_DCHUNK_PERSIST): its bitwise cases,
#                                   # then time_gdn_dchunk.py --persist; the re-reviewed dispatch cases (s12's)
#   bash tools/gpu_next.sh s14      # the eleventh session: the dispatch cases (K = V = 64 now ours), the op's host cost
#                                   # (tools/diag_gdn_host.py at K 128 / 64), the wy kernel's time and phases, then
#                                   # bench_gdn at K = V = 64 (BENCH_S limit)
#   bash tools/gpu_next.sh s15      # the wy kernel's scan preparation (CUDNN_TRAIN_GDN_WY_SCAN): its cases, the forward
#                                   # cases through it, the dispatch cases; its timing vs the serial prep and phases;
#                                   # the op's host cost under cProfile (GDN_S limit of the tier)
#   bash tools/gpu_next.sh s16      # prepared in the eleventh session: the wy kernel's cp.async tile loads
#                                   # (CUDNN_TRAIN_GDN_WY_ASYNC): bitwise cases + the scan cases, timing against the
#                                   # synchronous loads and both profiles; then the op's host cost split by path;
#                                   # then the reverse sweep's per-phase profile (time_gdn_sweep.py --profile);
#                                   # then stage 3 at K = V = 64 on one warpgroup against two (--k64)
#   bash tools/gpu_next.sh s19|s19b|s20  # the twelfth session's prepared variants (see the stages below)
#   bash tools/gpu_next.sh s21      # the thirteenth session's specialized-warpgroup state pass: cases, timing
#   bash tools/gpu_next.sh s21b     # it as the inference default: the fused-kernel cases, then bench_gdn (1 shape)
#   bash tools/gpu_next.sh s22      # its loads by TMA (prepared): bitwise cases, timing and profile
#   bash tools/gpu_next.sh s23      # w, u formed in its chain (prepared): oracle cases, timings
#   bash tools/gpu_next.sh s24      # the reverse sweep on specialized warpgroups (prepared): cases, timing
#   bash tools/gpu_next.sh s25      # every prepared GPU case (s22-s24, the fourteenth session's, the sweep's TMA
#                                   # variant), the sweep's timing
#   bash tools/gpu_next.sh s26      # then the forward's timings and profiles of all the prepared variants
#   bash tools/gpu_next.sh s27      # the fifteenth session's TMA variants (stage 3, the fused sweep's prefetch, the
#                                   # split sweep's dchain, the training forward's chain): their bitwise cases, then
#                                   # stage 3's timings (per tile, persistent, four warpgroups) and profiles
#   bash tools/gpu_next.sh s28      # then the other TMA variants' timings and the persistent stage 3's profile
#   bash tools/gpu_next.sh s29|s30|s31  # the sixteenth session's prepared variants (see each stage below)
#   bash tools/gpu_next.sh s32      # the fused sweep with both V halves in one CTA: bitwise cases, timing
#   bash tools/gpu_next.sh s33      # the two-chain stage 3: its cases against the per-tile kernel, timing
#                                   # (CHAINS_TRAIN=1: then the training tier's kernel half with it)
#   bash tools/gpu_next.sh s34      # stage 3's paired accesses: the persistent and two-chain cases
#   bash tools/gpu_next.sh s35      # stage 3's relaxed first cluster arrive (prepared): its cases, timing
#   bash tools/gpu_next.sh s36      # the sweep's dH by stmatrix and TMA stores (now the default): its cases, timing
#   bash tools/gpu_next.sh s37      # the sweep's dvn by TMA stores too (now the default): its cases, timing
#   bash tools/gpu_next.sh s38      # the forward chain's hs / vn by TMA stores (now the default): its cases, timing
#   bash tools/gpu_next.sh s39      # the split sweep's dchain dH / dvn and the out kernel's o by TMA stores
#                                   # (prepared): their cases, timings
#   bash tools/gpu_next.sh s40      # the forward chain and the fused sweep split into segments after a
#                                   # decay-truncated warm-up (prepared): their cases, then their timings
#                                   # (ours alone: the 2-part bundle without --peers serves it, two calls fewer)
#   bash tools/gpu_next.sh s40train # the training tier's kernel half with both recurrences in 4 segments
#   bash tools/gpu_next.sh s41      # stage 3 with E in registers (prepared): its bitwise cases, timing
#   bash tools/gpu_next.sh s42      # the carried split's cases, then the unsplit default, the warm-up split and the
#                                   # carried split with the peers at FLA's layer-init gates (slow heads; 4 parts)
#   bash tools/gpu_next.sh s42b     # the same benchmark at the benchmark's fast gates
#   bash tools/gpu_next.sh s42train # the training tier's kernel half with the carried sweep in 4 segments
#   bash tools/gpu_next.sh s43      # stage 3 persistent with E in registers as the candidate default: the stage-3
#                                   # tier (not the two-chain cases, which refuse it) and the training tier's kernel half
#   bash tools/gpu_next.sh s43rest  # the cases s43 left unfinished (twenty-seventh session), the same switches
#   bash tools/gpu_next.sh s44      # stage 3's dKK in dA's terms, dk's two products (prepared): its cases, timing
#   bash tools/gpu_next.sh s46      # the default stage 3 and the per-tile one: timing, per-phase profiles (B4)
#   bash tools/gpu_next.sh s47      # the training forward's stores by TMA from transposed tiles (prepared):
#                                   # cases, timing (s47b: op fwd+bwd off / on; s47train: the training tier's
#                                   # kernel half)
#   bash tools/gpu_next.sh s48      # the thirty-first session's owed cases: the two-chain stage-3 cases (now per tile),
#                                   # then the rest of the stage-3 tier (GDN_S); timings: s47b with FROM / SHAPES
#   bash tools/gpu_next.sh s50      # the thirty-third session's (run then): the l2norm rows eight threads a row
#                                   # (stage 3, sweep): cases with s49's, then B4's op with both switches off / on
#   bash tools/gpu_next.sh s52      # the thirty-third session's prepared: stage 3 persistent with the next tile's k
#                                   # issued early (EARLYK): bitwise cases, stage 3 alone and B4's op off / on;
#                                   # PROF=1: then the persistent profiles with NORM8 off / on
#   bash tools/gpu_next.sh s53      # the default inference and training forwards' state pass: timed and per-phase
#                                   # profiled at B4 (time_gdn_fwd.py --profile-defaults; TIME_S, ONLY shape index)
#   bash tools/gpu_next.sh s54      # the forward's transposed tiles for inference and u^T by ldmatrix (prepared): the
#                                   # bitwise cases (GDN_S), time_gdn_fwd.py --tlayout (TIME_S, SHAPES), then the
#                                   # profiles with both on (PROF=1)
#   bash tools/gpu_next.sh s56      # the training forward with w and u formed in its chain and the sweep on Tm, and
#                                   # the chain issuing the loads (prepared): their cases (GDN_S), the training op's
#                                   # (TRAIN_S; FLA's backward needs the --peers bundle), time_gdn_fwd.py --train-onfly,
#                                   # --cloads and --kshare (TIME_S each)
#   bash tools/gpu_next.sh s55      # o by TMA stores and the output on the chain's k factors in the forward's
#                                   # specialized warpgroups (prepared): bitwise cases (GDN_S), time_gdn_fwd.py --otma
#                                   # and --kshare (TIME_S), then the forward tier (TIER_S; 0 skips it)
#   bash tools/gpu_next.sh s51      # the stage-3 and sweep tiers whole with both NORM8 switches on (GDN_S)
#   bash tools/gpu_next.sh s49      # the thirty-second session's: the two-chain cases alone, the switch's check too
#   bash tools/gpu_next.sh s45      # the GDN kernel tiers (not the two-chain cases) with stage 3 persistent and E in
#                                   # registers, the candidate defaults (GDN_S; TRAIN_S: then the training cases)
#   bash tools/gpu_next.sh fqnorm   # FlashQLA's torch.compile'd l2norm timed in fresh processes (PROCS=3)
#   bash tools/gpu_next.sh ssplit   # the split reverse sweep (opt-in): its cases, timing vs the default
#                                   # (SPLIT_TRAIN=1: then the training tier's kernel half with it)
#   bash tools/gpu_next.sh sweep2   # the reverse sweep's tier (1 and 2 warpgroups), tools/time_gdn_sweep.py,
#                                   # then gdn_prof with each
#   bash tools/gpu_next.sh gdn_prof # the opt-in training path's kernels under torch.profiler, then vs FLA
#   bash tools/gpu_next.sh bench_rms | bench_gdn   # a benchmark alone in its call (bench_rms: ROUNDS=N, after
#                                   # tools/diag_autograd.py; bench_gdn: SHAPES=N, SKIP=rows,
#                                   # BENCH_S=limit)
#   bash tools/gpu_next.sh ncu      # Nsight Compute on stage 3 and the fused sweep (tools/ncu_gdn.py): stall reasons,
#                                   # bank conflicts, the SASS lines with the most stall samples (NCU_WHAT, NCU_S)
#   bash tools/gpu_next.sh save_caches  # the peers' JIT results (Triton autotune choices, TileLang kernels) -> $OUT
# The FLA-comparison tiers spend most of their time in FLA's Triton autotuner and TileLang's JIT. The
# caches stay on the machine while it is warm; to start a later session with them, copy the
# jit_caches.tgz that save_caches returned to .gpu/jit_caches.tgz and carry it in one call: every
# stage unpacks it into $HOME first (Triton then compiles only each kernel's chosen config).
source /tmp/gpu-bundle/device.sh || exit 3
# unbuffered: a tool cut by its limit still leaves every line it printed (s25's sweep_ws log came back empty)
export PYTHONPATH=$(pwd):$PYTHONPATH CUDNN_TRAIN_CACHE_DIR=/tmp/ctc PYTHONUNBUFFERED=1
if [ -f .gpu/jit_caches.tgz ] && [ ! -f /tmp/jit_caches.restored ]; then
  tar xzf .gpu/jit_caches.tgz -C "$HOME" && touch /tmp/jit_caches.restored && echo "jit caches restored"
fi
P="python3 -m pytest -p no:cacheprovider -p no:benchmark -m gpu -v -rfE --durations=15"
tier() {  # tier NAME LIMIT pytest-args...: a GPU tier on 12 workers, its log $OUT/NAME.log, the counts and failures
  local name=$1 limit=$2; shift 2
  timeout -k 10 "$limit" $P -n 12 "$@" > "$OUT/$name.log" 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -cE " PASSED " "$OUT/$name.log"; grep -E " (FAILED|ERROR) |passed|failed" "$OUT/$name.log" | tail -15
}
timed() {  # timed NAME LIMIT command...: a timing tool, its log $OUT/NAME.log, also printed
  local name=$1 limit=$2; shift 2
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; cut -c1-160 "$OUT/$name.log"
}
case "$1" in
verify)
  timeout -k 10 150 $P -n 12 tests/fused/test_rms_norm_gated.py tests/fused/test_swiglu_mlp.py tests/fused/test_dsa.py \
    tests/fused/test_csa.py tests/fused/test_gnn.py tests/layers/test_gnn.py tests/layers/test_mlp.py \
    "tests/test_fla.py::test_gpu_patched_gated_mlp_agrees_with_fla_and_uses_the_sm90_gemms" > $OUT/verify.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null; sleep 1  # no worker left running into the benchmark grep -E " (FAILED|ERROR) |passed|failed" $OUT/verify.log | tail -12
  timeout 90 python3 -m benchmarks.bench_rms_norm_gated --warmup 10 --rep 40 --rounds ${ROUNDS:-3} --json $OUT/bench_rms.json > $OUT/bench_rms.log 2>&1
  echo "bench_rms rc=$?"; tail -n 25 $OUT/bench_rms.log | cut -c1-300 ;;
demo)
  for b in default torch; do
    if [ $b = torch ]; then export CUDNN_TRAIN_BACKEND=torch; lim=200; steps=30; else lim=330; steps=60; fi
    timeout $lim python3 -m cudnn_train.demo --preset gpu --steps $steps --out /tmp/demo_$b > $OUT/demo_$b.log 2>&1
    echo "demo $b rc=$?"; cp /tmp/demo_$b/log.json $OUT/demo_$b.json 2>/dev/null; grep -v "train:" $OUT/demo_$b.log | tail -n 20
  done ;;
fla|fla1|fla2|fla3)
  # one call each: FLA's autotuner and TileLang JIT-compile per shape and dtype (~80 s a test on one worker)
  case "$1" in
  fla1) files="tests/fused/test_gated_delta_rule.py tests/layers/test_gated_deltanet.py" ;;
  fla2) files="tests/fused/test_kda.py tests/layers/test_kda.py" ;;
  fla3) files="tests/fused/test_causal_conv1d.py tests/test_fla.py tests/test_demo.py tests/layers/test_mlp.py" ;;
  *) files="tests/fused/test_gated_delta_rule.py tests/fused/test_kda.py tests/fused/test_causal_conv1d.py
           tests/layers/test_gated_deltanet.py tests/layers/test_kda.py tests/test_fla.py tests/test_demo.py" ;;
  esac
  timeout -k 10 ${FLA_S:-560} $P -n ${FLA_N:-4} --dist ${FLA_DIST:-loadfile} $files > $OUT/$1.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -cE " PASSED " $OUT/$1.log; grep -E " (FAILED|ERROR) |passed|failed" $OUT/$1.log | tail -20 ;;
bench_rms)
  timeout 60 python3 tools/diag_autograd.py > $OUT/diag_autograd.log 2>&1; echo "diag rc=$?"; cat $OUT/diag_autograd.log | cut -c1-200
  timeout 120 python3 -m benchmarks.bench_rms_norm_gated --warmup 10 --rep 40 --rounds ${ROUNDS:-3} --json $OUT/bench_rms.json > $OUT/bench_rms.log 2>&1
  echo "bench_rms rc=$?"; tail -n 25 $OUT/bench_rms.log | cut -c1-300 ;;
bench_gdn)
  # forward and forward+backward vs FLA and FlashQLA (both need the --peers bundle: tilelang, flash_qla); rows print
  # as they finish, so a timeout keeps them
  # BENCH_ARGS: more options (--layer-flags: the layers' in-kernel gate / beta call; --head-dim 64)
  timeout -k 10 ${BENCH_S:-560} python3 -m benchmarks.bench_gated_delta_rule --warmup 10 --rep 40 --rounds ${ROUNDS:-3} --shapes ${SHAPES:-2} --from-shape ${FROM:-0} \
    ${SKIP:+--skip $SKIP} ${BENCH_ARGS} --json $OUT/bench_gdn.json > $OUT/bench_gdn.log 2>&1
  echo "bench_gdn rc=$?"; grep -vE "^\s*$" $OUT/bench_gdn.log | tail -n 40 | cut -c1-300 ;;
gdn_train)
  # the opt-in training path through the op vs the oracle and FLA (FLA's backward JIT-compiles per shape)
  # TRAIN_K=1: only the stage-3 kernel's half (each test runs with both stage 3s), TRAIN_SEL: of it only the cases
  # this -k expression selects; TRAIN_S: limit
  sel=(); [ -n "$TRAIN_K" ] && sel=(-k "not torch${TRAIN_SEL:+ and ($TRAIN_SEL)}")
  timeout -k 10 ${TRAIN_S:-560} $P -n ${TRAIN_N:-6} tests/kernels/test_gated_delta_rule_train_sm90.py "${sel[@]}" \
    > $OUT/gdn_train.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -cE " PASSED " $OUT/gdn_train.log; grep -E " (FAILED|ERROR) |passed|failed" $OUT/gdn_train.log | tail -16 ;;
gdn)
  # the GDN kernel tiers that need no FLA backward: forward, reverse sweep, stage-3 kernel vs the torch stage
  timeout -k 10 ${GDN_S:-400} $P -n 12 tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py > $OUT/gdn.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed" $OUT/gdn.log | tail -12 ;;
gdn_fwd)
  # the forward tier (the state kernel's cp.async prefetch is the default), then where the forward's time goes
  if [ "${GDN_TIER:-1}" = 1 ]; then  # GDN_TIER=0: the timing and profile alone
    timeout -k 10 ${GDN_S:-240} $P -n 12 tests/kernels/test_gated_delta_rule_sm90.py > $OUT/gdn_fwd.log 2>&1
    echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
    grep -E " (FAILED|ERROR) |passed|failed" $OUT/gdn_fwd.log | tail -12
  fi
  timeout -k 10 ${TIME_S:-150} python3 tools/time_gdn_fwd.py --shapes ${SHAPES:-2} --profile > $OUT/time_gdn_fwd.log 2>&1
  echo "time_gdn_fwd rc=$?"; tail -n 30 $OUT/time_gdn_fwd.log | cut -c1-200 ;;
gdn_bwd)
  # the backward kernels' tiers (reverse sweep, stage 3) and the forward's chunk-state cases, then gdn_prof
  timeout -k 10 ${GDN_S:-300} $P -n 12 tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py "tests/kernels/test_gated_delta_rule_sm90.py" \
    -k "not test_gated_delta_rule_sm90.py or prefetch or split or graph or bitwise" > $OUT/gdn_bwd.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed" $OUT/gdn_bwd.log | tail -12
  timeout -k 10 ${PROF_S:-200} python3 tools/prof_gdn_train.py --shapes ${SHAPES:-2} > $OUT/prof_gdn_train.log 2>&1
  echo "prof rc=$?"; grep -E "B[0-9]|kernel time|cutedsl|whole" $OUT/prof_gdn_train.log | cut -c1-120 ;;
dchunk)
  # the stage-3 kernel: its tier (both warpgroup counts at K = 128), then alone, one vs two warpgroups
  timeout -k 10 ${GDN_S:-200} $P -n 8 tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py > $OUT/dchunk.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed" $OUT/dchunk.log | tail -12
  timeout -k 10 ${TIME_S:-150} python3 tools/time_gdn_dchunk.py --shapes ${SHAPES:-2} > $OUT/time_dchunk.log 2>&1
  echo "time rc=$?"; cut -c1-200 $OUT/time_dchunk.log ;;
pending)
  # every variant prepared without a GPU (sixth session), in one call: the new GPU cases of the stage-3,
  # sweep and forward tiers together (their compiles run in parallel), then the three timing tools
  timeout -k 10 ${GDN_S:-240} $P -n 12 tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py \
    tests/kernels/test_gated_delta_rule_bwd_sm90.py tests/kernels/test_gated_delta_rule_sm90.py \
    -k "overlap or dq_dk_in_the_input or two_warpgroup or test_gated_delta_rule_bwd_sm90.py" > $OUT/pending.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed" $OUT/pending.log | tail -15
  timeout -k 10 ${TIME_S:-150} python3 tools/time_gdn_dchunk.py --shapes 2 > $OUT/time_dchunk.log 2>&1
  echo "dchunk time rc=$?"; cut -c1-160 $OUT/time_dchunk.log
  timeout -k 10 60 python3 tools/time_gdn_sweep.py --shapes 2 > $OUT/time_sweep.log 2>&1
  echo "sweep time rc=$?"; cut -c1-160 $OUT/time_sweep.log
  timeout -k 10 ${TIME_S:-150} python3 tools/time_gdn_fwd.py --shapes 2 > $OUT/time_gdn_fwd.log 2>&1
  echo "time_gdn_fwd rc=$?"; grep -vE "^\s*$" $OUT/time_gdn_fwd.log | tail -n 28 | cut -c1-160 ;;
s7)
  # the seventh session's changes in one call: the sweep tier (its prefetch cases), stage 3 with and
  # without the overlap (now the default), the forward's chunk-state and wy cases, the training tier's
  # kernel half (the new defaults end to end), then the sweep's timing (prefetch vs synchronous loads)
  timeout -k 10 ${GDN_S:-330} $P -n 12 tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py tests/kernels/test_gated_delta_rule_sm90.py \
    tests/kernels/test_gated_delta_rule_train_sm90.py \
    -k "test_gated_delta_rule_bwd_sm90.py or overlap or store_states or two_warpgroup_wy or (train_sm90 and not torch)" \
    > $OUT/s7.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -cE " PASSED " $OUT/s7.log; grep -E " (FAILED|ERROR) |passed|failed" $OUT/s7.log | tail -15
  timeout -k 10 90 python3 tools/time_gdn_sweep.py --shapes 2 > $OUT/time_sweep.log 2>&1
  echo "sweep time rc=$?"; cut -c1-160 $OUT/time_sweep.log ;;
gsum)
  # stage 3 summing dq, dk over each GVA pair in the kernel (opt-in CUDNN_TRAIN_GDN_DCHUNK_GROUP_SUM=1):
  # its kernel cases and the training tier's, then the timing tool (its last rows: with and without it;
  # PAIR_ONLY=1: only those rows)
  timeout -k 10 ${GDN_S:-300} $P -n 8 tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py \
    tests/kernels/test_gated_delta_rule_train_sm90.py -k "group_sum" > $OUT/gsum.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed" $OUT/gsum.log | tail -12
  timeout -k 10 ${TIME_S:-200} python3 tools/time_gdn_dchunk.py --shapes 2 ${PAIR_ONLY:+--pair-only} > $OUT/time_dchunk.log 2>&1
  echo "dchunk time rc=$?"; cut -c1-160 $OUT/time_dchunk.log ;;
states)
  # the training forward's chunk-start states (store_states): the forward tier's cases, then time_gdn_fwd
  timeout -k 10 ${GDN_S:-200} $P -n 8 tests/kernels/test_gated_delta_rule_sm90.py -k "store_states" > $OUT/states.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed" $OUT/states.log | tail -12
  timeout -k 10 ${TIME_S:-150} python3 tools/time_gdn_fwd.py --shapes ${SHAPES:-2} > $OUT/time_gdn_fwd.log 2>&1
  echo "time rc=$?"; grep -E "ms |vs|equal" $OUT/time_gdn_fwd.log | cut -c1-160 ;;
fwd2)
  # the forward tier's two-warpgroup state-kernel cases, then time_gdn_fwd (one vs two warpgroups among its rows)
  timeout -k 10 ${GDN_S:-150} $P -n 8 tests/kernels/test_gated_delta_rule_sm90.py -k "two_warpgroup" > $OUT/fwd2.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed" $OUT/fwd2.log | tail -12
  timeout -k 10 ${TIME_S:-150} python3 tools/time_gdn_fwd.py --shapes ${SHAPES:-2} > $OUT/time_gdn_fwd.log 2>&1
  echo "time_gdn_fwd rc=$?"; tail -n 30 $OUT/time_gdn_fwd.log | cut -c1-200 ;;
dprof)
  # where stage 3's time goes: the profile variant's per-phase cycles (the default call, pair sum at GVA 2)
  timeout -k 10 ${TIME_S:-120} python3 tools/time_gdn_dchunk.py --profile --shapes ${SHAPES:-1} > $OUT/dprof.log 2>&1
  echo "dprof rc=$?"; cut -c1-160 $OUT/dprof.log ;;
s9)
  # the eighth session's prepared work in one call: the split sweep's cases and the stage-3 tier together,
  # then the split sweep's timing and stage 3's per-phase profile
  tier s9 ${GDN_S:-260} tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k "split or bwd_chunk_sm90"
  timed time_sweep ${TIME_S:-90} python3 tools/time_gdn_sweep.py --shapes 2 --split-only
  timed dprof ${DPROF_S:-120} python3 tools/time_gdn_dchunk.py --profile --shapes 1 ;;
s9b)
  # stage 3's loads by cp.async: its bitwise cases and the stage-3 tier's defaults, then the two loads' timing
  # and the per-phase profile (the default call, now with the cp.async loads)
  tier s9b ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py \
    -k "async or match_the_torch or group_sum or reproducible"
  timed time_loads ${TIME_S:-90} python3 tools/time_gdn_dchunk.py --shapes 2 --loads
  timed dprof ${DPROF_S:-100} python3 tools/time_gdn_dchunk.py --profile --shapes 1 ;;
s9d)
  # stage 3 reading the forward's vn (CUDNN_TRAIN_GDN_DCHUNK_VN_FROM_FWD): its stage-3 cases and the training
  # tier's, together, then its timing against recomputing vn (and its profile)
  tier s9d ${GDN_S:-170} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py \
    tests/kernels/test_gated_delta_rule_train_sm90.py -k "(forwards_values or forwards_vn) and not torch and not tm"
  timed time_vn ${TIME_S:-60} python3 tools/time_gdn_dchunk.py --shapes 2 --vn ;;
s10)
  # the ninth session's leftovers: stage 3 reading the forward's Tm (CUDNN_TRAIN_GDN_DCHUNK_TM_FROM_FWD) and vn, its
  # stage-3 cases, the wy kernel's store_t compile, the training tier's vn / tm cases (FLA JIT: give it time), then
  # the timing rows (recomputed, vn read, vn and Tm read) and profiles
  tier s10 ${GDN_S:-300} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py \
    tests/kernels/test_gated_delta_rule_train_sm90.py tests/kernels/test_gated_delta_rule_sm90.py \
    -k "(forwards_values or forwards_vn or keeps_the_chunk_inverses) and not torch"
  timed time_vn ${TIME_S:-120} python3 tools/time_gdn_dchunk.py --shapes 2 --vn ;;
s11)
  tier s11 ${GDN_S:-110} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py tests/kernels/test_gated_delta_rule_sm90.py \
    -k "forwards_values or unit_dim_strides or strided_inputs"
  TRAIN_K=1 TRAIN_S=${TRAIN_S:-400} bash "$0" gdn_train ;;
s12)
  tier s12 ${GDN_S:-220} tests/kernels/test_gated_delta_rule_sm90.py tests/test_demo.py \
    -k "dispatch or backend_function or cuda_bf16"
  timed demo ${DEMO_S:-180} python3 -m cudnn_train.demo --preset gpu --steps ${STEPS:-40} --out /tmp/demo_s12
  python3 -c "import json; d = json.load(open('/tmp/demo_s12/log.json')); print({k: v for k, v in d.items() if not isinstance(v, list)})" \
    2>&1 | cut -c1-3000 ;;
s13)
  tier s13 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py tests/kernels/test_gated_delta_rule_sm90.py \
    -k "persistent or dispatch or backend_function"
  timed time_persist ${TIME_S:-100} python3 tools/time_gdn_dchunk.py --shapes 2 --persist ;;
s14)
  tier s14 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_sm90.py -k "dispatch_leaves"
  for hd in 128 64; do timed host$hd 120 python3 tools/diag_gdn_host.py --head-dim $hd; done
  timed wy 120 python3 tools/time_gdn_fwd.py --shapes 1 --wy-only --profile
  timeout -k 10 ${BENCH_S:-300} python3 -m benchmarks.bench_gated_delta_rule --warmup 10 --rep 40 --rounds ${ROUNDS:-3} --shapes 2 \
    --head-dim 64 --json $OUT/bench_gdn64.json > $OUT/bench_gdn64.log 2>&1
  echo "bench_gdn rc=$?"; grep -vE "^\s*$" $OUT/bench_gdn64.log | tail -n 12 | cut -c1-300 ;;
s15)
  tier s15 ${GDN_S:-280} tests/kernels/test_gated_delta_rule_sm90.py -k "wy_scan or two_warpgroup_wy or \
forward_matches_oracle or forward_varlen or in_kernel_gate or head_dims or chunk_inverses or dispatch_leaves"
  timed wy 150 python3 tools/time_gdn_fwd.py --shapes 2 --wy-only --profile
  timed hostprof 100 python3 tools/diag_gdn_host.py --cprofile --calls 30 ;;
s16|s16a)
  # s16a: the first half of s16 (the GPU cases and the wy timings), to fit one 600 s call
  tier s16 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py \
    -k "wy_async or wy_scan or (forwards_values and wgs2)"
  timed wy 150 python3 tools/time_gdn_fwd.py --shapes 2 --wy-only --profile
  CUDNN_TRAIN_GDN_WY_ASYNC=1 timed wy_async 100 python3 tools/time_gdn_fwd.py --shapes 1 --wy-only --profile
  if [ "$1" = s16 ]; then bash "$0" s16b; fi ;;
s17)
  # the twelfth session's default flips: the wy kernel's cp.async tiles (the whole forward tier runs on them)
  # and stage 3 on two warpgroups at K = 64 (its cases, the training path's K = 64 cases with both stage 3s)
  tier s17 ${GDN_S:-300} tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py \
    tests/kernels/test_gated_delta_rule_train_sm90.py \
    -k "test_gated_delta_rule_sm90.py or at_64 or varlen_64 or pair64 or head_dim_64" ;;
s18)
  # the sweep's next q, k issued early (CUDNN_TRAIN_GDN_SWEEP_EARLY_QK): its bitwise cases, then time + profile
  tier s18 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_bwd_sm90.py -k "prefetch_is_bitwise"
  timed sweep_eq 150 python3 tools/time_gdn_sweep.py --shapes 2 --early-qk ;;
s19)
  # prepared in the twelfth session: the wy kernel's A in two passes (CUDNN_TRAIN_GDN_WY_A2) and the split
  # sweep's dvl P in two passes (CUDNN_TRAIN_GDN_DVL_P2): bitwise cases, then their timings (flip if faster)
  tier s19 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    -k "two_pass or two_passes or p_select"
  CUDNN_TRAIN_GDN_WY_A2=1 timed wy_a2 150 python3 tools/time_gdn_fwd.py --shapes 2 --wy-only --profile
  timed dvl_p2 120 python3 tools/time_gdn_sweep.py --shapes 2 --p2 ;;
s19b)
  # P by a select in the out kernel (CUDNN_TRAIN_GDN_OUT_PSEL) and the fused state kernel (CUDNN_TRAIN_GDN_FWD_PSEL):
  # their rows in the forward's kernel timings, each next to its default
  GDN_TIER=0 TIME_S=200 bash "$0" gdn_fwd ;;
s20)
  # the sweep's and stage 3's profiles with their first phase split (the wait for the loads, then the l2norm
  # rows): where the sweep's 31% "chunk wait" and stage 3's loads phase go
  timed sweep_prof 120 python3 tools/time_gdn_sweep.py --shapes 2 --profile
  timed dchunk_prof 200 python3 tools/time_gdn_dchunk.py --shapes 1 --profile ;;
s21)
  # prepared in the thirteenth session: the fused state pass on two specialized warpgroups (CUDNN_TRAIN_GDN_FWD_WS):
  # its cases (oracle, final state bitwise the fused kernel's), then its time against the fused kernel, alternating
  tier s21 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_sm90.py -k "specialized_warpgroups"
  timed ws 150 python3 tools/time_gdn_fwd.py --shapes 2 --ws-only --profile ;;
s21b)
  # the specialized-warpgroup state pass as the inference default: the edited fused-kernel cases (SPLIT and STATE_WS
  # forced off) and its own, then the benchmark's first shape (BENCH_S limit)
  tier s21b ${GDN_S:-200} tests/kernels/test_gated_delta_rule_sm90.py \
    -k "specialized or prefetch_matches or p_select or two_warpgroup_state or split_state_pass or store_states_fused"
  BENCH_S=${BENCH_S:-300} SHAPES=1 ROUNDS=${ROUNDS:-3} bash "$0" bench_gdn ;;
s22)
  # prepared in the thirteenth session: the specialized warpgroups' loads by TMA (CUDNN_TRAIN_GDN_FWD_WS_TMA): its
  # bitwise cases against the cp.async loads, then its time and profile next to them
  tier s22 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_sm90.py -k "tma_loads"
  timed ws_tma 200 python3 tools/time_gdn_fwd.py --shapes 2 --ws-only --profile ;;
s23)
  # prepared in the thirteenth session: w and u formed in the specialized warpgroups' chain (CUDNN_TRAIN_GDN_FWD_ONFLY)
  # after the wy kernel's gate-free inverse variant: its oracle cases, then the timings (--ws-only)
  tier s23 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_sm90.py -k "formed_in_the_chain"
  timed ws_onfly 200 python3 tools/time_gdn_fwd.py --shapes 2 --ws-only ;;
s24)
  # prepared in the thirteenth session: the reverse sweep on two specialized warpgroups (CUDNN_TRAIN_GDN_SWEEP_WS):
  # its cases (reference, vs the fused kernel, varlen GVA K = 64), then its time against the fused kernel
  tier s24 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_bwd_sm90.py -k "specialized_warpgroups"
  timed sweep_ws 150 python3 tools/time_gdn_sweep.py --shapes 2 --ws ;;
s25)
  # the thirteenth and fourteenth sessions' prepared work in one call: every new GPU case (TMA loads, w and u formed
  # in the chain, two output warpgroups, 128 columns of V a CTA, the specialized-warpgroup sweep), then the forward's
  # and the sweep's timings (flip a default only if faster)
  tier s25 ${GDN_S:-320} tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    -k "tma_loads or formed_in_the_chain or output_warpgroups or v_block_128 or rows_past_the_last or specialized_warpgroups_match_reference or specialized_warpgroups_varlen or specialized_warpgroups_tma"
  timed sweep_ws 120 python3 tools/time_gdn_sweep.py --shapes 2 --ws ;;
s26)
  # then (its own call: the limits would pass 600 s together) the forward's timings of everything prepared: TMA, two
  # output warpgroups, 128 columns a CTA, w and u in the chain, the training forward at 128 columns; with profiles
  timed ws_all ${TIME_S:-400} python3 tools/time_gdn_fwd.py --shapes 2 --ws-only --profile ;;
s27)
  # the fifteenth session's prepared work, its GPU cases: stage 3's loads by TMA (CUDNN_TRAIN_GDN_DCHUNK_TMA) per
  # tile and persistent, the persistent profile variant, the fused sweep's prefetch (CUDNN_TRAIN_GDN_SWEEP_TMA), the
  # split sweep's dchain (CUDNN_TRAIN_GDN_DCHAIN_TMA) and the training forward's chain (CUDNN_TRAIN_GDN_CHAIN_TMA) by
  # TMA, each bitwise its cp.async loads; then stage 3's timings and profiles (flip a default only if faster)
  # (the specialized-warpgroup sweep's TMA variant is in s25: its cases and its row of time_gdn_sweep.py --ws)
  tier s27 ${GDN_S:-300} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    tests/kernels/test_gated_delta_rule_sm90.py -k "tma_chunk_gradients or persistent or dchain_tma or tma_prefetch or chain_tma"
  timed dchunk_tma ${TIME_S:-200} python3 tools/time_gdn_dchunk.py --shapes 2 --tma ;;
s28)
  # then (its own call) the other TMA variants' timings against cp.async, and the persistent stage 3's profile
  timed sweep_tma 100 python3 tools/time_gdn_sweep.py --shapes 1 --tma
  timed dchain_tma 100 python3 tools/time_gdn_sweep.py --shapes 2 --dchain-tma
  timed chain_tma 100 python3 tools/time_gdn_fwd.py --shapes 2 --chain-tma
  timed dchunk_persist 120 python3 tools/time_gdn_dchunk.py --shapes 1 --persist ;;
s29)
  # the sixteenth session's leftovers: w and u formed in the chain, timed for the first time (its earlier rows ran the
  # fused state kernel, where onfly does not apply), and the specialized-warpgroup sweep's timing (cut at 120 s
  # by its compiles in s25); first the new K = 128, V = 64 cases of the TMA loads and the two output warpgroups;
  # then (their own calls) the whole GDN tiers under the new TMA defaults: gpu_next.sh gdn, gdn_train
  tier s29 ${GDN_S:-120} tests/kernels/test_gated_delta_rule_sm90.py -k "v64_varlen"
  timed onfly ${TIME_S:-200} python3 tools/time_gdn_fwd.py --shapes 2 --onfly
  timed sweep_ws 240 python3 tools/time_gdn_sweep.py --shapes 2 --ws ;;
s30)
  # the sixteenth session's prepared out-kernel TMA loads (CUDNN_TRAIN_GDN_OUT_TMA): its bitwise cases, then the
  # out kernel alone both ways (flip the default only if faster)
  tier s30 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_sm90.py -k "out_tma"
  timed out_tma ${TIME_S:-150} python3 tools/time_gdn_fwd.py --shapes 2 --out-tma ;;
s31)
  # the sixteenth session's prepared V blocks of 16 for both split chains (the training forward's chain and the
  # split sweep's dchain; B1's defaults run 32): their cases with the others of the same tests, then the chains'
  # timings at every V block (flip CHAIN_VB / SWEEP_SPLIT_VB's heuristics only if 16 is faster at B1)
  tier s31 ${GDN_S:-300} tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    -k "split_state_pass_matches_oracle or split_chain_tma or split_sweep_matches_reference or split_sweep_dchain_tma"
  timed chain_vb ${TIME_S:-120} python3 tools/time_gdn_fwd.py --shapes 2 --chain-tma
  timed dchain_vb 150 python3 tools/time_gdn_sweep.py --shapes 2 --split-only ;;
s32)
  # the seventeenth session's prepared fused sweep with both V halves in one CTA (CUDNN_TRAIN_GDN_SWEEP_VH2): its
  # bitwise cases, then its timing against a CTA a half (flip the default only if faster at B4)
  tier s32 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_sm90.py -k "two_v_halves"
  timed vh2 ${TIME_S:-150} python3 tools/time_gdn_sweep.py --shapes 2 --vh2 ;;
s33)
  # the eighteenth session's prepared two-chain stage 3 (CUDNN_TRAIN_GDN_DCHUNK_CHAINS): its cases against the
  # per-tile kernel and the torch stage, then its timing against the per-tile kernel (the default only if faster)
  tier s33 ${GDN_S:-300} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k "two_chain"
  timed chains ${TIME_S:-270} python3 tools/time_gdn_dchunk.py --shapes 2 --chains
  if [ -n "$CHAINS_TRAIN" ]; then  # then the training tier's kernel half with it on (the training path's call)
    CUDNN_TRAIN_GDN_DCHUNK_CHAINS=1 tier s33_train ${TRAIN_S:-300} tests/kernels/test_gated_delta_rule_train_sm90.py \
      -k "not torch"
  fi ;;
s35)
  # the twentieth session's prepared relaxed first cluster arrive in stage 3 (CUDNN_TRAIN_GDN_DCHUNK_RELAXED): its
  # bitwise cases, then its timing against the release form (the default only if faster)
  tier s35 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k "relaxed"
  timed relaxed ${TIME_S:-150} python3 tools/time_gdn_dchunk.py --shapes 2 --relaxed ;;
s36)
  # the twenty-first session's dH stores by stmatrix and TMA in the fused sweep (CUDNN_TRAIN_GDN_SWEEP_DHTMA, now on):
  # its bitwise cases, then its timing against the per-element stores at B4 (SHAPES)
  tier s36 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_sm90.py -k "dh_tma"
  timed dh_tma ${TIME_S:-150} python3 tools/time_gdn_sweep.py --shapes ${SHAPES:-1} --dh-tma ;;
s37)
  # the twenty-first session's dvn stores by stmatrix and TMA (CUDNN_TRAIN_GDN_SWEEP_DVNTMA, on since the 22nd): its bitwise
  # cases, then its timing against dH's TMA stores alone at B4 (SHAPES)
  tier s37 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_sm90.py -k "dvn_tma"
  timed dvn_tma ${TIME_S:-150} python3 tools/time_gdn_sweep.py --shapes ${SHAPES:-1} --dvn-tma ;;
s38)
  # the twenty-second session's TMA stores of the split forward's chain (CUDNN_TRAIN_GDN_CHAIN_HSTMA / _VNTMA, on
  # since): their bitwise cases, then the chain's timing at VB 64 and 32 and the training forward's (SHAPES)
  tier s38 ${GDN_S:-240} tests/kernels/test_gated_delta_rule_sm90.py -k "chain_tma_stores"
  timed chain_stores ${TIME_S:-200} python3 tools/time_gdn_fwd.py --shapes ${SHAPES:-1} --chain-stores ;;
s39)
  # the twenty-second session's prepared TMA stores of the split sweep's dchain (CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA)
  # and of the split forward's out kernel (CUDNN_TRAIN_GDN_OUT_OTMA): their bitwise cases, then the split sweep's
  # timing with them against the element stores (SHAPES=2: B1 T16384, the shape the split sweep serves), then the
  # out kernel's
  tier s39 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_sm90.py tests/kernels/test_gated_delta_rule_sm90.py \
    -k "dchain_tma_stores or out_o_tma"
  timed dchain_stores ${TIME_S:-200} python3 tools/time_gdn_sweep.py --shapes ${SHAPES:-2} --dchain-stores
  timed out_otma ${TIME_S:-120} python3 tools/time_gdn_fwd.py --shapes 1 --out-otma ;;
s34)
  # the twentieth session's paired shared-memory accesses in stage 3: the persistent variant's bitwise cases against
  # the per-tile kernel (the helpers changed in both), then the two-chain cases (GDN_S limit)
  tier s34 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k "persistent or two_chain" ;;
s40)
  # the twenty-third session's prepared segments (CUDNN_TRAIN_GDN_CHAIN_SEG, _SWEEP_SEG): their cases, then the
  # chain's timing at both shapes (each segment count, the whole forwards 1 / auto), then the sweep's
  tier s40 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    -k "segments"
  # (ONLY=i: only shape i, 1 = B1 T16384; SWEEP_FIRST=1: the sweep's timing before the chain's)
  only=${ONLY:+--only $ONLY}
  if [ -n "$SWEEP_FIRST" ]; then timed sweep_seg ${TIME_S:-200} python3 tools/time_gdn_sweep.py --shapes ${SHAPES:-2} $only --seg; fi
  timed chain_seg ${TIME_S:-200} python3 tools/time_gdn_fwd.py --shapes ${SHAPES:-2} $only --chain-seg
  if [ -z "$SWEEP_FIRST" ]; then timed sweep_seg ${TIME_S:-200} python3 tools/time_gdn_sweep.py --shapes ${SHAPES:-2} $only --seg; fi ;;
s41)
  # the twenty-fifth session's prepared stage-3 variant with E in registers (CUDNN_TRAIN_GDN_DCHUNK_EREG): its bitwise
  # cases, then its timing against the default (per tile and persistent, both shapes)
  tier s41 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k "ereg"
  timed ereg ${TIME_S:-150} python3 tools/time_gdn_dchunk.py --shapes ${SHAPES:-2} --ereg ;;
s42|s42b)
  # the twenty-sixth session's questions. s42: the carried splits' GPU cases (CUDNN_TRAIN_GDN_FWD_CARRY, _SWEEP_CARRY,
  # prepared), then at FLA's layer-init gates (--gates layer: slow heads, the warm-up split's worst case) the op
  # unsplit (op), with the warm-up splits (op-seg) and with the carried ones (op-carry), with the peers; s42b: the
  # same benchmark at the benchmark's own fast gates (BENCH_S limit, SHAPES, ROUNDS)
  gates=layer
  if [ "$1" = s42 ]; then
    tier s42 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py \
      -k "carried"
  else
    gates=bench
  fi
  timeout -k 10 ${BENCH_S:-400} python3 -m benchmarks.bench_gated_delta_rule --warmup 10 --rep 40 \
    --rounds ${ROUNDS:-2} --shapes ${SHAPES:-2} --graphed --seg --carry --gates $gates --skip cutedsl${SKIP:+,$SKIP} \
    --json $OUT/bench_seg_$gates.json > $OUT/bench_seg_$gates.log 2>&1
  echo "bench --gates $gates rc=$?"; grep -E "round|^\|" $OUT/bench_seg_$gates.log | cut -c1-240 ;;
s43)
  # the twenty-sixth session's candidate default (2% of the H100's B4 forward+backward): every stage-3 case but the
  # two-chain ones (the two-chain kernel refuses persistent and E in registers: a ValueError, not a result), then
  # the training tier's kernel half, both with CUDNN_TRAIN_GDN_DCHUNK_PERSIST=1 and _EREG=1 (GDN_S, TRAIN_S limits)
  export CUDNN_TRAIN_GDN_DCHUNK_PERSIST=1 CUDNN_TRAIN_GDN_DCHUNK_EREG=1
  tier s43 ${GDN_S:-300} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k "not two_chain"
  TRAIN_K=1 TRAIN_S=${TRAIN_S:-280} bash "$0" gdn_train ;;
s43rest)
  # the cases s43 left unfinished in the twenty-seventh session (its 77 + 20 passed, none failed): the rest of the
  # stage-3 tier and of the training tier's kernel half, with stage 3 persistent and E in registers
  export CUDNN_TRAIN_GDN_DCHUNK_PERSIST=1 CUDNN_TRAIN_GDN_DCHUNK_EREG=1
  tier s43rest ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k "not two_chain and \
(group_sum_in_kernel or bitwise_reproducible or (with_the_forwards_values and (T1_fp16 or T300 or pair64 or wgs1 \
or wgs4)))"
  TRAIN_K=1 TRAIN_S=${TRAIN_S:-300} \
    TRAIN_SEL="bitwise or head_dim_64 or in_kernel_gate or recomputed or no_l2norm or state_layouts or varlen" \
    bash "$0" gdn_train ;;
s44)
  # the twenty-eighth session's dKK in dA's terms, dk's two products (CUDNN_TRAIN_GDN_DCHUNK_DKKSYM): its cases (GDN_S),
  # then the timing against the sT round trip per tile, persistent, persistent with E in registers (TIME_S)
  tier s44 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k "dkk_sym"
  timed dkksym ${TIME_S:-150} python3 tools/time_gdn_dchunk.py --dkksym --shapes 1 ;;
s46)
  # the default stage 3 (persistent, E in registers) and the per-tile kernel, both with their profile variants
  # (time_gdn_dchunk.py --persist: bitwise, timed, then the per-phase cycles a tile of each), B4 T4096 (TIME_S)
  timed persist ${TIME_S:-300} python3 tools/time_gdn_dchunk.py --persist --shapes 1 ;;
s48)
  tier s48 ${GDN_S:-300} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py ;;
s50)
  # the thirty-third session's: the l2norm rows eight threads a row in stage 3 and the fused sweep
  # (CUDNN_TRAIN_GDN_DCHUNK_NORM8, CUDNN_TRAIN_GDN_SWEEP_NORM8; GPU-run in that session: 20 passed, no gain, off):
  # their cases and the two-chain ones (s49's), then B4's forward+backward through the op with both switches off / on alternating (ONS), each with
  # --kernels (graphed, ours only, layer-init gates; BENCH_S each)
  tier s50 ${GDN_S:-240} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py \
    tests/kernels/test_gated_delta_rule_bwd_sm90.py -k "two_chain or norm8"
  for on in ${ONS:-0 1 0 1}; do
    CUDNN_TRAIN_GDN_DCHUNK_NORM8=$on CUDNN_TRAIN_GDN_SWEEP_NORM8=$on timeout -k 10 ${BENCH_S:-150} \
      python3 -m benchmarks.bench_gated_delta_rule --warmup 10 --rep 40 --from-shape ${FROM:-0} --shapes ${SHAPES:-1} \
      --graphed --kernels --gates layer --rounds 1 --skip fla,cutedsl,flashqla,sm90-train > $OUT/bench_norm8_$on.log 2>&1
    echo "bench NORM8=$on rc=$?"; grep -vE "^\s*$" $OUT/bench_norm8_$on.log | tail -n 22 | cut -c1-200
  done ;;
s52)
  # the thirty-third session's prepared: stage 3 persistent issuing the next tile's k early
  # (CUDNN_TRAIN_GDN_DCHUNK_EARLYK): its bitwise cases (GDN_S), stage 3 alone off / on alternating
  # (time_gdn_dchunk.py --early-k, TIME_S), then B4's op off / on (ONS, BENCH_S each, --kernels)
  tier s52 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k early_k
  timed early_k ${TIME_S:-120} python3 tools/time_gdn_dchunk.py --early-k --shapes ${SHAPES:-1}
  for on in ${ONS:-0 1 0 1}; do
    CUDNN_TRAIN_GDN_DCHUNK_EARLYK=$on timeout -k 10 ${BENCH_S:-120} python3 -m benchmarks.bench_gated_delta_rule \
      --warmup 10 --rep 40 --shapes 1 --graphed --kernels --gates layer --rounds 1 \
      --skip fla,cutedsl,flashqla,sm90-train > $OUT/bench_earlyk_$on.log 2>&1
    echo "bench EARLYK=$on rc=$?"; grep -E "round 1|fwd\+bwd kernels" $OUT/bench_earlyk_$on.log | cut -c1-400
  done
  if [ "${PROF:-0}" = 1 ]; then  # the persistent kernel's phases with NORM8 off / on (where did its 0.8K go)
    for on in 0 1; do
      CUDNN_TRAIN_GDN_DCHUNK_NORM8=$on timed persist_norm8_$on ${TIME_S:-120} python3 tools/time_gdn_dchunk.py --persist --shapes 1
    done
  fi ;;
s53)
  # the thirty-fourth session: where the default forwards' state pass spends a chunk (both warpgroups' phases)
  timed fwd_prof ${TIME_S:-150} python3 tools/time_gdn_fwd.py --profile-defaults --only ${ONLY:-0} ;;
s54)
  # the thirty-fourth session's prepared: CUDNN_TRAIN_GDN_FWD_WS_TLAYOUT and _ULDM
  tier s54 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_sm90.py -k transposed_tiles_and_ldmatrix_are_bitwise
  timed tlayout ${TIME_S:-150} python3 tools/time_gdn_fwd.py --tlayout --shapes ${SHAPES:-1}
  if [ "${PROF:-0}" = 1 ]; then
    CUDNN_TRAIN_GDN_FWD_WS_TLAYOUT=1 CUDNN_TRAIN_GDN_FWD_WS_ULDM=1 timed fwd_prof_tl ${TIME_S:-150} \
      python3 tools/time_gdn_fwd.py --profile-defaults --only 0
  fi ;;
s56)
  # the thirty-fifth session's prepared: CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY and reverse_sweep(beta=)
  # (and CUDNN_TRAIN_GDN_FWD_WS_CLOADS: its bitwise cases, then --cloads; --kshare again, now over OTMA's default)
  # (each part's limit 0 skips it: the three together exceed one call's 600 s at their defaults)
  if [ "${GDN_S:-200}" != 0 ]; then
    tier s56 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py \
      -k "w_u_in_the_chain or on_tm or takes_tm or chain_issued_loads"
  fi
  if [ "${TRAIN_S:-300}" != 0 ]; then
    tier s56train ${TRAIN_S:-300} tests/kernels/test_gated_delta_rule_train_sm90.py -k w_and_u_formed
  fi
  if [ "${TIME_S:-120}" != 0 ]; then
    timed train_onfly ${TIME_S:-120} python3 tools/time_gdn_fwd.py --train-onfly --shapes 1
    timed cloads ${TIME_S:-120} python3 tools/time_gdn_fwd.py --cloads --shapes 1
    timed kshare2 ${TIME_S:-120} python3 tools/time_gdn_fwd.py --kshare --shapes 1
  fi ;;
s55)
  # the thirty-fourth session's: CUDNN_TRAIN_GDN_FWD_WS_OTMA, then the forward's tier under TLAYOUT / ULDM on
  tier s55 ${GDN_S:-150} tests/kernels/test_gated_delta_rule_sm90.py -k o_tma_stores_and_shared_k_factors
  timed otma ${TIME_S:-120} python3 tools/time_gdn_fwd.py --otma --shapes 1
  timed kshare ${TIME_S:-120} python3 tools/time_gdn_fwd.py --kshare --shapes 1
  if [ "${TIER_S:-0}" != 0 ]; then
    tier fwd_tier ${TIER_S} tests/kernels/test_gated_delta_rule_sm90.py
  fi ;;
s51)
  # the stage-3 and reverse-sweep tiers whole with both NORM8 switches on (the oracle cases under the candidate
  # default; also the stage-3 tier owed since launch_choice, s48's)
  export CUDNN_TRAIN_GDN_DCHUNK_NORM8=1 CUDNN_TRAIN_GDN_SWEEP_NORM8=1
  tier s51 ${GDN_S:-400} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py ;;
s49)
  # the thirty-second session's owed cases: the two-chain stage-3 cases with the switch's bitwise check (the
  # persistent default steps aside for the switch too)
  tier s49 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k two_chain ;;
s47|s47b|s47train)
  # the twenty-ninth session's training forward on the specialized warpgroups with its chunk states and vn by TMA
  # stores from transposed tiles (CUDNN_TRAIN_GDN_FWD_WS_TSTORE, prepared): its bitwise cases and the dispatch case
  # (GDN_S), time_gdn_fwd.py --tstore at B4 (TIME_S). s47b: forward+backward through the op at B4 (SHAPES) with the
  # switch off and on, alternating (graphed, ours only; BENCH_S each; ONS the settings in order; FROM the first
  # shape, 0 B4, 1 B1, 2 B8). s47train: the training tier's kernel half with it on and the specialized warpgroups
  # forced (CUDNN_TRAIN_GDN_FWD_WS=1: the tier's small grids would take the split pass) (TRAIN_S)
  if [ "$1" = s47train ]; then
    CUDNN_TRAIN_GDN_FWD_WS=1 CUDNN_TRAIN_GDN_FWD_WS_TSTORE=1 TRAIN_K=1 bash "$0" gdn_train
  elif [ "$1" = s47 ]; then
    tier s47 ${GDN_S:-200} tests/kernels/test_gated_delta_rule_sm90.py -k "transposed_stores or with_tstore"
    timed tstore ${TIME_S:-150} python3 tools/time_gdn_fwd.py --tstore --only 0
  else
    for on in ${ONS:-0 1 0 1}; do
      CUDNN_TRAIN_GDN_FWD_WS_TSTORE=$on timeout -k 10 ${BENCH_S:-130} python3 -m benchmarks.bench_gated_delta_rule \
        --warmup 10 --rep 40 --from-shape ${FROM:-0} --shapes ${SHAPES:-1} --graphed --rounds 1 \
        --skip fla,cutedsl,flashqla,sm90-train > $OUT/bench_tstore$on.log 2>&1
      echo "bench TSTORE=$on rc=$?"; grep -E "round" $OUT/bench_tstore$on.log | cut -c1-200
    done
  fi ;;
s45)
  # the candidate stage-3 defaults through the GDN kernel tiers (forward, sweeps, stage 3; the two-chain cases
  # refuse persistent and E in registers: a ValueError, not a result); then the training tier's kernel half with
  # them (TRAIN_SEL as s43rest: the cases s43 left; TRAIN_S)
  export CUDNN_TRAIN_GDN_DCHUNK_PERSIST=1 CUDNN_TRAIN_GDN_DCHUNK_EREG=1
  tier s45 ${GDN_S:-540} tests/kernels/test_gated_delta_rule_sm90.py tests/kernels/test_gated_delta_rule_bwd_sm90.py \
    tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py -k "not two_chain and not dkk_sym"
  if [ "${TRAIN_S:-0}" != 0 ]; then
    TRAIN_K=1 TRAIN_SEL="bitwise or head_dim_64 or in_kernel_gate or recomputed or no_l2norm or state_layouts or varlen" \
      bash "$0" gdn_train
  fi ;;
s42train)
  # the training path through the op with the reverse sweep's carried split in 4 segments (forced: the tier's shapes
  # are too short for auto), kernel half (TRAIN_S limit)
  CUDNN_TRAIN_GDN_SWEEP_CARRY=4 TRAIN_K=1 bash "$0" gdn_train ;;
s40train)
  # then the training path through the op with both recurrences in 4 segments (forced: the tier's shapes are too short
  # for auto), kernel half (TRAIN_S limit)
  CUDNN_TRAIN_GDN_CHAIN_SEG=4 CUDNN_TRAIN_GDN_SWEEP_SEG=4 TRAIN_K=1 bash "$0" gdn_train ;;
fqnorm)
  # FlashQLA's l2norm (torch.compile, dynamic rows) in fresh processes: does its speed move between them
  timed fqnorm ${FQ_S:-150} python3 tools/diag_flashqla_l2norm.py --procs ${PROCS:-3} ;;
order)
  # does running our kernels slow a peer afterwards (diag_gdn_host.py saw FlashQLA's forward go 0.40 -> 0.78 ms)
  timed order 200 python3 tools/diag_gdn_order.py
  if [ -n "$ORDER_TRAIN" ]; then timed order_train 250 python3 tools/diag_gdn_order.py --train; fi ;;
s16b)
  timed host 150 python3 tools/diag_gdn_host.py
  timed sweep_prof 120 python3 tools/time_gdn_sweep.py --shapes 2 --profile
  timed dchunk64 150 python3 tools/time_gdn_dchunk.py --shapes 2 --k64 ;;
ssplit)
  # the split reverse sweep (opt-in CUDNN_TRAIN_GDN_SWEEP_SPLIT=1): its GPU cases, its timing against the
  # default, then (SPLIT_TRAIN=1) the training tier's kernel half with it on
  timeout -k 10 ${GDN_S:-150} $P -n 8 tests/kernels/test_gated_delta_rule_bwd_sm90.py -k "split" > $OUT/ssplit.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed" $OUT/ssplit.log | tail -12
  timeout -k 10 ${TIME_S:-90} python3 tools/time_gdn_sweep.py --shapes ${SHAPES:-2} --split-only > $OUT/time_sweep.log 2>&1
  echo "time rc=$?"; cut -c1-160 $OUT/time_sweep.log
  if [ -n "$SPLIT_TRAIN" ]; then
    CUDNN_TRAIN_GDN_SWEEP_SPLIT=1 timeout -k 10 ${TRAIN_S:-300} $P -n ${TRAIN_N:-6} \
      tests/kernels/test_gated_delta_rule_train_sm90.py -k "not torch" > $OUT/ssplit_train.log 2>&1
    echo "train pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
    grep -E " (FAILED|ERROR) |passed|failed" $OUT/ssplit_train.log | tail -12
  fi ;;
sweep2)
  # the reverse sweep's tier (one and two warpgroups), then the training path's kernels with each count
  timeout -k 10 ${GDN_S:-150} $P -n 8 tests/kernels/test_gated_delta_rule_bwd_sm90.py > $OUT/sweep2.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed" $OUT/sweep2.log | tail -12
  timeout -k 10 60 python3 tools/time_gdn_sweep.py --shapes ${SHAPES:-2} > $OUT/time_sweep.log 2>&1
  echo "time rc=$?"; cut -c1-160 $OUT/time_sweep.log
  for w in 1 2; do
    CUDNN_TRAIN_GDN_SWEEP_WGS=$w timeout -k 10 ${PROF_S:-120} python3 tools/prof_gdn_train.py --shapes ${SHAPES:-2} \
      > $OUT/prof_sweep$w.log 2>&1
    echo "sweep wgs=$w: prof rc=$?"; grep -E "B[0-9]|kernel time|whole|cutedsl" $OUT/prof_sweep$w.log | cut -c1-110
  done ;;
gdn_prof)
  # where the opt-in training path's time goes: kernels under torch.profiler, then the whole call vs FLA
  timeout -k 10 ${PROF_S:-300} python3 tools/prof_gdn_train.py --shapes ${SHAPES:-2} > $OUT/prof_gdn_train.log 2>&1
  echo "prof rc=$?"; cut -c1-200 $OUT/prof_gdn_train.log | tail -n 70 ;;
ncu)
  # Nsight Compute on the GDN backward's kernels (NCU_WHAT: dchunk sweep, as tools/ncu_gdn.py names them): the full
  # section set of the second call's kernels, the details page (stall reasons, shared-memory bank conflicts), then
  # the SASS lines with the most stall samples (tools/ncu_top.py)
  for w in ${NCU_WHAT:-dchunk sweep}; do
    timeout -k 10 ${NCU_S:-200} ncu --clock-control none --profile-from-start off --set full -f -o $OUT/ncu_$w \
      python3 tools/ncu_gdn.py $w > $OUT/ncu_$w.run.log 2>&1
    echo "ncu $w rc=$?"; tail -n 3 $OUT/ncu_$w.run.log | cut -c1-200
    ncu -i $OUT/ncu_$w.ncu-rep --page details > $OUT/ncu_$w.txt 2>&1
    grep -E "Duration|Elapsed Cycles|Registers|Achieved Occupancy|Issue Slots Busy|Issued Ipc|No Eligible|Warp Cycles Per|Active Warps Per|Eligible Warps|Bank|Shared|Compute \(SM\) Th|Memory Th|Stall|stall" \
      $OUT/ncu_$w.txt | cut -c1-170 | head -60
    ncu -i $OUT/ncu_$w.ncu-rep --page source --csv --print-source sass > $OUT/ncu_${w}_src.csv 2> $OUT/ncu_${w}_src.err
    echo "source page rc=$?"; head -c 300 $OUT/ncu_${w}_src.err
    python3 tools/ncu_top.py $OUT/ncu_${w}_src.csv --top ${NCU_TOP:-40} 2>&1 | cut -c1-220 | head -80
  done ;;
fused)
  # the fused backward (thirty-ninth session): one small case's errors first (a hang shows in seconds), its GPU
  # cases, then tools/time_gdn_fused.py against sweep + stage 3
  if [ "${FUSED_CASES:-1}" = 1 ]; then
    timed smoke ${SMOKE_S:-150} python3 tools/smoke_gdn_fused.py $SMOKE_ARGS
    grep -q "debug=False" $OUT/smoke.log || { echo "smoke did not finish: the cases skipped"; exit 1; }
    timeout -k 10 ${FUSED_S:-240} $P -n 4 tests/kernels/test_gated_delta_rule_bwd_fused_sm90.py \
      ${FUSED_K:+-k "$FUSED_K"} > $OUT/fused.log 2>&1
    echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
    grep -E " (FAILED|ERROR) |passed|failed|^E  .*(rel|assert|Error)" $OUT/fused.log | cut -c1-220 | head -30
  fi
  if [ "${FUSED_TIME:-1}" = 1 ]; then  # the rows' kernels built side by side first (FUSED_WARM: which)
    for w in ${FUSED_WARM:-fused split two fused_prof split_prof}; do
      timeout -k 10 200 python3 tools/time_gdn_fused.py --warm $w > $OUT/warm_$w.log 2>&1 &
    done
    wait; tail -n 2 $OUT/warm_*.log | cut -c1-200
  fi
  [ "${FUSED_TIME:-1}" = 1 ] && timed time_fused ${TIME_S:-150} python3 tools/time_gdn_fused.py --shapes ${SHAPES:-1} \
    $FUSED_ARGS ;;
fused40)
  # the fortieth session's: every row's kernels built side by side, the split variant's smoke, the rows' timings and
  # profiles, then the GPU cases (FUSED_K selection, FUSED_S limit)
  for w in ${FUSED_WARM:-fused split split_kdb dq1 two fused_prof split_prof dq1_prof}; do
    timeout -k 10 240 python3 tools/time_gdn_fused.py --warm $w > $OUT/warm_$w.log 2>&1 &
  done
  wait; tail -n 2 $OUT/warm_*.log | cut -c1-200
  timed smoke ${SMOKE_S:-60} python3 tools/smoke_gdn_fused.py --splitdk --no-debug
  grep -q "debug=False" $OUT/smoke.log || { echo "smoke did not finish: the rest skipped"; exit 1; }
  rows=${ROWS:-fused,split,split_kdb,dq1}
  timed smoke_dq1 ${SMOKE_S:-60} python3 tools/smoke_gdn_fused.py --dq1 --no-debug
  grep -q "debug=False" $OUT/smoke_dq1.log || { rows=${rows/,dq1/}; echo "dq1 smoke did not finish: rows $rows"; }
  timed time_fused ${TIME_S:-150} python3 tools/time_gdn_fused.py --profile --rows $rows
  timeout -k 10 ${FUSED_S:-200} $P -n 4 tests/kernels/test_gated_delta_rule_bwd_fused_sm90.py \
    ${FUSED_K:+-k "$FUSED_K"} > $OUT/fused.log 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E " (FAILED|ERROR) |passed|failed|^E  .*(rel|assert|Error)" $OUT/fused.log | cut -c1-220 | head -30 ;;
save_caches)
  cd "$HOME" || exit 1
  list=$(find .triton/cache -name "*.autotune.json" 2>/dev/null; [ -d .tilelang ] && echo .tilelang)
  tar czf $OUT/jit_caches.tgz $list 2>/dev/null
  mb=$(( $(stat -c %s $OUT/jit_caches.tgz) / 1048576 ))
  if [ $mb -gt 60 ]; then  # too big to come back: the autotune choices alone
    tar czf $OUT/jit_caches.tgz $(find .triton/cache -name "*.autotune.json"); echo "TileLang cache left out (${mb} MiB)"
  fi
  ls -la $OUT/jit_caches.tgz; echo "autotune files: $(find .triton/cache -name '*.autotune.json' | wc -l)" ;;
*) echo "usage: bash tools/gpu_next.sh verify|demo|fla|fla1|fla2|fla3|gdn|gdn_train|gdn_fwd|gdn_bwd|dchunk|pending|states|dprof|ssplit|fwd2|sweep2|gdn_prof|bench_rms|bench_gdn|fused|ncu|save_caches"; exit 2 ;;
esac
