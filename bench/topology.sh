#!/usr/bin/env bash
# Issue 9, the usage example's topology: LoRA r=8 on all linear layers of a
# Qwen3-shaped model (random weights), trained on a tp=2 x pp=2 x dp=D mesh
# with the distributed optimizer, N optimizer steps of 16 micro-batches of
# one row per data-parallel rank; its per-step losses against a reference
# run on ONE process (one GPU) with the same global batch (16 x D rows), the
# same data in the same order and the same settings. Prints the loss table,
# the worst relative difference and PASS/FAIL, tokens/s per GPU (per rank)
# and peak memory per rank. See bench/README.md.
#
# Usage: bash bench/topology.sh cpu|gpu
#        bash bench/topology.sh compare REF.log TOPO.log [NRANKS [TOL]]
#   cpu: tiny-qwen3 (4 layers, 4 heads, 2 kv heads), fp32, 8 MPI ranks
#        (mpirun -np 8: tp2 pp2 dp2), seq_len 256, lr 1e-2; reference: 1 process
#   gpu: qwen3-4b (bf16 model directory), --dtype bf16, seq_len 4096, lr 1e-3,
#        LOOM_TOPO_NPROC GPUs (default 4: tp2 pp2 dp1) started by
#        `loom train --nproc-per-node`; reference: 1 GPU
#   compare: only the comparison, on two logs of earlier runs
# Environment (all optional):
#   LOOM_BIN=PATH             loom binary (cpu: build/loom, gpu: build-cuda/loom;
#                             built with make when missing)
#   LOOM_TOPO_DIR=DIR         work dir (default /tmp/loom-topo-MODE): model/, data.*,
#                             init.log, ref.log, topo.log, summary.txt
#   LOOM_TOPO_STEPS=N         optimizer steps (default 20)
#   LOOM_TOPO_SEQ_LEN=S       tokens per row (cpu 256, gpu 4096)
#   LOOM_TOPO_ACCUM=K         micro-batches (of 1 row) per data-parallel rank per step (16)
#   LOOM_TOPO_NPROC=N         ranks of the topology, a multiple of 4 (cpu 8, gpu 4); dp = N/4
#   LOOM_TOPO_LR=X            constant learning rate (cpu 1e-2, gpu 1e-3)
#   LOOM_TOPO_LORA_ALPHA=X    LoRA alpha (default 16, with r=8)
#   LOOM_TOPO_TOL=X           largest relative loss difference that passes (cpu 1e-4, gpu 1e-2)
#   LOOM_TOPO_WARMUP=N        steps left out of the tokens/s mean (default 3)
#   LOOM_TOPO_PRESET=P        model shape (cpu tiny-qwen3, gpu qwen3-4b)
#   LOOM_TOPO_CONFIG_OVERRIDE=JSON   --config-override for both runs (e.g. fewer layers)
#   LOOM_TOPO_EXTRA="ARGS"    more `loom train` flags for both runs (e.g. --sequence-parallel)
#   LOOM_TOPO_SIDES="ref topo"  which runs to do (a side left out keeps its old log)
#   LOOM_TOPO_RUN_TIMEOUT=S   limit of each run (cpu 300, gpu 540 s)
#   LOOM_TOPO_MPIRUN="mpirun --oversubscribe --allow-run-as-root"  (cpu) how to start ranks
#   LOOM_TOPO_DRY=1           print the commands, run nothing
#   LOOM_TOPO_OUT=DIR         copy logs and the summary here (default $OUT when set)
#   PYTHON=python3            the Python (with numpy) for bench/make_data.py
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

MODE=${1:-}
T0=$SECONDS
RUN_TIMEOUT_NAME=LOOM_TOPO_RUN_TIMEOUT
. bench/lib.sh # say, show_cmd, run_logged

# step_lines LOG: "STEP LOSS GRADNORM TOKENS_PER_S" for each step line of rank 0
step_lines() {
    sed -n -E 's/^(\[rank 0\/[0-9]+\] )?step ([0-9]+)\/[0-9]+ \| loss ([^ ]+) \| grad norm ([^ ]+) \| lr [^ ]+ \| ([0-9.]+) tokens\/s.*/\2 \3 \4 \5/p' "$1"
}

