#!/usr/bin/env bash
# The Python API against `loom train`, same settings, same GPUs, one call
# (issue 34): Qwen3-4B-shaped random weights, LoRA r=8 (alpha 16, all-linear),
# seq 4096, one document per row, micro-batch 1, global batch = GPUs, bf16.
# Usage: bash bench/python_api.sh [GPUS ...]   (default: 1 2)
# Environment: LOOM_BENCH_STEPS (20), LOOM_BENCH_WARMUP (3), LOOM_BENCH_PRESET
# (qwen3-4b), LOOM_BENCH_MODES ("spmd", add "ray" where Ray is installed),
# OUT (where the summary goes).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
STEPS=${LOOM_BENCH_STEPS:-20}
WARM=${LOOM_BENCH_WARMUP:-3}
PRESET=${LOOM_BENCH_PRESET:-qwen3-4b}
MODES=${LOOM_BENCH_MODES:-spmd}
W=${LOOM_BENCH_DIR:-/tmp/loom-pyapi}
GPUS=("$@"); [ ${#GPUS[@]} -eq 0 ] && GPUS=(1 2)
mkdir -p "$W"
make -j"$(nproc)" CUDA=1 BUILD=build-cuda build-cuda/loom build-cuda/libloom.so >"$W/build.log" 2>&1 \
    || { tail -30 "$W/build.log"; exit 1; }
export LOOM_LIBRARY=$PWD/build-cuda/libloom.so PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0
L=build-cuda/loom
[ -d "$W/model" ] || $L init --preset "$PRESET" --out "$W/model" --save-dtype bfloat16 --log-level warn || exit 1
VOCAB=$(python3 -c "import json;print(json.load(open('$W/model/config.json'))['vocab_size'])")
python3 - "$W/data.tokens" "$VOCAB" $((STEPS * 4)) <<'PY' || exit 1
import sys, numpy as np, loom
path, vocab, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
loom.write_tokens(path, [{"input_ids": rng.integers(0, vocab, 4096)} for _ in range(n)], vocab)
PY
mean() { python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['tokens_per_s'][$WARM:]; print(sum(v)/len(v))" "$1"; }
summary="$W/summary.txt"; : >"$summary"
for n in "${GPUS[@]}"; do
    m="$W/train-$n.jsonl"; rm -f "$m"
    args=(train --model "$W/model" --data "$W/data.tokens" --seq-len 4096 --micro-batch-size 1
          --global-batch-size "$n" --train-steps "$STEPS" --lr 1e-4 --lr-decay-style constant
          --lora-r 8 --lora-alpha 16 --seed 42 --metrics-file "$m" --no-progress --log-level warn)
    [ "$n" -gt 1 ] && args+=(--nproc-per-node "$n")
    $L "${args[@]}" || exit 1
    python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; json.dump({'tokens_per_s':[x['tokens_per_s'] for x in r],'losses':[x['loss'] for x in r]}, open(sys.argv[2],'w'))" "$m" "$W/train-$n.json"
    ref=$(mean "$W/train-$n.json")
    for mode in $MODES; do
        o="$W/py-$mode-$n.json"
        if [ "$mode" = ray ]; then
            LOOM_BENCH_GPUS=$n python3 bench/python_api.py "$W/model" "$W/data.tokens" "$o" "$STEPS" 8 ray || exit 1
        elif [ "$n" -gt 1 ]; then
            torchrun --nproc-per-node "$n" bench/python_api.py "$W/model" "$W/data.tokens" "$o" "$STEPS" 8 || exit 1
        else
            python3 bench/python_api.py "$W/model" "$W/data.tokens" "$o" "$STEPS" 8 || exit 1
        fi
        got=$(mean "$o")
        python3 - "$W/train-$n.json" "$o" "$n" "$mode" "$ref" "$got" <<'PY' | tee -a "$summary"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
n, mode, ref, got = sys.argv[3], sys.argv[4], float(sys.argv[5]), float(sys.argv[6])
dl = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
print("gpus=%s %-5s loom train %9.0f tok/s  python %9.0f tok/s  ratio %.4f  loss step 1 %.6f / "
      "%.6f, max |loss diff| %.2e" % (n, mode, ref, got, got / ref, a["losses"][0],
                                      b["losses"][0], dl))
PY
    done
done
[ -n "${OUT:-}" ] && cp "$summary" "$W"/*.json "$OUT"/ 2>/dev/null
exit 0
