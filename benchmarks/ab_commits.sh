#!/bin/bash
# A/B of two commits in one device call, the baseline rerun beside the change on the same card.
#
# Here (packs both commits, without the models, results and docs, into the git-ignored .devdata/):
#   benchmarks/ab_commits.sh pack BASE_COMMIT NEW_COMMIT
# There (device tool, carry [".devdata"]; the models are linked from the working tree the call runs in):
#   bash .devdata/ab_commits.sh run ROUNDS -- python3 benchmarks/gpu_step_speed.py --models bundled ...
# `run` extracts both, gives both the NEW commit's copy of the benchmark script named in the command
# (so both versions are measured the same way), then runs the command in base, new, base, new, ...
# (ROUNDS pairs). Each run sees AB_VERSION (base or new) and AB_ROUND, and writes under
# $OUT/<version>-<round>/ if the command writes to "$AB_OUT".
set -euo pipefail

case "${1:-}" in
pack)
    base=$(git rev-parse "$2") new=$(git rev-parse "$3")
    mkdir -p .devdata
    git archive "$base" --prefix=clean/ -o .devdata/ab_base.tar ':!models' ':!benchmarks/results' ':!docs'
    git archive "$new" --prefix=clean/ -o .devdata/ab_new.tar ':!models' ':!benchmarks/results' ':!docs'
    [ "$0" -ef .devdata/ab_commits.sh ] || cp "$0" .devdata/ab_commits.sh
    echo "packed base $base and new $new into .devdata/ (carry it)"
    ;;
run)
    rounds=$2
    shift 2
    [ "${1:-}" = "--" ] && shift
    repo=$PWD
    for v in base new; do
        rm -rf "/tmp/ab_$v" && mkdir -p "/tmp/ab_$v"
        tar -xf ".devdata/ab_$v.tar" -C "/tmp/ab_$v"
        ln -s "$repo/models" "/tmp/ab_$v/clean/models"
        (cd "/tmp/ab_$v/clean" && if [ -d kernels ] && [ ! -e asyncspec/kernels ]; then ln -s ../kernels asyncspec/kernels; fi)
    done
    for arg in "$@"; do
        script=${arg#./}
        if [[ "$script" == benchmarks/*.py && -f "/tmp/ab_new/clean/$script" ]]; then
            cp "/tmp/ab_new/clean/$script" "/tmp/ab_base/clean/$script"
        fi
    done
    for round in $(seq 1 "$rounds"); do
        for v in base new; do
            echo "=== $v, round $round"
            export AB_VERSION=$v AB_ROUND=$round AB_OUT="${OUT:-/tmp/ab_out}/$v-$round"
            mkdir -p "$AB_OUT"
            # The command names the run's folder as a literal '$AB_OUT' (quoted here, so that the
            # caller's shell leaves it alone): substituted per run.
            args=("${@//\$AB_OUT/$AB_OUT}")
            (cd "/tmp/ab_$v/clean" && "${args[@]}") || echo "=== $v, round $round: exit $?"
        done
    done
    ;;
*)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