# compare REF_LOG TOPO_LOG NRANKS TOL STEPS WARMUP UNIT: the table, the worst
# relative loss difference, tokens/s; returns 0 (PASS) or 1 (FAIL)
compare() {
    local ref=$1 topo=$2 nr=$3 tol=$4 steps=$5 warm=$6 unit=$7
    for f in "$ref" "$topo"; do
        [ -f "$f" ] || { echo "topology.sh: no log $f"; return 1; }
    done
    awk -v tol="$tol" -v n="$steps" -v warm="$warm" -v nr="$nr" -v unit="$unit" '
        function num(x) { return x ~ /^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$/ }
        FNR == NR { rl[$1] = $2; rg[$1] = $3; rt[$1] = $4; next }
        { tl[$1] = $2; tg[$1] = $3; tt[$1] = $4 }
        END {
            if (n == 0) for (s in rl) if (s + 0 > n) n = s + 0
            printf "%5s  %10s  %10s  %9s   %9s  %9s\n", "step", "ref loss", "topo loss", "rel diff", "ref gnorm", "topo gnorm"
            worst = 0; wstep = 0; bad = 0; gworst = 0
            for (s = 1; s <= n; s++) {
                if (!(s in rl) || !(s in tl)) {
                    printf "%5d  %10s  %10s  %9s\n", s, (s in rl) ? rl[s] : "missing", (s in tl) ? tl[s] : "missing", "-"
                    bad++; continue
                }
                if (!num(rl[s]) || !num(tl[s])) {
                    printf "%5d  %10s  %10s  %9s\n", s, rl[s], tl[s], "not finite"
                    bad++; continue
                }
                d = tl[s] - rl[s]; if (d < 0) d = -d
                r = rl[s] < 0 ? -rl[s] : rl[s]
                rel = d / (r > 0 ? r : 1)
                if (rel > worst || wstep == 0) { worst = rel; wstep = s }
                g = tg[s] - rg[s]; if (g < 0) g = -g
                if (g > gworst) gworst = g
                printf "%5d  %10s  %10s  %9.2e   %9s  %9s%s\n", s, rl[s], tl[s], rel, rg[s], tg[s], (rel > tol ? "  <-- over tolerance" : "")
            }
            if (n >= 1 && (1 in rl) && (n in rl) && num(rl[1]) && num(rl[n]))
                printf "reference loss: %s at step 1 -> %s at step %d (%+.2f%%)\n", rl[1], rl[n], n, 100 * (rl[n] - rl[1]) / rl[1]
            printf "worst relative loss difference: %.3e at step %d (tolerance %g)\n", worst, wstep, tol
            printf "largest grad norm difference: %.3f (printed with 3 decimals; not part of the verdict)\n", gworst
            if (n >= 1 && (1 in rl) && (n in rl) && num(rl[1]) && num(rl[n])) {
                mv = rl[n] - rl[1]; if (mv < 0) mv = -mv; mv /= (rl[1] < 0 ? -rl[1] : rl[1])
                if (mv < 2 * tol)
                    printf "warning: the reference loss moved %.2e, less than twice the tolerance: the comparison cannot tell the runs apart\n", mv
            }
            for (side = 0; side < 2; side++) {
                c = 0; sum = 0
                for (s = warm + 1; s <= n; s++) {
                    v = side ? tt[s] : rt[s]
                    if (v != "") { c++; sum += v }
                }
                if (c == 0) { printf "%s tokens/s: n/a (no steps after the first %d)\n", side ? "topology" : "reference", warm; continue }
                k = side ? nr : 1
                printf "%-9s tokens/s: %.0f (mean of steps %d-%d) over %d %s%s = %.0f per %s\n", side ? "topology" : "reference", sum / c, warm + 1, n, k, unit, k == 1 ? "" : "s", sum / c / k, unit
            }
            ok = bad == 0 && worst <= tol && wstep > 0
            printf "%s: %s\n", ok ? "PASS" : "FAIL", bad ? bad " step(s) missing or not finite" : (ok ? "every step within tolerance" : "loss over tolerance")
            exit ok ? 0 : 1
        }' <(step_lines "$ref") <(step_lines "$topo")
}

