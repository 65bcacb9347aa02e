#!/usr/bin/env bash
# Checkpoints where transformers, PEFT and a GPU are (issue 35):
#  1. exports of a resumed run load in transformers and PEFT with the
#     uninterrupted run's logits: a run saved at step 3 and resumed to 6,
#     then `loom convert --from-checkpoint` (--to hf, --to peft, --to hf
#     --merge-lora), checked by tests/hf_check.py / tests/peft_check.py
#     against `loom golden` on what the uninterrupted run saved itself;
#  2. CPU to GPU and back: saved on the CPU, resumed on a GPU in fp32
#     (deterministic attention), and the other way, against the
#     uninterrupted CPU run's losses (1e-5 relative).
# Usage: bash tests/gpu/ckpt_exports.sh [BUILD]   (BUILD: a CUDA build dir,
#        default build-cuda; made when missing). Needs torch, transformers,
#        peft, safetensors.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. tests/gpu/exports_lib.sh
exports_setup ckpt "${1:-build-cuda}"
M=tests/fixtures/models/tiny-qwen3
BATCH=tests/fixtures/golden/tiny-qwen3.safetensors
make_tokens 3 || exit 1
tr() { $L train --model $M --data "$W/t.tokens" --seq-len 32 --global-batch-size 4 --lr 3e-3 \
       --lr-warmup-steps 2 --no-progress --log-level warn "$@"; }
losses() { python3 -c "import json,sys; print(' '.join('%.9g' % json.loads(l)['loss'] for l in open(sys.argv[1])))" "$1"; }
close() { # close A B: the losses of two metrics files within 1e-5 relative, same count
    python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
bad = [i for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > 1e-5 * abs(x)]
print("  uninterrupted:", " ".join("%.9g" % x for x in a))
print("  resumed:      ", " ".join("%.9g" % x for x in b))
sys.exit(0 if len(a) == len(b) and not bad else 1)
PY
}

echo "== 1. exports of a resumed run, in transformers and PEFT"
# full fine-tuning: uninterrupted with --save-hf; saved at 3, resumed to 6, converted
run tr --device cpu --train-steps 6 --save-hf "$W/u_hf"
run tr --device cpu --train-steps 3 --save "$W/ck"
run tr --device cpu --train-steps 6 --load "$W/ck" --save "$W/ck"
run $L convert --from-checkpoint "$W/ck" --to hf --out "$W/c_hf" --log-level warn
run $L golden --device cpu --model "$W/u_hf" --batch $BATCH --out "$W/g_full.safetensors" --log-level warn
python3 tests/hf_check.py "$W/c_hf" "$W/g_full.safetensors" $BATCH || fails=$((fails + 1))
# LoRA: uninterrupted with --save-adapter; resumed; --to peft and --to hf --merge-lora
lo=(--lora-r 4 --lora-alpha 8 --seed 7)
run tr --device cpu "${lo[@]}" --train-steps 6 --save-adapter "$W/u_ad"
run tr --device cpu "${lo[@]}" --train-steps 3 --save "$W/lck"
run tr --device cpu "${lo[@]}" --train-steps 6 --load "$W/lck" --save "$W/lck"
run $L convert --from-checkpoint "$W/lck" --to peft --out "$W/c_ad" --log-level warn
run $L convert --from-checkpoint "$W/lck" --to hf --merge-lora --out "$W/c_merged" --log-level warn
run $L golden --device cpu --model $M --adapter "$W/u_ad" --batch $BATCH --out "$W/g_lora.safetensors" --log-level warn
python3 tests/peft_check.py $M "$W/c_ad" "$W/g_lora.safetensors" $BATCH || fails=$((fails + 1))
python3 tests/hf_check.py "$W/c_merged" "$W/g_lora.safetensors" $BATCH || fails=$((fails + 1))

echo "== 2. CPU to GPU and back (fp32, deterministic attention)"
export LOOM_ATTN_DETERMINISTIC=1
rm -rf "$W"/*.jsonl "$W/x"
run tr --device cpu --train-steps 6 --metrics-file "$W/u.jsonl"
run tr --device cpu --train-steps 3 --save "$W/x" --metrics-file "$W/cg.jsonl"
run tr --device cuda --dtype fp32 --train-steps 6 --load "$W/x" --metrics-file "$W/cg.jsonl"
echo "CPU saved, GPU resumed:"
close "$W/u.jsonl" "$W/cg.jsonl" && echo "ok   cpu->gpu" || { echo "FAIL cpu->gpu"; fails=$((fails + 1)); }
rm -rf "$W/x"
run tr --device cuda --dtype fp32 --train-steps 3 --save "$W/x" --metrics-file "$W/gc.jsonl"
run tr --device cpu --train-steps 6 --load "$W/x" --metrics-file "$W/gc.jsonl"
echo "GPU saved, CPU resumed:"
close "$W/u.jsonl" "$W/gc.jsonl" && echo "ok   gpu->cpu" || { echo "FAIL gpu->cpu"; fails=$((fails + 1)); }
echo "ckpt_exports: $fails failed"
[ -n "${OUT:-}" ] && cp "$W"/*.log "$OUT"/ 2>/dev/null
rm -rf "$W"
exit $((fails > 0))
