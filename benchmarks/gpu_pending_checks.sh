#!/bin/bash
# What the 2026-11-27 sessions left for a GPU: the GPU tests of the changed paths, the batch-1 A/B of the host
# work changes, and the served-vs-offline comparison with the engine in its own process (serve's default).
#
#   bash benchmarks/gpu_pending_checks.sh            # on the device, from the repository root
#
# Writes its JSON under $OUT (or /tmp/pending). Parts, each about one device call (at most 10 minutes):
#   tests  the whole gpu-marked suite but tensor parallelism (the compiled prepare_inputs with resolve, the
#          copy skip under graphs and speculation, the engine process): ~8 min on an H100
#   step   batch-1 TPOT and 32/128-stream throughput of the bundled pair, before the host work changes (BASE,
#          packed with benchmarks/ab_commits.sh into .devdata/) and after (NEW), alternated twice
#   serve  serve_vs_offline.py at 32 and 128 streams, both sides loaded, alternated rounds
# PARTS="tests" runs a subset. `serve` needs grpcio-health-checking and grpcio-reflection on the device (carry
# their wheels; the device README says how). `step` needs `benchmarks/ab_commits.sh pack fc68389 HEAD` here
# first (fc68389: the last commit before the host work changes) and .devdata carried.
set -uo pipefail
out=${OUT:-/tmp/pending}
mkdir -p "$out"
parts=${PARTS:-tests}
[ -e asyncspec/kernels ] || ln -s ../kernels asyncspec/kernels

if [[ " $parts " == *" tests "* ]]; then
    timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/worker tests/layers tests/kernels tests/spec \
        tests/engine tests/models --deselect tests/worker/test_tensor_parallel_gpu.py 2>&1 | tail -15
fi

if [[ " $parts " == *" step "* ]]; then
    OUT=$out bash .devdata/ab_commits.sh run 2 -- python3 benchmarks/gpu_step_speed.py --models bundled \
        --parts graphed,async,graphed-draft,async-draft --concurrency 1,32,128 --window-batches 1 \
        --sweep-batches 1 --trials 3 --output '$AB_OUT/step.json'
fi

if [[ " $parts " == *" serve "* ]]; then
    timeout 560 python3 benchmarks/serve_vs_offline.py --async-scheduling --output "$out/serve_vs_offline.json"
fi
