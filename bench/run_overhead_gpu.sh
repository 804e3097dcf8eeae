#!/usr/bin/env bash
# The GPU run behind docs/benchmarks.md "Recorder overhead": every job in its own
# process, each parent invocation capped in time so one call fits a 10-minute device slot.
# Usage: bench/run_overhead_gpu.sh OUTDIR [BEFORE_DIR] [ROUND]
#   BEFORE_DIR: a directory holding an older kvtrace package (git archive OLD kvtrace | tar -x -C DIR)
#   ROUND: "matrix" (default: b1, amplified, b16, gpt-oss, anchors) or "third" (the third
#          round of overhead work: GPU syncs on the model's thread, b16 and b1 with
#          aa/recorder/sampling32 and the per-step gaps, b16 'before' from BEFORE_DIR,
#          open/close profile)
set -u
out=${1:?output directory}
before=${2:-}
round=${3:-matrix}
b=()
[ -n "$before" ] && b=(--before "$before")
run() {  # seconds name args...
    local t=$1 name=$2; shift 2
    timeout "$t" python3 bench/bench_overhead.py --quiet --json "$out/$name.json" "$@" 2>&1 | grep -v "attention mask"
}
export PYTHONUNBUFFERED=1
if [ "$round" = third ]; then
    timeout 70 python3 bench/profile_syncs.py --json "$out/syncs.json" 2>&1 | grep -v "attention mask"
    run 250 overhead_b16 --suite gpu --models pythia-1.4b --shapes b16 --variants aa,recorder,sampling32 \
        --pairs 40 --budget-s 125 --gaps "${b[@]}"
    run 150 overhead_b1 --suite gpu --models pythia-1.4b --shapes b1 --variants aa,recorder,sampling32 \
        --pairs 40 --budget-s 140 --gaps
    timeout 60 python3 bench/profile_open_close.py --sessions 10 --top 12 > "$out/open_close.txt" 2>&1
    exit 0
fi
run 220 overhead_b1 --suite gpu --models pythia-1.4b --shapes b1 --variants aa,recorder,sampling32 --pairs 12 \
    --budget-s 105 "${b[@]}"
run 95 overhead_amplified --suite amplified --pairs 5 --budget-s 90
run 65 overhead_b16 --suite gpu --models pythia-1.4b --shapes b16 --variants recorder --pairs 10 --budget-s 55
run 120 overhead_gptoss --suite gpu --models gpt-oss-20b --variants recorder --pairs 5 --budget-s 55
run 75 overhead_anchors --suite anchors --pairs 2 --budget-s 35
