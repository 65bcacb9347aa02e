#!/usr/bin/env bash
# Where loom's training step spends its GPU time (issue 8), per step, for
# bench/RESULTS.md: the bench case's own loom command (bench/train_bench.sh,
# loom alone) under bench/kprof.c, a CUPTI tracer (the lent GPU machines have
# no Nsight Systems), summed by kind of work by bench/kprof_table.py.
#
# Usage: bash bench/profile.sh [case] [first last]
#   case         8b-lora (default), 4b-lora, 0.6b-full, 30b-a3b-lora (with
#                LOOM_BENCH_LAYERS=12: fewer layers), q35-4b-lora, q35-0.8b-full
#                (Qwen3.5), or tiny-full / tiny-lora / tiny-moe-lora / tiny-q35-lora
#   first last   steps (default 3 8): a run of `first` steps counts its kernels,
#                then a run of `last` steps records only the kernels after
#                those, so the table covers steps first+1 .. last, warm-up and
#                model loading left out
# Environment: LOOM_BIN (default build-cuda/loom), LOOM_KPROF_LIB (default
# libloom_kprof.so beside LOOM_BIN: make CUDA=1 BUILD=build-cuda
# build-cuda/libloom_kprof.so), LOOM_KPROF_GAPS (idle gaps listed, default 8),
# LOOM_PROFILE_TOP (kernels listed, default 25), and train_bench.sh's
# (LOOM_BENCH_DIR, default /tmp/loom-profile; the model directory is kept
# there for the second run and later ones).
# Under --nproc-per-node (in LOOM_BENCH_LOOM_ARGS) each rank gets its own table.
# Exits 2 on bad arguments, 1 when a run fails or leaves no report.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

die() { echo "profile.sh: $1" >&2; exit "${2:-2}"; }
CASE=${1:-8b-lora}
FIRST=${2:-3}
LAST=${3:-8}
[ $# -le 3 ] || die "usage: bash bench/profile.sh [case] [first last]"
case $CASE in
    8b-lora | 4b-lora | 0.6b-full | 30b-a3b-lora | q35-4b-lora | q35-0.8b-full | tiny-full | tiny-lora | \
        tiny-moe-lora | tiny-q35-lora) ;;
    *) die "unknown case '$CASE' (8b-lora 4b-lora 0.6b-full 30b-a3b-lora q35-4b-lora q35-0.8b-full tiny-full tiny-lora tiny-moe-lora tiny-q35-lora)" ;;
esac
[[ $FIRST =~ ^[0-9]+$ && $LAST =~ ^[0-9]+$ ]] && [ "$FIRST" -ge 1 ] && [ "$LAST" -gt "$FIRST" ] && [ "$LAST" -le 1000 ] ||
    die "first and last are step counts with 1 <= first < last <= 1000 (got '$FIRST' '$LAST')"
TOP=${LOOM_PROFILE_TOP:-25}
[[ $TOP =~ ^[0-9]+$ ]] || die "LOOM_PROFILE_TOP=$TOP: give a number of kernels"
LOOM=${LOOM_BIN:-build-cuda/loom}
[ -x "$LOOM" ] || die "no loom binary at $LOOM: build it (make CUDA=1 BUILD=build-cuda build-cuda/loom) or set LOOM_BIN"
LIB=${LOOM_KPROF_LIB:-$(dirname "$LOOM")/libloom_kprof.so}
[ -f "$LIB" ] || die "no tracer at $LIB: build it (make CUDA=1 BUILD=build-cuda build-cuda/libloom_kprof.so) or set LOOM_KPROF_LIB"
LIB=$(cd "$(dirname "$LIB")" && pwd)/$(basename "$LIB")
[[ $LIB != *[[:space:]:]* ]] || die "LD_PRELOAD cannot take a path with spaces or colons ($LIB): put the tracer elsewhere and set LOOM_KPROF_LIB"
LOOM=$(cd "$(dirname "$LOOM")" && pwd)/$(basename "$LOOM")
W=${LOOM_BENCH_DIR:-/tmp/loom-profile}
mkdir -p "$W" || die "cannot make the work dir $W" 1
W=$(cd "$W" && pwd)

# train_bench.sh runs LOOM_BIN; this wrapper preloads the tracer into it
WRAP=$W/loom-kprof
printf '#!/usr/bin/env bash\nLD_PRELOAD=%q${LD_PRELOAD:+:$LD_PRELOAD} exec %q "$@"\n' "$LIB" "$LOOM" > "$WRAP" && chmod +x "$WRAP" ||
    die "cannot write $WRAP" 1

# one run of the case, loom alone; its loom log (stdout and stderr) to $2
run() {
    local steps=$1 out=$2
    shift 2
    # (without OUT and LOOM_BENCH_OUT: train_bench.sh would copy its logs there)
    env -u OUT -u LOOM_BENCH_OUT "$@" LOOM_BIN="$WRAP" LOOM_BENCH_DIR="$W" LOOM_BENCH_SIDES=loom \
        LOOM_BENCH_KEEP_MODELS=1 LOOM_BENCH_STEPS="$steps" LOOM_BENCH_WARMUP=$((steps > 1 ? 1 : 0)) \
        bash bench/train_bench.sh "$CASE" > "$out.bench" 2>&1
    cp "$W/$CASE/loom.log" "$out" 2> /dev/null || { tail -20 "$out.bench"; die "the $steps-step run left no loom log (above: the end of $out.bench)" 1; }
    grep -qE "^(\[rank 0/[0-9]+\] )?(trained |step $steps/$steps )" "$out" || { tail -20 "$out"; die "the $steps-step run did not finish (above: the end of $out)" 1; }
}

echo "profile.sh: $CASE, steps $((FIRST + 1))..$LAST, $LOOM with $LIB; work dir $W"
# each process writes its own report (kprof.c: %r is its RANK; the launcher of
# --nproc-per-node workers runs no kernels and writes none)
rm -f "$W"/kprof-first.r*.log "$W"/kprof-last.r*.log
run "$FIRST" "$W/kprof-first.log" LOOM_KPROF_TOP=0 LOOM_KPROF_OUT="$W/kprof-first.r%r.log"
SKIP=
for r in $(seq 0 1023); do
    f=$W/kprof-first.r$r.log
    [ -f "$f" ] || break
    n=$(sed -n 's/^kprof: \([0-9]*\) kernels (0 skipped).*/\1/p' "$f" | tail -1)
    [ -n "$n" ] || die "rank $r's $FIRST-step report has no kernel count ($f)" 1
    SKIP=${SKIP:+$SKIP,}$n
done
[ -n "$SKIP" ] || die "the $FIRST-step run left no kprof report: no GPU kernels ran (a CPU run), the tracer was not preloaded, or CUPTI did not start ($W/kprof-first.log)" 1
run "$LAST" "$W/kprof-last.log" LOOM_KPROF_SKIP="$SKIP" LOOM_KPROF_TOP=100000 LOOM_KPROF_GAPS="${LOOM_KPROF_GAPS:-8}" \
    LOOM_KPROF_OUT="$W/kprof-last.r%r.log"
grep -E "^(\[rank 0/[0-9]+\] )?step ($((FIRST + 1))|$LAST)/" "$W/kprof-last.log" | sed 's/^/  loom: /'
NR=$(echo "$SKIP" | tr ',' '\n' | wc -l)
for r in $(seq 0 $((NR - 1))); do
    [ "$NR" -eq 1 ] || echo "== rank $r"
    python3 bench/kprof_table.py "$W/kprof-last.r$r.log" --steps $((LAST - FIRST)) --top "$TOP" || exit 1
done
