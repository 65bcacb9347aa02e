#!/usr/bin/env bash
# One kernel of a benchmark case under Nsight Compute with per-instruction
# source counters, summed by bench/ncu_source.py: its instructions by opcode,
# its warps' stall reasons, and the windows of its SASS where they sit (how
# bench/RESULTS.md's Qwen3.5 seventh round found chunk_bwd's integer work).
#
# Usage: bash bench/ncu_source.sh case kernel [skip]
#   case    a bench/train_bench.sh case (q35-4b-lora, 8b-lora, ...)
#   kernel  a regular expression for the kernel's name (ncu's -k regex:)
#   skip    launches of it to pass over first (default 30: past the first
#           step's warm-up in the layered cases)
# Environment: LOOM_BIN (default build-cuda/loom), LOOM_BENCH_DIR (default
# /tmp/loom-ncu: the model, the report ncu.ncu-rep and its page source.csv),
# NCU (default ncu on PATH), NCU_WINDOW (the summary's window, default 100).
# Clocks are left as the machine runs them (--clock-control none). Exits 2
# on bad arguments, 1 when the run or ncu fails.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

die() { echo "ncu_source.sh: $1" >&2; exit "${2:-2}"; }
[ $# -ge 2 ] && [ $# -le 3 ] || die "usage: bash bench/ncu_source.sh case kernel [skip]"
CASE=$1 KERNEL=$2 SKIP=${3:-30}
[[ $CASE =~ ^[a-z0-9.-]+$ ]] && grep -qE "^ +${CASE//./\\.}\) PRESET=" bench/train_bench.sh ||
    die "unknown case '$CASE' (bench/train_bench.sh's case_cfg lists them)"
[ -n "$KERNEL" ] || die "give the kernel's name, or a regular expression for it"
[[ $SKIP =~ ^[0-9]+$ ]] && [ "$SKIP" -le 100000 ] || die "skip is a count of launches, 0 to 100000 (got '$SKIP')"
WINDOW=${NCU_WINDOW:-100}
[[ $WINDOW =~ ^[0-9]+$ ]] && [ "$WINDOW" -ge 1 ] || die "NCU_WINDOW=$WINDOW: give a count of instructions"
LOOM=${LOOM_BIN:-build-cuda/loom}
[ -x "$LOOM" ] || die "no loom binary at $LOOM: build it (make CUDA=1 BUILD=build-cuda build-cuda/loom) or set LOOM_BIN"
NCU=${NCU:-ncu}
command -v "$NCU" > /dev/null || die "no Nsight Compute ('$NCU' is not on PATH): install it or set NCU"
LOOM=$(cd "$(dirname "$LOOM")" && pwd)/$(basename "$LOOM")
W=${LOOM_BENCH_DIR:-/tmp/loom-ncu}
mkdir -p "$W" || die "cannot make the work dir $W" 1
W=$(cd "$W" && pwd)

# train_bench.sh runs LOOM_BIN; this wrapper runs it under ncu
WRAP=$W/loom-ncu
printf '#!/usr/bin/env bash\nexec %q --clock-control none -k %q --launch-skip %q --launch-count 1 --set none --section SourceCounters --section WarpStateStats --section Occupancy --section LaunchStats -f -o %q %q "$@"\n' \
    "$NCU" "regex:$KERNEL" "$SKIP" "$W/ncu" "$LOOM" > "$WRAP" && chmod +x "$WRAP" || die "cannot write $WRAP" 1
rm -f "$W/ncu.ncu-rep"
echo "ncu_source.sh: $CASE, the first launch of /$KERNEL/ after $SKIP; work dir $W"
env -u OUT -u LOOM_BENCH_OUT LOOM_BIN="$WRAP" LOOM_BENCH_DIR="$W" LOOM_BENCH_SIDES=loom \
    LOOM_BENCH_KEEP_MODELS=1 LOOM_BENCH_STEPS=2 LOOM_BENCH_WARMUP=1 \
    bash bench/train_bench.sh "$CASE" > "$W/bench.log" 2>&1
[ -f "$W/ncu.ncu-rep" ] || { tail -20 "$W/bench.log"; die "ncu wrote no report: no launch of /$KERNEL/ after $SKIP, or the run failed (above: the end of $W/bench.log)" 1; }
"$NCU" -i "$W/ncu.ncu-rep" --page source --csv --print-source sass > "$W/source.csv" 2> "$W/ncu-import.log" ||
    die "ncu could not print the report's source page ($W/ncu-import.log)" 1
"$NCU" -i "$W/ncu.ncu-rep" --page details 2> /dev/null |
    grep -E "Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit"
python3 bench/ncu_source.py "$W/source.csv" --window "$WINDOW"
