#!/bin/bash
# A device session's usual checks, one call per part: the GPU tests of the changed paths, a batch-1 A/B of two
# commits, and the served-vs-offline comparison (the engine in its own process, serve's default).
#
#   bash benchmarks/gpu_pending_checks.sh            # on the device, from the repository root
#
# Writes its JSON under $OUT (or /tmp/pending). Parts, each about one device call (at most 10 minutes):
#   tests  the whole gpu-marked suite but tensor parallelism: 7 to more than 10 min on an H100 (a cold machine
#          compiles every kernel), so one call may not hold it: tests-a (worker, layers, kernels), tests-b (spec,
#          engine, models, but the streamed kernels' engine tests), tests-c (the streamed MLP's engine tests) and
#          tests-d (the other streamed kernels' engine tests) split it in four, and tests-b1 (engine) and tests-b2 (spec,
#          models, the rotary epilogue's layer tests) split tests-b (tests-b whole ran past 560 s on a cold
#          H200, 2026-12-05); tests-b1a (early KV, the engine, the fused combine) and tests-b1b (HF graphs, the norm
#          fold, penalties, step timing, warm-up) split tests-b1 (26 of its 33 tests took 400 s on a warm H100,
#          2026-12-07)
#   tp     the tensor-parallel GPU tests (two GPUs or more): ~5 min
#   step   batch-1 TPOT and 32/128-stream throughput of the bundled pair at BASE and NEW, alternated twice (pack
#          them here first: `benchmarks/ab_commits.sh pack BASE NEW`, and carry .devdata). One process per run;
#          the host's speed moves by up to 2x between processes on these machines, so read medians of rounds.
#   serve  serve_vs_offline.py at 32 and 128 streams, both sides loaded, alternated rounds: ~4 min
#   closed the 128-stream closed batch with the draft: the adaptive policy against a fixed k = 1 and k = 2 for the
#          whole batch, beside the plain engine (plan_trace.py --fixed-k), and the windows' union busy time
#          (gpu_step_speed.py, bundled and 1B, async, batches 1 and 64): ~5 min
#   epilogues  the projections' epilogues of 2026-12-03 (SiLU-and-multiply on tensor-core tiles, RoPE + KV write in
#          q|k|v): their kernel tests, the bf16 engine tests that take them, and the 1B/8B graph-replay A/B of the
#          rotary epilogue against ASYNCSPEC_ROTARY_IN_LINEAR=0: ~6 min
#   streamed   the streamed MLP (ASYNCSPEC_STREAMED_MLP=barrier|split|split-deep), o projection
#          (ASYNCSPEC_STREAMED_O_PROJ=1) and attention input (ASYNCSPEC_STREAMED_ATTN_IN=1) of 2026-12-04/05: their kernel and engine GPU tests,
#          ~4 min on a cold machine
#   streamed-ab  the 1B/8B graph-replay A/B of each of those against the default, one at a time, then each
#          kernel's streaming rate alone against the chain's (streamed_kernels.py): ~5.5 min (an H100 measured no
#          gain on 2026-12-05; an H200 has not run them)
#   fused-combine  split-KV attention merging its splits in the split pass (ASYNCSPEC_ATTN_FUSED_COMBINE=1, of
#          2026-12-05): its kernel and engine GPU tests, and the 1B/8B graph-replay A/B (batches 1 to 32): ~6 min (all
#          passed on an H100 on 2026-12-05, and it was slower there: 3.1 % on the 1B step, 1.2 % on the 8B's)
#   down-proj  the streamed down projection (ASYNCSPEC_STREAMED_DOWN_PROJ, 2026-12-05): its kernel and engine GPU
#          tests, ~3-5 min
#   down-proj-ab  the bundled/1B graph-replay A/B of the down projection's auto (the 1B's streamed, not the bundled
#          target's) against ASYNCSPEC_STREAMED_DOWN_PROJ=0, two rounds, the streamed MLP off in both: ~2.5 min
#   deep-tiles  skinny_linear's tensor-core tiles with deeper pipelines at M = 16, 32 on the 1B and 8B projections
#          (skinny_linear.py --sweep --focus deep): the 32-stream step's projections read at 0.32-0.87 of an H200's
#          bandwidth with 48-96 KiB in flight a program (2026-12-03); then the one-row GEMV's deep ring on every
#          1B/8B projection (streamed_kernels.py --deep): under 1 min on a warm H100, where deeper pipelines gained
#          4-12 % on the small projections and nothing on gate|up (2026-12-05); an H200 has not run it
#   mlp-auto-ab  the 1B/8B graph-replay A/B of the default (ASYNCSPEC_STREAMED_MLP=auto: the 1B's MLP in the
#          split-deep form, the 8B's chain) against ASYNCSPEC_STREAMED_MLP=0, two rounds: ~3 min (split-deep's 1B step
#          was 0.8 % faster on an H100 in one round, 1.7-2.0 % on an H200 in two; the 8B's 3.2 % slower, 2026-12-05)
#   goals  issue 8's three numbers in one call, for an H200 (the card they are set on): graph_replay.py --context 315
#          on the 1B and 8B (the batch-1 step over its roofline; goals 1.3x and 1.1x), then streams32 twice (goal
#          0.6 of the roofline, about 1.12 ms a step on an H200): ~6 min on a cold machine
#   early-trigger  small captured launches letting their successor launch before their own wait (the default from
#          2026-12-06, ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS=8): its GPU test (tests/kernels/test_pdl.py, not yet run), then
#          graph_replay.py --context 315 with it off (=0) and on, the 1B twice and the 8B once, and once up to 32
#          rows with the attention waiting first (taken everywhere, 32 rows lost 1.5 %, the attention alone 5 %):
#          ~6 min (H100: the 1B step 1.055 -> 0.995 ms, the 8B's 5.316 -> 5.282; an H200 has not measured it)
#   streamed-315  the streamed o projection and attention input, and the fused combine, against the o projection's own
#          kernel (ASYNCSPEC_STREAMED_O_PROJ=0), again now that small graphs trigger first (a successor can stream
#          its weights through the whole attention, not only its combine): graph_replay.py --context 315, the 1B
#          twice, the 8B once: ~6 min cold (H100, 2026-12-06: the o projection 0.8 % faster on the 1B, 3.6 % slower
#          on the 8B; the attention input and the fused combine slower on both)
#   o-proj-auto  the o projection's auto (from 2026-12-06: streamed where a program's share fits its ring, the 1B's
#          and not the 8B's) against ASYNCSPEC_STREAMED_O_PROJ=0 at 315 keys (the 1B twice, the 8B once): ~4 min cold
#          (the 1B step 1.005-1.010 -> 0.998-1.000 ms on an H100, 2026-12-06)
#   o-proj-tests  auto's own engine test (tests/engine/test_gpu_streamed_o_proj.py) and the one
#          other GPU engine test whose model auto now streams (test_step_timing.py, the 1B shape; the tiny models of
#          the others are 128 columns wide, the bundled target's 384, the long-context test's o projection too large).
#          The streamed GEMV's kernel tests, the streamed MLP's and down projection's engine tests and
#          test_gpu_graphs_hf.py passed on an H100 with it (2026-12-06); this part's tests too, once an engine restarted
#          in one process no longer ran out of memory (session 39, tests/worker/test_gpu_memory.py): ~3 min cold
#   rows-limit  the early trigger's row limit between 8 and 32 (ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS 8, 16, 24): the 1B's
#          graphs of 8 to 32 rows at 315 keys (graph_replay.py --batches), two rounds: ~2.5 min cold
#   rows16  why triggering first lost 8 % at 16 rows (2026-12-06, H100): one 1B step of 16 streams kernel by kernel in
#          launch order (profile_step.py --sequence, PDL on) with the row limit at 8 (16 rows wait first) and at 16
#          (they trigger first): ~2 min
#   sequence-b1  one 1B batch-1 step kernel by kernel in launch order (profile_step.py --sequence, PDL on) with the
#          defaults of 2026-12-06 (trigger-first, the o projection streamed) and with ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS=0:
#          before the early trigger (session 37's profile) the MLP half ran at its bytes and a layer's whole excess,
#          about 10 us, lay between the norm and the MLP (norm, q|k|v, attention, combine, o); with the early trigger
#          (session 39, H100) the attention's own link, 6.6 us after q|k|v's end, is the longest of them: ~2 min
#   prefix-sharing  a burst of 64 prompts with one 1024-token prefix, the engine waiting for the prefix's blocks
#          (prefix_sharing_wait_tokens=256, the default from 2026-12-06) against one that computes it for each
#          (benchmarks/prefix_sharing.py): wall, TTFT, prompt tokens computed: ~2 min
#   streams32  the 1B decode at 32 streams against its roofline (gpu_step_speed.py, bandwidth and async, one
#          steady window of 32): issue 8's 0.6 goal, last 0.54 on an H200 (2026-12-03), 0.63 on an H100: ~2 min
#   early-kv  the attention's step inputs and older keys read before the PDL wait (ASYNCSPEC_ATTN_EARLY_KV=1, of
#          2026-12-05): its kernel GPU tests (one races a predecessor that writes the new keys late) and engine
#          tests, ~4 min on a cold machine
#   early-kv-ab  its A/B at a real context: graph_replay.py --context 315 (the 1B twice, the 8B once; as captured
#          the graphs hold a context of one key), then the 1B's 32-stream steady window with and without: ~5 min
#          against the default, and both wait-first (ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS=0). Since session 40 early KV keeps
#          the early trigger: on an H100 it made batch 1 2 % slower and batch 2 1.4 % faster (session 39's 7.5 % was
#          mostly the trigger's own gain, which early KV then turned off)
#   ab-315  one call for the open A/Bs at a real context (graph_replay.py --context 315): the 1B with the default,
#          ASYNCSPEC_ATTN_EARLY_KV=1 and ASYNCSPEC_STREAMED_MLP=0, two rounds; the 8B with the default and early KV;
#          then the 1B's 32-stream steady window (streams32): ~8 min on a cold machine
#   positions32  the 1B's 32-stream step with PDL off, each projection's time by its place in the step (profile_step.py
#          --by-position), to set beside its microbenchmark (skinny_linear.py): ~1.5 min
#   profile32  where the 1B's 32-stream step goes, kernel by kernel (profile_step.py --streams 32), PDL off so that
#          each kernel's time is its own, then on: ~2 min
#   attn32  where the 32-stream attention's time goes (attention_splits.py, the 1B and 8B heads at 32 requests): its
#          fixed cost (16 and 64 keys), its read rate (the slope up to 2,000 keys), one to four splits, the pool's blocks
#          shuffled and in request order; then the 1B's heads at 256 keys a step (attention_tiles.py). The 1B's split
#          pass read 20.6 MB at 1.78 TB/s on an H200 (2026-12-06), 1.35 TB/s in an H100's PDL-off profile: ~3 min
#   attn-deep  the decode tiles' KV walk pipelined 2 to 7 stages deep: attention_tiles.py on the 1B and 8B heads,
#          1/32/128 requests, contexts spread like the prompts' (--spread 0.6), the shipped split count and one pass:
#          ~1 min warm. Triton 3.6 asks for the walk's K/V two steps ahead only from 5 stages (kernel_pipelining.py);
#          on an H100 (2026-12-06) 5 and 7 stages were slower than 2 in nearly every case (1B 32 x 315: 17.5 / 19.6
#          against 13.2 us at 128 keys a step), and 128 keys a step at 32 requests won (0.95x / 0.89x at 315 / 1,000)
#   attn-ab  a packed pair (`benchmarks/ab_commits.sh pack BASE NEW`, carry .devdata) in the engine: the 1B's
#          32-stream window twice, then graph_replay.py --context 315 on the 1B and 8B once: ~5 min (128 keys a step
#          from 32 requests: 1.424 / 1.426 -> 1.407 / 1.401 ms a step, H100 2026-12-06)
#   attn-tests  the attention's GPU kernel tests, the no-recompile and warm-up tests: ~3 min cold
#   bounds315  what the norm kernels and the split-KV combine still cost at a real context (graph_replay.py --context
#          315, two rounds): the fold off with the timing-only no_norm patch (no norm kernel at all, the fold's bound),
#          and no_combine on the default: ~3 min
#   fold   the norms folded into the projections (on by default from 4 rows since 2026-12-06): its compiled kernel
#          tests and engine tests, then the 1B's graphed steps at 315 keys with the fold off (ASYNCSPEC_NORM_FOLD=0),
#          the default, the fold from one row (ASYNCSPEC_NORM_FOLD_MIN_ROWS=1) and the no_norm bound, two rounds, and
#          the 8B's with and without: ~4 min (H200 2026-12-06: 1B b8 -6.9 %, b32 -4.0 %; b2 +7.6 % from one row)
#   fold-window  the 1B's 32-stream steady window without and with the fold, alternated twice, then where the folded
#          step's time goes with PDL off (profile_step.py --streams 32): ~2 min
#   mlp-norm-fold  the next layer's input norm folded into the streamed MLP's down projection at batch 1
#          (ASYNCSPEC_STREAMED_MLP_NORM_FOLD, on by default since its first run, an H100 on 2026-12-07: 63 tests
#          passed, 0.4 % off the batch-1 forward): the streamed GEMV's kernel and engine GPU tests,
#          then the 1B's graphed steps at 315 keys with it (the default) and without (=0), two rounds, and one
#          batch-1 step with it kernel by kernel: ~9 min cold
#   wide-rows  the skinny kernel past 32 rows (ASYNCSPEC_SKINNY_MAX_ROWS, 256 by default from 2026-12-07, session
#          52, for weights of at most 6 MiB): its kernel GPU tests at 160 rows, the speculative engine's fp32 greedy
#          equality and bf16 tests, the plain engine's batch of 48 against 32 rows (session 52's test), then the
#          closed batch of 32 with 32 rows (the old default) and the default, alternated twice (plan_trace.py): ~8 min;
#          it took the full-batch k = 4 steps from 19.3 to 17.8 ms a run of 32 on an H100 (one process each); its
#          tests passed there (2026-12-07, session 51)
#   wide-rows-1b  the wide rows where they are not measured yet (graph_replay.py, twice each): the bundled target's
#          plain decode graphs at 64 and 128 streams, 32 rows against the default (every weight under 6 MiB takes
#          the kernel there since session 52); a Llama-1B at 32, 64 and 128 with 32 rows, the default (its weights are
#          all over 6 MiB: cuBLAS past 32 rows, as with 32) and ASYNCSPEC_SKINNY_WIDE_MAX_MIB=16 (its q|k|v and o, 12
#          and 8 MiB, take the kernel): ~4 min. Measured on an H100 (2026-12-07, session 52): the bundled target's
#          64/128 forwards 24-26 % and 20-22 % faster; the 1B's 2 % and 8 % slower at 16 MiB (the limit stays at 6)
#   wide-rows-640  the skinny kernel up to 1024 rows (its limit since session 52; the layers' default stays 256): its
#          GPU kernel tests at 640 rows, then the closed batch of 128 with ASYNCSPEC_SKINNY_MAX_ROWS=1024 against the
#          default, alternated twice (plan_trace.py): ~6 min. At 1024 the draft engine's k = 4 verification of 128
#          requests (640 rows) and its catch-up (768) take the kernel; the plain engine's graphs (128 rows) do not
#          change. Session 52 found speculation 8 % behind in that closed batch, its k = 4 plans bound by the device;
#          session 53 (one round, a slow H100 host) found no gain at 1024 (the full-batch k = 4 step 1.28 against 1.29 ms)
#   greedy-accept  the rest of the greedy verification kernel's GPU tests: the multi-step speculative plans against
#          the plain engine (session 50 ran the kernel's and the fp32 greedy equality, session 51 the no-host-sync and
#          bf16 ties tests and the k = 0 multi-step plans, session 52 these four: all passed): ~3 min cold
#   gc-freeze  the engine's start-up objects frozen out of Python's full collections (EngineConfig.freeze_gc, on by
#          default from 2026-12-07; its GPU test passed in session 52): the closed batch of 32 with and without (plan_trace.py
#          --no-freeze-gc; each side its own process), alternated twice, each trial's collector pauses printed:
#          ~4 min. Without it one H100 trial of the draft engine took 46.9 ms instead of 34, a 13.9 ms collection in it;
#          with it no pause over 0.23 ms (2026-12-07, session 52)
#   host-profile  where the prompt plans' host time goes, plain and draft engines: first unprofiled, each phase
#          timed by plan kind (sustained_host_phases.py --streams 32 --factor 1: the closed batch of 32), then
#          plan_trace.py --host-profile prefill (cProfile in those plans only, with callee shares): ~3 min
#   with-prompts  where a prompt plan that verifies drafts spends its host time (sustained_host_phases.py
#          --with-prompts: 512 requests through 128 streams, the plain engine, the draft engine and one with
#          speculate_with_prompts; session 53 measured its prompt plans at 7.1 ms against the default's 4.6 on an H100),
#          then the plain and draft engines at 128 streams held full over five trials (session 52: 0.98, session 53:
#          1.07 on a slower host; the trials spread 10-25 %): ~8 min cold
#   sampling-only  a mixed plan's decodes verified greedily over the sampling requests alone (session 54, where
#          they took the full sampler's eager verification): its GPU tests, then the with-prompts host phases
#          (sustained_host_phases.py --with-prompts; session 53: 7.1 ms a prompt plan against 4.6): ~6 min cold
# REQUIRE_GPU=H200 (any part of the card's name) runs nothing and exits 3 on another card: a request for an H200
# that an H100 answers then costs only the machine's start (issue 8's goals are set on an H200).
# PARTS="tests" runs a subset. `serve` needs grpcio-health-checking and grpcio-reflection on the device (carry
# their wheels; the device README says how).
set -uo pipefail
out=${OUT:-/tmp/pending}
mkdir -p "$out"
parts=${PARTS:-tests}
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "GPU: ${gpu_name:-none}"
if [ -n "${REQUIRE_GPU:-}" ] && [[ "$gpu_name" != *"$REQUIRE_GPU"* ]]; then
    echo "not the card asked for (REQUIRE_GPU=$REQUIRE_GPU): nothing run"
    exit 3
