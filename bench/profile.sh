#!/usr/bin/env bash
# Per-kernel GPU time of loom training, for bench/RESULTS.md: a few steps of
# one bench case under Nsight Systems (nsys, when installed), the kernels
# summed by name (without nsys it only runs the steps). Usage: bash bench/profile.sh [0.6b-full|4b-lora|8b-lora] [steps]
# Needs LOOM_BIN (default build-cuda/loom); prints the top kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
CASE=${1:-0.6b-full}
STEPS=${2:-6}
LOOM=${LOOM_BIN:-build-cuda/loom}
W=${LOOM_BENCH_DIR:-/tmp/loom-profile}
py_lib() { python3 -c "import importlib.util as u; s=u.find_spec('nvidia.$1'); print(list(s.submodule_search_locations)[0]+'/lib' if s else '')" 2>/dev/null || true; }
export LD_LIBRARY_PATH="$(py_lib nccl):$(py_lib cudnn):${LD_LIBRARY_PATH:-}"
case $CASE in
    0.6b-full) PRESET=qwen3-0.6b; MB=2; LORA=() ;;
    4b-lora) PRESET=qwen3-4b; MB=1; LORA=(--lora-r 8 --lora-alpha 16) ;;
    8b-lora) PRESET=qwen3-8b; MB=1; LORA=(--lora-r 8 --lora-alpha 16) ;;
    *) echo "unknown case $CASE"; exit 2 ;;
esac
mkdir -p "$W"
[ -d "$W/$PRESET" ] || "$LOOM" init --preset "$PRESET" --seed 1 --save-dtype bfloat16 --out "$W/$PRESET" >/dev/null
python3 bench/make_data.py --out "$W/data" --n-docs $((STEPS * MB)) >/dev/null
TOK="$W/data.tokens"
CMD=("$LOOM" train --device cuda --dtype bf16 --model "$W/$PRESET" --data "$TOK" --seq-len 4096
     --micro-batch-size "$MB" --global-batch-size "$MB" --train-steps "$STEPS" --lr 1e-4
     --lr-decay-style constant --log-interval 1 "${LORA[@]}")
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1 || true)
if [ -z "$NSYS" ]; then
    echo "nsys (Nsight Systems) not found: no per-kernel profile; install it or put it on PATH"
    "${CMD[@]}" 2>&1 | grep -E "^step|peak"
    exit 0
fi
"$NSYS" profile -t cuda --force-overwrite true -o "$W/prof" "${CMD[@]}" 2>&1 | grep -E "^step|peak" || true
"$NSYS" stats -q -r cuda_gpu_kern_sum -f csv -o "$W/kern" "$W/prof.nsys-rep" >/dev/null 2>&1 || true
python3 - "$W" <<'PY'
import csv, glob, sys
f = glob.glob(sys.argv[1] + "/kern*.csv")
if not f:
    print("nsys stats gave no kernel table"); sys.exit(0)
rows = list(csv.DictReader(open(f[0])))
tot = sum(float(r["Total Time (ns)"]) for r in rows)
print(f"GPU kernel time {tot/1e9:.3f} s over {sum(int(r['Instances']) for r in rows)} launches")
print(f"{'share':>6} {'ms':>9} {'calls':>7}  kernel")
for r in sorted(rows, key=lambda r: -float(r["Total Time (ns)"]))[:25]:
    t = float(r["Total Time (ns)"])
    print(f"{100*t/tot:5.1f}% {t/1e6:9.1f} {int(r['Instances']):7d}  {r['Name'][:110]}")
PY
