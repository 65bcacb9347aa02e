#!/usr/bin/env bash
# Two loom binaries on the same GPU, alternately: A, B, A, B, ... each round
# running bench/train_bench.sh's loom side only, on the same model
# directories (made once, kept), so a refactor's tokens/s is compared with
# the build before it, not with a number from another day or machine.
#
# Usage: bash bench/ab.sh BIN_A BIN_B [ROUNDS] [case ...]
#   BIN_A, BIN_B: loom binaries (absolute, or relative to the repository root);
#   for "before" build the older commit on the same machine, e.g.
#   git archive BASE | tar -x -C /tmp/base && make -C /tmp/base CUDA=1 BUILD=build-cuda
#   ROUNDS: rounds of A then B (default 2); cases as train_bench.sh's
#   (default 0.6b-full 4b-lora). Other LOOM_BENCH_* settings pass through.
# Output: each run's summary row under its side, then the rows side by side
# (OUT or LOOM_BENCH_OUT: where the logs go).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
[ $# -ge 2 ] || { sed -n '2,15p' "$0"; exit 2; }
A=$1 B=$2
shift 2
ROUNDS=2
if [[ ${1:-} =~ ^[0-9]+$ ]]; then ROUNDS=$1; shift; fi
CASES=("$@")
[ ${#CASES[@]} -gt 0 ] || CASES=(0.6b-full 4b-lora)
for bin in "$A" "$B"; do
    [ -x "$bin" ] || { echo "ab.sh: $bin is not an executable loom binary"; exit 2; }
done
W=${LOOM_BENCH_DIR:-/tmp/loom-ab}
mkdir -p "$W"
rows="$W/ab-rows.txt"
: >"$rows"
for ((r = 1; r <= ROUNDS; r++)); do
    for side in A B; do
        bin=$A
        [ "$side" = B ] && bin=$B
        echo "== round $r, side $side ($bin)"
        LOOM_BIN=$bin LOOM_BENCH_SIDES=loom LOOM_BENCH_KEEP_MODELS=1 LOOM_BENCH_DIR="$W" \
            LOOM_BENCH_OUT= OUT= bash bench/train_bench.sh "${CASES[@]}" >"$W/ab-$side-$r.log" 2>&1 \
            || { echo "ab.sh: side $side round $r failed:"; tail -20 "$W/ab-$side-$r.log"; exit 1; }
        grep '^| ' "$W/summary.md" | grep -v -- '---' | tail -n ${#CASES[@]} \
            | sed "s/^/$side$r /" | tee -a "$rows"
    done
done
echo
echo "== side by side (A: $A, B: $B)"
sort -s -t"|" -k2,2 "$rows"
dest=${LOOM_BENCH_OUT:-${OUT:-}}
[ -n "$dest" ] && cp "$W"/ab-*.log "$rows" "$dest"/ 2>/dev/null
exit 0