fi
[ -e asyncspec/kernels ] || ln -s ../kernels asyncspec/kernels

# Each test's outcome goes to $out/pytest_$1.log as it runs, so a call that runs out still says what passed.
gpu_tests() {
    local name=$1
    shift
    timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -v -p no:cacheprovider -m gpu "$@" \
        --deselect tests/worker/test_tensor_parallel_gpu.py --deselect tests/worker/test_symm_all_reduce_gpu.py 2>&1 |
        tee "$out/pytest_$name.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
}
# The 1B's graphed steps at 315 keys of context: PDL on, then each variant ("SWITCH" or "A+B") on top of it, the
# round twice in one call; $1 names the JSON.
replay_1b_315_twice() {
    local name=$1 p="ASYNCSPEC_PDL=1" variant
    shift
    local round=$p
    for variant in "$@"; do round="$round,$p+$variant"; done
    timeout 240 python3 benchmarks/graph_replay.py --models llama-1b --context 315 --switches "$round,$round" \
        --output "$out/graph_replay_${name}_1b.json" 2>&1 | tail -8
}
# An A/B at 315 keys of context: the 1B's switches, then the 8B's, each model in one graph_replay.py call; $1 names
# the JSONs (graph_replay_$1_{1b,8b}.json).
replay_315_1b_8b() {
    local name=$1 switches_1b=$2 switches_8b=$3
    timeout 330 python3 benchmarks/graph_replay.py --models llama-1b --context 315 --switches "$switches_1b" \
        --output "$out/graph_replay_${name}_1b.json" 2>&1 | tail -11
    timeout 200 python3 benchmarks/graph_replay.py --models llama-8b --context 315 --switches "$switches_8b" \
        --output "$out/graph_replay_${name}_8b.json" 2>&1 | tail -5
}
# One 1B step of $1 streams kernel by kernel in launch order (profile_step.py --sequence, PDL on), once for each
# early-trigger row limit given after the file tag $2: profile_1b_$2_rows<limit>.txt.
sequence_by_rows() {
    local streams=$1 tag=$2 rows
    shift 2
    for rows in "$@"; do
        ASYNCSPEC_PDL=1 ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS=$rows timeout 150 python3 benchmarks/profile_step.py \
            --model llama-1b --streams "$streams" --top 10 --sequence 30 > "$out/profile_1b_${tag}_rows$rows.txt" 2>&1
        grep -A44 "^GPU time per step" "$out/profile_1b_${tag}_rows$rows.txt" | head -48
    done
}
if [[ " $parts " == *" tests "* ]]; then
    gpu_tests all tests/worker tests/layers tests/kernels tests/spec tests/engine tests/models