# compare_adapters REF_DIR TOPO_DIR: the trained LoRA weights of both runs
# (PEFT safetensors, fp32), per tensor: max |topo - ref| / max |ref| and
# ||topo - ref|| / ||ref||; prints the worst tensor of each. Informational.
compare_adapters() {
    "$PY" - "$1" "$2" << 'EOF'
import json, struct, sys
import numpy as np

def load(d):
    with open(d + "/adapter_model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        if v["dtype"] == "F32":
            x = np.frombuffer(data[a:b], dtype="<f4")
        elif v["dtype"] == "BF16":
            x = (np.frombuffer(data[a:b], dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            x = np.frombuffer(data[a:b], dtype="<f8")
        out[k] = x.astype(np.float64).reshape(v["shape"])
    return out

try:
    r, t = load(sys.argv[1]), load(sys.argv[2])
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"adapters: not compared ({e})")
if sorted(r) != sorted(t) or any(r[k].shape != t[k].shape for k in r):
    sys.exit("adapters: the two runs wrote different tensors")
mx, l2 = (0.0, ""), (0.0, "")
for k in sorted(r):
    d = t[k] - r[k]
    m, n = np.abs(r[k]).max(), np.linalg.norm(r[k])
    e1, e2 = np.abs(d).max() / (m if m > 0 else 1), np.linalg.norm(d) / (n if n > 0 else 1)
    if e1 > mx[0] or not mx[1]:
        mx = (e1, k)
    if e2 > l2[0] or not l2[1]:
        l2 = (e2, k)
short = lambda k: k.replace("base_model.model.model.", "")
print(f"adapters after training ({len(r)} tensors): worst max|diff|/max|ref| {mx[0]:.2e} ({short(mx[1])}),")
print(f"    worst ||diff||/||ref|| {l2[0]:.2e} ({short(l2[1])})")
EOF
}

# peak memory lines of a log (GPU: loom's own, every rank; CPU: GNU time's max RSS)
memory_lines() {
    grep -h -E 'memory per process \(predicted|peak GPU memory|max RSS' "$1" | sort -t/ -k1,1V -s
}

if [ "$MODE" = compare ]; then
    [ $# -ge 3 ] || { echo "usage: bash bench/topology.sh compare REF.log TOPO.log [NRANKS [TOL]]" >&2; exit 2; }
    compare "$2" "$3" "${4:-1}" "${5:-1e-4}" 0 "${LOOM_TOPO_WARMUP:-3}" rank
    rc=$?
    memory_lines "$3"
    exit "$rc"
fi

case "$MODE" in
    cpu)
        PRESET=${LOOM_TOPO_PRESET:-tiny-qwen3}; SEQ=${LOOM_TOPO_SEQ_LEN:-256}
        NP=${LOOM_TOPO_NPROC:-8}; LR=${LOOM_TOPO_LR:-1e-2}; TOL=${LOOM_TOPO_TOL:-1e-4}
        LOOM=${LOOM_BIN:-build/loom}; DTYPE=fp32; DEVICE=cpu; SAVE_DTYPE=float32
        RUN_TIMEOUT=${LOOM_TOPO_RUN_TIMEOUT:-300}; UNIT=rank
        ;;
    gpu)
        PRESET=${LOOM_TOPO_PRESET:-qwen3-4b}; SEQ=${LOOM_TOPO_SEQ_LEN:-4096}
        NP=${LOOM_TOPO_NPROC:-4}; LR=${LOOM_TOPO_LR:-1e-3}; TOL=${LOOM_TOPO_TOL:-1e-2}
        LOOM=${LOOM_BIN:-build-cuda/loom}; DTYPE=bf16; DEVICE=cuda; SAVE_DTYPE=bfloat16
        RUN_TIMEOUT=${LOOM_TOPO_RUN_TIMEOUT:-540}; UNIT=GPU
        ;;
    *)
        echo "usage: bash bench/topology.sh cpu|gpu   (or: compare REF.log TOPO.log [NRANKS [TOL]])" >&2
        exit 2
        ;;
