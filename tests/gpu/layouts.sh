#!/usr/bin/env bash
# Parallel layouts on GPUs against one GPU, in bf16: `loom golden` (loss,
# token log-probs, every gradient, and the weights after 3 AdamW steps with
# the distributed optimizer) on 1 GPU, then on each layout over 2 GPUs
# (TP2, TP2+SP, PP2, DP2, CP2, CP2 on packed documents) and, with 4 GPUs,
# TP2.DP2, TP2.PP2, TP2.CP2+SP and PP2.VPP2.DP2; each compared with
# tests/gpu/compare.py golden (bf16 tolerance). Workers are started by
# `loom golden --nproc-per-node N` (NCCL over the TCP rendezvous).
# Usage: bash tests/gpu/layouts.sh [BUILD_DIR]   (LOOM_LAYOUTS="pp2 dp2": only those)
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build-cuda}
py_lib() { python3 -c "import importlib.util as u; s=u.find_spec('nvidia.$1'); print(list(s.submodule_search_locations)[0]+'/lib' if s else '')" 2>/dev/null || true; }
export LD_LIBRARY_PATH="$(py_lib nccl):$(py_lib cudnn):${LD_LIBRARY_PATH:-}"
export LOOM_COMM_TIMEOUT=${LOOM_COMM_TIMEOUT:-120}
TOL=${LOOM_LAYOUT_TOL:-0.03}
W=${LOOM_GPU_WORK:-/tmp/loom-gpu-layouts}
rm -rf "$W" && mkdir -p "$W"
ngpu=$(nvidia-smi -L | wc -l)
python3 tests/gpu/make_model.py "$W/m" "$W/b.safetensors"
python3 tests/gpu/make_model.py "$W/m" "$W/bp.safetensors" --packed
G="$B/loom golden --device cuda --dtype bf16 --model $W/m --num-micro-batches 2 --steps 3 --lr 1e-3 --log-level warn"
ref() { $G --batch "$W/$1.safetensors" --out "$W/ref-$1.safetensors"; }
declare -a rows
run() { # name batch nproc flags...
    local name=$1 batch=$2 np=$3; shift 3
    # LOOM_LAYOUTS="pp2 tp2-pp2" runs only those
    if [ -n "${LOOM_LAYOUTS:-}" ] && [[ " $LOOM_LAYOUTS " != *" $name "* ]]; then return 0; fi
    local t0=$SECONDS
    if CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((np - 1))) $G --nproc-per-node "$np" "$@" \
        --batch "$W/$batch.safetensors" --out "$W/$name.safetensors" >"$W/$name.log" 2>&1; then
        local res; res=$(python3 tests/gpu/compare.py golden "$W/ref-$batch.safetensors" "$W/$name.safetensors" --tol "$TOL" 2>&1)
        local rc=$?
        rows+=("$(printf '%-22s %-4s %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" "$(echo "$res" | tail -1)")")
        [ $rc = 0 ] || echo "$res"
    else
        rows+=("$(printf '%-22s %-4s %s' "$name" "FAIL" "exit status $? (log: $W/$name.log)")")
        tail -20 "$W/$name.log"
    fi
    echo "$name: $((SECONDS - t0)) s"
}
ref b && ref bp || { echo "reference run failed"; exit 1; }
run tp2            b  2 --tp 2
run tp2-sp         b  2 --tp 2 --sequence-parallel
run pp2            b  2 --pp 2
run dp2            b  2 --dp 2
run cp2            b  2 --cp 2
run cp2-packed     bp 2 --cp 2
if [ "$ngpu" -ge 4 ]; then
    run tp2-dp2        b  4 --tp 2 --dp 2
    run tp2-pp2        b  4 --tp 2 --pp 2
    run tp2-cp2-sp     b  4 --tp 2 --cp 2 --sequence-parallel
    run pp2-vpp2-dp2   b  4 --pp 2 --vpp 2 --dp 2
fi
echo
echo "layout                 result  (worst relative error vs 1 GPU; tol $TOL)"
printf '%s\n' "${rows[@]}"
! printf '%s\n' "${rows[@]}" | grep -q FAIL