fi
if [[ " $parts " == *" tests-a "* ]]; then
    gpu_tests a tests/worker tests/layers tests/kernels
fi
streamed_engine_tests=(tests/engine/test_gpu_streamed_*.py)
if [[ " $parts " == *" tests-b "* ]]; then
    gpu_tests b tests/spec tests/engine tests/models "${streamed_engine_tests[@]/#/--ignore=}"
fi
if [[ " $parts " == *" tests-b1 "* ]]; then  # tests-b's engine half
    gpu_tests b1 tests/engine "${streamed_engine_tests[@]/#/--ignore=}"
fi
if [[ " $parts " == *" tests-b1a "* ]]; then
    gpu_tests b1a tests/engine/test_gpu_early_kv.py tests/engine/test_gpu_engine.py tests/engine/test_gpu_fused_combine.py
fi
if [[ " $parts " == *" tests-b1b "* ]]; then
    gpu_tests b1b tests/engine/test_gpu_graphs_hf.py tests/engine/test_gpu_norm_fold.py tests/engine/test_penalties.py \
        tests/engine/test_step_timing.py tests/engine/test_warm_up.py
fi
if [[ " $parts " == *" tests-b2 "* ]]; then  # tests-b's spec and model half, with the rotary epilogue's GPU twin
    gpu_tests b2 tests/spec tests/models tests/layers/test_linear.py