esac
STEPS=${LOOM_TOPO_STEPS:-20}
ACCUM=${LOOM_TOPO_ACCUM:-16}
WARMUP=${LOOM_TOPO_WARMUP:-3}
ALPHA=${LOOM_TOPO_LORA_ALPHA:-16}
SIDES=${LOOM_TOPO_SIDES:-ref topo}
DRY=${LOOM_TOPO_DRY:-0}
PY=${PYTHON:-python3}
W=${LOOM_TOPO_DIR:-/tmp/loom-topo-$MODE}
OUTDIR=${LOOM_TOPO_OUT:-${OUT:-}}
read -r -a EXTRA <<< "${LOOM_TOPO_EXTRA:-}"
read -r -a MPIRUN <<< "${LOOM_TOPO_MPIRUN:-mpirun --oversubscribe --allow-run-as-root}"
if [ $((NP % 4)) -ne 0 ] || [ "$NP" -lt 4 ]; then
    echo "topology.sh: LOOM_TOPO_NPROC=$NP: the mesh is tp2 x pp2 x dp, so it must be a multiple of 4" >&2
    exit 2
fi
DP=$((NP / 4))
GBS=$((ACCUM * DP)) # rows per optimizer step: 1 row per micro-batch, ACCUM per dp rank
NDOCS=$((STEPS * GBS))
VOCAB=151936
case "$PRESET" in tiny-*) VOCAB=1024 ;; esac

mkdir -p "$W" || exit 1
M=$W/model
DATA=$W/data

# every run of both sides: same model, data, schedule, LoRA and optimizer
COMMON=(--device "$DEVICE" --dtype "$DTYPE" --model "$M" --data "$DATA.tokens"
        --seq-len "$SEQ" --micro-batch-size 1 --global-batch-size "$GBS"
        --train-steps "$STEPS" --lr "$LR" --lr-warmup-steps 0 --lr-decay-style constant
        --clip-grad 1.0 --weight-decay 0.0 --log-interval 1
        --lora-r 8 --lora-alpha "$ALPHA" --lora-target all-linear)
[ -n "${LOOM_TOPO_CONFIG_OVERRIDE:-}" ] && COMMON+=(--config-override "$LOOM_TOPO_CONFIG_OVERRIDE")
COMMON+=("${EXTRA[@]}")
MESH=(--tp 2 --pp 2 --dp "$DP")
# the trained adapters (fp32, PEFT files), compared after the losses
REF_SAVE=(--save-adapter "$W/ref-adapter")
TOPO_SAVE=(--save-adapter "$W/topo-adapter")
if [ "$MODE" = cpu ]; then
    # CPU ranks: MPI; no core pinning (8 ranks may share 2 cores); each rank's
    # peak resident memory from GNU time when it is installed
    export OMPI_MCA_btl_vader_single_copy_mechanism=none
    export LOOM_COMM_TIMEOUT=${LOOM_COMM_TIMEOUT:-120}
    REF_CMD=("$LOOM" train "${COMMON[@]}" "${REF_SAVE[@]}")
    TOPO_CMD=("${MPIRUN[@]}" -np "$NP" "$LOOM" train "${COMMON[@]}" "${MESH[@]}" "${TOPO_SAVE[@]}")
    if [ -x /usr/bin/time ]; then
        REF_CMD=(/usr/bin/time -f "max RSS %M KiB (the one process)" "${REF_CMD[@]}")
        # (one file per rank, $0 = the folder: GNU time writes its line in
        # pieces, which interleave on a shared stderr)
        TOPO_CMD=("${MPIRUN[@]}" -np "$NP" sh -c \
            'exec /usr/bin/time -o "$0/rank$OMPI_COMM_WORLD_RANK" -f "[rank $OMPI_COMM_WORLD_RANK/$OMPI_COMM_WORLD_SIZE] max RSS %M KiB" "$@"' \
            "$W/rss" "$LOOM" train "${COMMON[@]}" "${MESH[@]}" "${TOPO_SAVE[@]}")
    fi
