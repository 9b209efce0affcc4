#!/bin/bash
# The GPU tests of the paths that were opt-in until 2026-11-27 (now defaults: the graphed draft step,
# the skinny linear kernel, PDL) and the model worker process, then each path's A/B (switched off, the
# defaults) in the same call.
#
#   bash benchmarks/gpu_pending_checks.sh            # on the device, from the repository root
#
# Writes its JSON under $OUT (or /tmp/pending). Parts: tests, step (gpu_step_speed with the
# switches off and on), serve (serve_vs_offline with the model in the server process and in a
# worker process); PARTS="tests step" runs a subset. Each part takes minutes: one device call
# (at most 10) holds one or two of them. `serve` needs grpcio-health-checking and grpcio-reflection
# on the device (carry their wheels; the device README says how).
set -uo pipefail
out=${OUT:-/tmp/pending}
mkdir -p "$out"
parts=${PARTS:-tests step serve}
[ -e asyncspec/kernels ] || ln -s ../kernels asyncspec/kernels

if [[ " $parts " == *" tests "* ]]; then
    timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/worker/test_cuda_graphs.py tests/layers/test_linear.py tests/kernels/test_skinny_linear.py \
        tests/worker/test_worker_process_gpu.py 2>&1 | tail -15
fi

if [[ " $parts " == *" step "* ]]; then
    args=(--models bundled,llama-1b --parts graphed,async,graphed-draft,async-draft --concurrency 1,32,128
        --window-batches 1 --sweep-batches 1 --trials 3)
    for round in 1 2; do
        ASYNCSPEC_GREEDY_DRAFT_STEP_GRAPH=0 ASYNCSPEC_SKINNY_LINEAR=0 ASYNCSPEC_PDL=0 timeout 300 \
            python3 benchmarks/gpu_step_speed.py "${args[@]}" --output "$out/step_off_$round.json" \
            | grep -E "^(config|graphed|async|==)"
        timeout 300 python3 benchmarks/gpu_step_speed.py \
            "${args[@]}" --output "$out/step_on_$round.json" | grep -E "^(config|graphed|async|==)"
    done
fi

if [[ " $parts " == *" serve "* ]]; then
    timeout 300 python3 benchmarks/serve_vs_offline.py --async-scheduling --output "$out/serve_in_process.json"
    timeout 300 python3 benchmarks/serve_vs_offline.py --async-scheduling --served-worker-process \
        --output "$out/serve_worker_process.json"
fi