fi
if [[ " $parts " == *" tests-c "* ]]; then
    gpu_tests c tests/engine/test_gpu_streamed_mlp.py
fi
if [[ " $parts " == *" tests-d "* ]]; then
    gpu_tests d tests/engine/test_gpu_streamed_down_proj.py
fi
if [[ " $parts " == *" tp "* ]]; then
    timeout 560 python3 -m pytest -q -p no:cacheprovider tests/worker/test_symm_all_reduce_gpu.py \
        tests/worker/test_tensor_parallel_gpu.py 2>&1 | tail -15
fi

if [[ " $parts " == *" epilogues "* ]]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_skinny_linear_rotary.py \
        tests/kernels/test_skinny_linear.py -k "rotary or gpu_gated" 2>&1 | tail -4
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/layers/test_linear.py tests/engine/test_gpu_engine.py \
        tests/worker/test_cuda_graphs.py -k "rotary or bf16 or no_host_sync or async_loop_equals" 2>&1 | tail -6
    timeout 150 python3 benchmarks/graph_replay.py --models llama-1b,llama-8b \
        --switches "ASYNCSPEC_PDL=1+ASYNCSPEC_ROTARY_IN_LINEAR=0,ASYNCSPEC_PDL=1" --output "$out/graph_replay_rotary.json" \
        2>&1 | tail -6