else
    # NCCL and cuDNN of a PyTorch installation live in its nvidia/* packages (as tests/gpu/run.sh)
    py_lib() { "$PY" -c "import importlib.util as u; s=u.find_spec('nvidia.$1'); print(list(s.submodule_search_locations)[0]+'/lib' if s else '')" 2>/dev/null || true; }
    LD_LIBRARY_PATH="$(py_lib nccl):$(py_lib cudnn):${LD_LIBRARY_PATH:-}"
    export LD_LIBRARY_PATH
    REF_CMD=("$LOOM" train "${COMMON[@]}" "${REF_SAVE[@]}")
    TOPO_CMD=("$LOOM" train --nproc-per-node "$NP" "${COMMON[@]}" "${MESH[@]}" "${TOPO_SAVE[@]}")
fi

copy_out() {
    [ -n "$OUTDIR" ] && [ "$DRY" != 1 ] || return 0
    mkdir -p "$OUTDIR" && cp "$W"/*.log "$W"/summary.txt "$OUTDIR"/ 2> /dev/null
    return 0
}

main() {
echo "=================== loom: the usage example's topology (issue 9), $MODE ==================="
echo "date:    $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "host:    $(hostname); CPU: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"
if [ "$MODE" = gpu ] && command -v nvidia-smi > /dev/null; then
    echo "GPU:     $(nvidia-smi -L 2>/dev/null | wc -l) x $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
fi
echo "repo:    $(git rev-parse --short HEAD 2>/dev/null || echo '?')$( [ -n "$(git status --porcelain 2>/dev/null)" ] && echo ' (with uncommitted changes)')"
echo "run:     $PRESET, LoRA r=8 alpha=$ALPHA all-linear, $DTYPE, seq_len $SEQ, $STEPS steps, lr $LR constant,"
echo "         global batch $GBS rows = dp $DP x $ACCUM micro-batches of 1 row;"
echo "         reference: 1 process ($GBS micro-batches); topology: tp=2 pp=2 dp=$DP on $NP ${UNIT}s; tolerance $TOL"
echo "work:    $W$([ "$DRY" = 1 ] && echo '   (LOOM_TOPO_DRY=1: commands only)')"

if [ "$DRY" != 1 ]; then
    if [ ! -x "$LOOM" ]; then
        B=$(dirname "$LOOM")
        MK=(make -j"$(nproc)" BUILD="$B" "$LOOM")
        [ "$MODE" = gpu ] && MK=(make -j"$(nproc)" CUDA=1 BUILD="$B" "$LOOM")
        say "building $LOOM"
        show_cmd "${MK[@]}"
        "${MK[@]}" > "$W/build.log" 2>&1 || { tail -30 "$W/build.log"; echo "topology.sh: the build failed (log: $W/build.log)"; return 1; }
    fi
    "$LOOM" version || { echo "topology.sh: $LOOM does not run"; return 1; }
    if [ "$MODE" = gpu ]; then
        ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
        [ "$ngpu" -ge "$NP" ] || { echo "topology.sh: $NP GPUs wanted (LOOM_TOPO_NPROC), $ngpu visible"; return 1; }
    else
        command -v "${MPIRUN[0]}" > /dev/null || { echo "topology.sh: no ${MPIRUN[0]} (apt-get install openmpi-bin)"; return 1; }
    fi
fi

say "model: $PRESET, random weights (seed 1, $SAVE_DTYPE)"
if [ "$DRY" != 1 ] && [ -f "$M/.topo-ok" ] && [ "$(cat "$M/.topo-ok")" = "$PRESET seed 1 $SAVE_DTYPE" ]; then
    say "model $M exists (kept from an earlier run)"
else
    [ "$DRY" = 1 ] || rm -rf "$M"
    run_logged "$W/init.log" "$LOOM" init --preset "$PRESET" --seed 1 --save-dtype "$SAVE_DTYPE" --out "$M" || return 1
    [ "$DRY" = 1 ] || echo "$PRESET seed 1 $SAVE_DTYPE" > "$M/.topo-ok"
fi

say "data: $NDOCS documents of $SEQ tokens (one row each, $GBS per step), vocab $VOCAB"
show_cmd "$PY" bench/make_data.py --out "$DATA" --n-docs "$NDOCS" --seq-len "$SEQ" --vocab "$VOCAB" --seed 1
if [ "$DRY" != 1 ]; then
    "$PY" bench/make_data.py --out "$DATA" --n-docs "$NDOCS" --seq-len "$SEQ" --vocab "$VOCAB" --seed 1 || return 1
    rm -f "$DATA.npy" # only the peer of train_bench.sh reads it
fi

REF_RC=0; TOPO_RC=0; REF_S=-; TOPO_S=-
if [[ " $SIDES " == *" ref "* ]]; then
    say "reference: one process"
    [ "$DRY" = 1 ] || rm -rf "$W/ref-adapter"
    t=$SECONDS; run_logged "$W/ref.log" "${REF_CMD[@]}"; REF_RC=$?; REF_S=$((SECONDS - t))
fi
if [[ " $SIDES " == *" topo "* ]]; then
    say "topology: tp=2 pp=2 dp=$DP, $NP ranks"
    [ "$DRY" = 1 ] || { rm -rf "$W/rss" "$W/topo-adapter" && mkdir -p "$W/rss"; }
    t=$SECONDS; run_logged "$W/topo.log" "${TOPO_CMD[@]}"; TOPO_RC=$?; TOPO_S=$((SECONDS - t))
    if [ "$DRY" != 1 ] && [ -n "$(ls "$W/rss" 2> /dev/null)" ]; then
        sort -V "$W"/rss/rank* > "$W/rss.txt" # one line per rank, in rank order
        cat "$W/rss.txt" >> "$W/topo.log"
        sed 's/^/    /' "$W/rss.txt"
    fi
fi
[ "$DRY" = 1 ] && { say "dry run: nothing ran"; return 0; }

echo
say "comparison (reference: $W/ref.log, $REF_S s; topology: $W/topo.log, $TOPO_S s)"
{
    echo "$PRESET LoRA r=8 all-linear, $DTYPE, seq_len $SEQ, $STEPS steps, global batch $GBS, lr $LR;"
    echo "reference 1 process vs tp=2 pp=2 dp=$DP on $NP ${UNIT}s (wall $REF_S s / $TOPO_S s)"
    compare "$W/ref.log" "$W/topo.log" "$NP" "$TOL" "$STEPS" "$WARMUP" "$UNIT"
    CMP_RC=$?
    compare_adapters "$W/ref-adapter" "$W/topo-adapter" 2>&1
    echo "    (informational, not part of the verdict: an element whose gradient is near Adam's eps"
    echo "    moves by lr*g/(|g|+eps), so the rounding of the sums shows there first)"
    echo "memory, reference:"
    memory_lines "$W/ref.log" | sed 's/^/    /'
    echo "memory, topology (per rank):"
    memory_lines "$W/topo.log" | sed 's/^/    /'
    [ "$REF_RC" -ne 0 ] && echo "FAIL: the reference run exited with $REF_RC"
    [ "$TOPO_RC" -ne 0 ] && echo "FAIL: the topology run exited with $TOPO_RC"
    [ "$CMP_RC" -eq 0 ] && [ "$REF_RC" -eq 0 ] && [ "$TOPO_RC" -eq 0 ]
} > "$W/summary.txt"
RC=$?
cat "$W/summary.txt"
say "total $((SECONDS - T0)) s"
copy_out
return "$RC"
}

# the whole output also goes to $W/topology.log
main 2>&1 | tee "$W/topology.log"
rc=${PIPESTATUS[0]}
copy_out
exit "$rc"