fi

if [[ " $parts " == *" streamed "* ]]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_streamed_mlp.py \
        tests/kernels/test_streamed_gemv.py tests/kernels/test_streamed_attn_in.py --tb=line 2>&1 | tail -12
    # A cold machine compiles every kernel first: about 160 s on an H100 (2026-12-05).
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_streamed_mlp.py 2>&1 | tail -6
fi
if [[ " $parts " == *" streamed-ab "* ]]; then
    # The base keeps the o projection's own kernel: its auto (the default since 2026-12-06) streams the 1B's.
    b="ASYNCSPEC_PDL=1+ASYNCSPEC_STREAMED_O_PROJ=0"
    on="$b+ASYNCSPEC_STREAMED_MLP"
    o="ASYNCSPEC_PDL=1+ASYNCSPEC_STREAMED_O_PROJ=1"
    a="$b+ASYNCSPEC_STREAMED_ATTN_IN=1"
    timeout 200 python3 benchmarks/graph_replay.py --models llama-1b --switches \
        "$b,$on=barrier,$o,$a,$on=split,$b" \
        --output "$out/graph_replay_streamed_1b.json" 2>&1 | tail -9
    timeout 200 python3 benchmarks/graph_replay.py --models llama-8b --switches \
        "$b,$on=barrier,$o,$a,$b" \
        --output "$out/graph_replay_streamed_8b.json" 2>&1 | tail -7
    # Each kernel alone against the chain's: where the streams lose (2026-12-05: 8B steps slower on an H100).
    timeout 150 python3 benchmarks/streamed_kernels.py --output "$out/streamed_kernels.json" 2>&1 | tail -20
fi

if [[ " $parts " == *" fused-combine "* ]]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_split_kv_attention.py \
        tests/engine/test_gpu_fused_combine.py 2>&1 | tail -6
    timeout 200 python3 benchmarks/graph_replay.py --models llama-1b,llama-8b --switches \
        "ASYNCSPEC_PDL=1,ASYNCSPEC_PDL=1+ASYNCSPEC_ATTN_FUSED_COMBINE=1,ASYNCSPEC_PDL=1" \
        --output "$out/graph_replay_fused_combine.json" 2>&1 | tail -8
fi

if [[ " $parts " == *" down-proj "* ]]; then
    # A cold machine compiles every kernel first (the streamed engine tests took 196 s on an H100, 2026-12-05).
    timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_streamed_down_proj.py \
        tests/kernels/test_streamed_gemv.py --tb=short 2>&1 | tail -8
fi
if [[ " $parts " == *" down-proj-ab "* ]]; then
    p="ASYNCSPEC_PDL=1"
    off="ASYNCSPEC_STREAMED_DOWN_PROJ=0"
    # auto: the 1B's down projection streamed, the bundled target's (24 tiles) not; the streamed MLP, whose own
    # auto would take the 1B's whole half, off.
    p="$p+ASYNCSPEC_STREAMED_MLP=0"
    timeout 300 python3 benchmarks/graph_replay.py --models bundled,llama-1b \
        --switches "$p+$off,$p,$p+$off,$p" --output "$out/graph_replay_down_proj.json" 2>&1 | tail -9
fi

if [[ " $parts " == *" deep-tiles "* ]]; then
    timeout 420 python3 benchmarks/skinny_linear.py --sweep --focus deep --ms 16,32 --models 1B,8B \
        --layers qkv,o,gate_up,down --budget-s 360 --output "$out/skinny_deep.json" 2>&1 | tail -20
    # The one-row side: the streamed GEMV's deep ring on every projection's shape against skinny_linear.
    timeout 100 python3 benchmarks/streamed_kernels.py --deep --output "$out/streamed_deep.json" 2>&1 | tail -18
fi

if [[ " $parts " == *" mlp-auto-ab "* ]]; then
    p="ASYNCSPEC_PDL=1"
    m="ASYNCSPEC_STREAMED_MLP=0"
    timeout 100 python3 benchmarks/graph_replay.py --models llama-1b --switches "$p+$m,$p,$p+$m,$p" \
        --output "$out/graph_replay_mlp_auto_1b.json" 2>&1 | tail -5
    timeout 240 python3 benchmarks/graph_replay.py --models llama-8b --switches "$p+$m,$p" \
        --output "$out/graph_replay_mlp_auto_8b.json" 2>&1 | tail -3
fi

if [[ " $parts " == *" prefix-sharing "* ]]; then
    timeout 240 python3 benchmarks/prefix_sharing.py --output "$out/prefix_sharing.json" 2>&1 | tail -4
fi
if [[ " $parts " == *" goals "* ]]; then
    timeout 240 python3 benchmarks/graph_replay.py --models llama-1b,llama-8b --context 315 --switches ASYNCSPEC_PDL=1 \
        --output "$out/graph_replay_goals.json" 2>&1 | tail -4
    for round in 1 2; do
        timeout 150 python3 benchmarks/gpu_step_speed.py --models llama-1b --parts bandwidth,async --concurrency 32 \
            --window-batches 32 --sweep-batches 32 --trials 1 --output "$out/step_speed_1b_32_r$round.json" 2>&1 |
            grep -E "^async" | tail -2
    done
fi
if [[ " $parts " == *" mlp-norm-fold "* ]]; then
    # Whole files: the plain streamed GEMV's launch changed too (its new operands, unused without the fold).
    gpu_tests mlp_norm_fold tests/kernels/test_streamed_gemv.py tests/engine/test_gpu_streamed_mlp.py \
        tests/engine/test_gpu_streamed_down_proj.py tests/engine/test_gpu_streamed_o_proj.py
    replay_1b_315_twice mlp_norm_fold ASYNCSPEC_STREAMED_MLP_NORM_FOLD=0
    sequence_by_rows 1 b1_mlp_norm_fold 8
fi
if [[ " $parts " == *" wide-rows "* ]]; then
    TESTS_TIMEOUT=300 gpu_tests wide_rows_kernels tests/kernels/test_skinny_linear.py tests/kernels/test_skinny_linear_fold.py \
        tests/kernels/test_skinny_linear_rotary.py -k "160 or supported"
    TESTS_TIMEOUT=300 gpu_tests wide_rows_spec tests/layers/test_linear.py tests/spec/test_spec_decode_gpu.py \
        -k "wide_rows or greedy_speculative_equals or ties or bf16_speculative_runs"
    for round in 1 2; do
        for rows in 32 256; do
            ASYNCSPEC_SKINNY_MAX_ROWS=$rows timeout 110 taskset -c 2,3 python3 benchmarks/plan_trace.py --streams 32 \
                --trials 3 --output "$out/plan_trace_wide_rows_${rows}_r$round.json" 2>&1 | grep -E "^(plain|draft)"
        done
    done
fi
if [[ " $parts " == *" wide-rows-1b "* ]]; then
    p=ASYNCSPEC_PDL=1
    timeout 150 python3 benchmarks/graph_replay.py --models bundled --context 315 --batches 32,64,128 --rounds 2 \
        --switches "$p+ASYNCSPEC_SKINNY_MAX_ROWS=32,$p" \
        --output "$out/graph_replay_wide_rows_bundled.json" 2>&1 | tail -6
    timeout 300 python3 benchmarks/graph_replay.py --models llama-1b --context 315 --batches 32,64,128 --rounds 2 \
        --switches "$p+ASYNCSPEC_SKINNY_MAX_ROWS=32,$p,$p+ASYNCSPEC_SKINNY_WIDE_MAX_MIB=16" \
        --output "$out/graph_replay_wide_rows_1b.json" 2>&1 | tail -8
fi
if [[ " $parts " == *" wide-rows-640 "* ]]; then
    TESTS_TIMEOUT=240 gpu_tests wide_rows_640 tests/kernels/test_skinny_linear.py \
        tests/kernels/test_skinny_linear_fold.py tests/kernels/test_skinny_linear_rotary.py -k "640"
    for round in 1 2; do
        for rows in 256 1024; do
            ASYNCSPEC_SKINNY_MAX_ROWS=$rows timeout 100 taskset -c 2,3 python3 benchmarks/plan_trace.py --streams 128 \
                --trials 3 --output "$out/plan_trace_closed128_rows${rows}_r$round.json" 2>&1 |
                grep -E "^(plain|draft)|prefill|full"
        done
    done
fi
if [[ " $parts " == *" greedy-accept "* ]]; then
    gpu_tests greedy_accept tests/spec/test_spec_decode_gpu.py tests/worker/test_multi_step_spec_gpu.py \
        -k "speculative_plans"
fi
if [[ " $parts " == *" gc-freeze "* ]]; then
    for round in 1 2; do
        for side in freeze no-freeze; do
            flag=$([ $side = no-freeze ] && echo --no-freeze-gc)
            timeout 110 taskset -c 2,3 python3 benchmarks/plan_trace.py --streams 32 --trials 4 $flag \
                --output "$out/plan_trace_gc_${side}_r$round.json" 2>&1 | grep -E "^(plain|draft)|gc pauses|prefill"
        done
    done
fi
if [[ " $parts " == *" host-profile "* ]]; then
    timeout 120 taskset -c 2,3 python3 benchmarks/sustained_host_phases.py --streams 32 --factor 1 --trials 3 \
        --output "$out/host_phases_closed32.json" 2>&1 | grep -vE "^ +[0-9.]+ +[0-9]+ +[0-9.]+ " | tail -40
    timeout 150 taskset -c 2,3 python3 benchmarks/plan_trace.py --streams 32 --trials 3 --host-profile prefill \
        --top 30 --output "$out/plan_trace_host_profile.json" 2>&1 | grep -vE "queued ms" | tail -75
fi
if [[ " $parts " == *" sampling-only "* ]]; then
    TESTS_TIMEOUT=240 gpu_tests sampling_only tests/spec/test_greedy_verify.py tests/spec/test_spec_decode_gpu.py \
        -k "sampling_only or beside_prompts"
    timeout 330 taskset -c 2,3 python3 benchmarks/sustained_host_phases.py --with-prompts --no-cprofile --trials 2 \
        --output "$out/host_phases_sampling_only.json" 2>&1 | grep -E "^(walls|==)|^  prompt|totals" | tail -40
fi
if [[ " $parts " == *" with-prompts "* ]]; then
    timeout 330 taskset -c 2,3 python3 benchmarks/sustained_host_phases.py --with-prompts --no-cprofile --trials 2 \
        --output "$out/host_phases_with_prompts.json" 2>&1 | grep -E "^(walls|==)|^  prompt|totals" | tail -40
    timeout 200 taskset -c 2,3 python3 benchmarks/plan_trace.py --streams 128 --trials 5 --sustained 4 \
        --output "$out/plan_trace_sustained128_t5.json" 2>&1 | grep -E "^(plain|draft)|prefill|full"
fi
if [[ " $parts " == *" early-trigger "* ]]; then
    gpu_tests early_trigger tests/kernels/test_pdl.py
    p=ASYNCSPEC_PDL=1
    o="$p+ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS=0"
    w="$p+ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS=32+GRAPH_REPLAY_PATCH=attention_wait_first"
    replay_315_1b_8b early_trigger "$o,$p,$w,$o,$p,$w" "$o,$p"
fi
if [[ " $parts " == *" streamed-315 "* ]]; then
    # The base keeps the o projection's own kernel: its auto (the default since 2026-12-06) streams the 1B's.
    p=ASYNCSPEC_PDL=1+ASYNCSPEC_STREAMED_O_PROJ=0
    o="ASYNCSPEC_PDL=1+ASYNCSPEC_STREAMED_O_PROJ=1"
    a="$p+ASYNCSPEC_STREAMED_ATTN_IN=1"
    f="$p+ASYNCSPEC_ATTN_FUSED_COMBINE=1"
    replay_315_1b_8b streamed_315 "$p,$o,$a,$o+ASYNCSPEC_STREAMED_ATTN_IN=1,$f,$p,$o,$a,$o+ASYNCSPEC_STREAMED_ATTN_IN=1,$f" "$p,$o,$a,$f"
fi
if [[ " $parts " == *" o-proj-auto "* ]]; then
    p=ASYNCSPEC_PDL=1
    z="$p+ASYNCSPEC_STREAMED_O_PROJ=0"
    replay_315_1b_8b o_proj_auto "$z,$p,$z,$p" "$z,$p"
fi
if [[ " $parts " == *" o-proj-tests "* ]]; then
    gpu_tests o_proj_tests tests/engine/test_gpu_streamed_o_proj.py tests/engine/test_step_timing.py
fi
if [[ " $parts " == *" rows-limit "* ]]; then
    r="ASYNCSPEC_PDL=1+ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS"
    timeout 200 python3 benchmarks/graph_replay.py --models llama-1b --context 315 --batches 8,16,24,32 \
        --rounds 2 --switches "$r=8,$r=16,$r=24" --output "$out/graph_replay_rows_limit_1b.json" 2>&1 | tail -7
fi
if [[ " $parts " == *" rows16 "* ]]; then
    sequence_by_rows 16 b16 8 16
fi
if [[ " $parts " == *" sequence-b1 "* ]]; then
    sequence_by_rows 1 b1 8 0
fi
if [[ " $parts " == *" streams32 "* ]]; then
    timeout 240 python3 benchmarks/gpu_step_speed.py --models llama-1b --parts bandwidth,async --concurrency 32 \
        --window-batches 32 --sweep-batches 32 --trials 1 --output "$out/step_speed_1b_32.json" 2>&1 | tail -12
fi

if [[ " $parts " == *" early-kv "* ]]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_split_kv_attention.py \
        -k "gpu_early or compile" --tb=short 2>&1 | tail -6
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_early_kv.py --tb=short \
        2>&1 | tail -6
fi
if [[ " $parts " == *" early-kv-ab "* ]]; then
    p="ASYNCSPEC_PDL=1"
    e="ASYNCSPEC_ATTN_EARLY_KV=1"
    # Against the default ($p), and both wait-first ($w): early KV with the trigger first and without it.
    w="$p+ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS=0"
    # Every request at a context of 315 keys, as gpu_step_speed.py's prompts give (the graphs as captured hold one).
    replay_315_1b_8b early_kv "$p,$p+$e,$w,$w+$e,$p,$p+$e,$w,$w+$e" "$p,$p+$e"
    for early in 0 1; do
        ASYNCSPEC_ATTN_EARLY_KV=$early timeout 100 python3 benchmarks/gpu_step_speed.py --models llama-1b \
            --parts bandwidth,async --concurrency 32 --window-batches 32 --sweep-batches 32 --trials 1 \
            --output "$out/step_speed_early_kv${early}_1b_32.json" 2>&1 | grep -E "^async|^config" | tail -2
    done
fi

if [[ " $parts " == *" ab-315 "* ]]; then
    p="ASYNCSPEC_PDL=1"
    e="ASYNCSPEC_ATTN_EARLY_KV=1"
    replay_1b_315_twice ab315 "$e" ASYNCSPEC_STREAMED_MLP=0
    timeout 200 python3 benchmarks/graph_replay.py --models llama-8b --context 315 --switches "$p,$p+$e" \
        --output "$out/graph_replay_ab315_8b.json" 2>&1 | tail -4
    timeout 120 python3 benchmarks/gpu_step_speed.py --models llama-1b --parts bandwidth,async --concurrency 32 \
        --window-batches 32 --sweep-batches 32 --trials 1 --output "$out/step_speed_1b_32.json" 2>&1 | tail -6
fi

if [[ " $parts " == *" positions32 "* ]]; then
    ASYNCSPEC_PDL=0 timeout 150 python3 benchmarks/profile_step.py --model llama-1b --streams 32 --top 8 \
        --by-position _skinny_linear_kernel 2>&1 | sed -n '/^GPU time per step/,$p' | tee "$out/positions_1b_32_pdl0.txt"
fi
if [[ " $parts " == *" profile32 "* ]]; then
    for pdl in 0 1; do
        ASYNCSPEC_PDL=$pdl timeout 150 python3 benchmarks/profile_step.py --model llama-1b --streams 32 --top 14 \
            2>&1 | grep -A16 "^GPU time per step" | tee "$out/profile_1b_32_pdl$pdl.txt"
    done
fi

if [[ " $parts " == *" attn32 "* ]]; then
    timeout 240 python3 benchmarks/attention_splits.py --shapes llama-1b,llama-8b --batches 32 \
        --contexts 16,64,315,1000,2000 --splits 1,2,4 --block-order random,sorted --output "$out/attention_32.json" \
        2>&1 | tail -22
    # Fewer, longer key steps: 256 keys a step (one or two steps a split at 315 keys), 4 or 8 warps, against the
    # shipped 128 (the H200 walked 315 keys at 1.78 TB/s, 2026-12-06), with 1 to 3 splits.
    timeout 150 python3 benchmarks/attention_tiles.py --shapes llama-1b --batches 32 --contexts 315,1000 \
        --block-n 128,256 --warps 4,8 --stages 2,3 --splits auto,1,2,3 --output "$out/attention_tiles_32.json" \
        2>&1 | tail -6
fi

if [[ " $parts " == *" attn-deep "* ]]; then
    timeout 300 python3 benchmarks/attention_tiles.py --shapes llama-1b,llama-8b --batches 1,32,128 \
        --contexts 315,1000 --spread 0.6 --block-n 64,128 --warps 4 --stages 2,3,5,7 --splits auto,1 \
        --output "$out/attention_tiles_deep.json" 2>&1 | tail -14
fi
if [[ " $parts " == *" attn-ab "* ]]; then
    OUT=$out timeout 300 bash .devdata/ab_commits.sh run 2 -- python3 benchmarks/gpu_step_speed.py --models llama-1b \
        --parts bandwidth,async --concurrency 32 --window-batches 32 --sweep-batches 32 --trials 1 \
        --output '$AB_OUT/window_1b_32.json' 2>&1 | grep -E "^===|^async" | tail -8
    OUT=$out timeout 280 bash .devdata/ab_commits.sh run 1 -- python3 benchmarks/graph_replay.py \
        --models llama-1b,llama-8b --context 315 --switches ASYNCSPEC_PDL=1 --output '$AB_OUT/replay_315.json' 2>&1 |
        grep -vE "^\s*$" | tail -12
fi
if [[ " $parts " == *" attn-tests "* ]]; then
    gpu_tests attn tests/kernels/test_split_kv_attention.py tests/kernels/test_no_recompile.py \
        tests/engine/test_warm_up.py
fi
if [[ " $parts " == *" bounds315 "* ]]; then
    replay_1b_315_twice bounds315 ASYNCSPEC_NORM_FOLD=0+GRAPH_REPLAY_PATCH=no_norm GRAPH_REPLAY_PATCH=no_combine
fi

if [[ " $parts " == *" fold "* ]]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_skinny_linear_fold.py \
        tests/engine/test_gpu_norm_fold.py --tb=short 2>&1 | tail -8
    off=ASYNCSPEC_NORM_FOLD=0
    replay_1b_315_twice fold "$off" ASYNCSPEC_NORM_FOLD_MIN_ROWS=1 "$off+GRAPH_REPLAY_PATCH=no_norm"
    timeout 200 python3 benchmarks/graph_replay.py --models llama-8b --context 315 \
        --switches "ASYNCSPEC_PDL=1+$off,ASYNCSPEC_PDL=1" --output "$out/graph_replay_fold_8b.json" 2>&1 | tail -4
fi
if [[ " $parts " == *" fold-window "* ]]; then
    for run in 0:1 1:1 0:2 1:2; do  # fold:round
        ASYNCSPEC_NORM_FOLD=${run%:*} timeout 90 python3 benchmarks/gpu_step_speed.py --models llama-1b \
            --parts bandwidth,async --concurrency 32 --window-batches 32 --sweep-batches 32 --trials 1 \
            --output "$out/step_speed_fold${run%:*}_round${run#*:}_1b_32.json" 2>&1 | grep -E "^async" | tail -1
    done
    python3 - "$out" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/step_speed_fold*_1b_32.json")):
    model = json.load(open(path))["models"]["llama-1b"]
    window = model["rows"]["async"]["windows"]["32"]
    fraction = model["summary"]["configs"]["async"]["fraction_of_roofline_ref"]
    print(f"{path.rsplit('/', 1)[-1]}: {window['wall_ms_per_step']:.4f} ms a step, {fraction:.3f} of the roofline")
PY
    ASYNCSPEC_PDL=0 ASYNCSPEC_NORM_FOLD=1 timeout 90 python3 benchmarks/profile_step.py --model llama-1b --streams 32 \
        --top 10 2>&1 | grep -A12 "^GPU time per step" | tee "$out/profile_fold_1b_32_pdl0.txt"
fi

if [[ " $parts " == *" step "* ]]; then
    OUT=$out bash .devdata/ab_commits.sh run 2 -- python3 benchmarks/gpu_step_speed.py --models bundled \
        --parts graphed,async,graphed-draft,async-draft --concurrency 1,32,128 --window-batches 1 \
        --sweep-batches 1 --trials 3 --output '$AB_OUT/step.json'
fi

if [[ " $parts " == *" closed "* ]]; then
    taskset -c 2,3 timeout 300 python3 benchmarks/plan_trace.py --streams 32,128 --trials 5 --fixed-k 1,2 \
        --output "$out/plan_trace_fixed_k.json" 2>&1 | grep -E "^(plain|draft)|Error|error:" | tail -12
    taskset -c 2,3 timeout 240 python3 benchmarks/gpu_step_speed.py --models bundled,llama-1b --parts async \
        --concurrency 1 --window-batches 1,64 --trials 3 --output "$out/step_speed_union_busy.json" 2>&1 | tail -12
fi

if [[ " $parts " == *" serve "* ]]; then
    timeout 560 python3 benchmarks/serve_vs_offline.py --async-scheduling --output "$out/serve_vs_offline.json"
fi
