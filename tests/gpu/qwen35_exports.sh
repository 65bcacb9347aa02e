#!/usr/bin/env bash
# Qwen3.5 files out where transformers and PEFT are (issue 38):
#  1. the hub's vision-language checkpoints (tests/fixtures_qwen3_5: dense,
#     and MoE with fused experts) trained 3 steps in full on the CPU and
#     saved (--save-hf): transformers loads each as the vision-language
#     model (Qwen3_5*ForConditionalGeneration) with `loom golden`'s logits
#     (tests/hf_check.py), and the vision tower and mtp head come back byte
#     for byte (tests/st_interop.py same-tensors);
#  2. the text-only layout (loom init --preset tiny-qwen3.5) likewise, as
#     Qwen3_5ForCausalLM;
#  3. an adapter on every linear of both layer kinds (all-linear, in_proj_a,
#     in_proj_b) of the vision-language checkpoint, --save-adapter: PEFT
#     places it (names under model.language_model.) with `loom golden
#     --adapter`'s logits (tests/peft_check.py).
# Usage: bash tests/gpu/qwen35_exports.sh [BUILD]   (default build-cuda; made
#        when missing). Needs torch, transformers >= 5.17 (Qwen3.5), peft,
#        safetensors: the GPU machine has them; loom runs on its CPU.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. tests/gpu/exports_lib.sh
exports_setup qwen35 "${1:-build-cuda}"
F=tests/fixtures_qwen3_5
make_tokens 7 || exit 1
tr() { # tr MODEL args...: 3 steps on the CPU
    local m=$1; shift
    $L train --device cpu --model "$m" --data "$W/t.tokens" --seq-len 32 --global-batch-size 2 \
        --lr 1e-2 --lr-warmup-steps 0 --train-steps 3 --no-progress --log-level warn "$@"
}
gold() { # gold MODEL BATCH OUT [args]
    local m=$1 b=$2 o=$3; shift 3
    $L golden --device cpu --model "$m" --batch "$b" --out "$o" --log-level warn "$@"
}
same_carried() { # the saved directory's model.visual.* and mtp.* equal the source's
    python3 - "$1" "$2" <<'PY'
import sys
from safetensors import safe_open
import glob, os
def tensors(d):
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with safe_open(f, "pt") as s:
            for k in s.keys():
                if k.startswith(("model.visual.", "mtp.")):
                    out[k] = s.get_tensor(k)
    return out
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
bad = [k for k in a if k not in b or a[k].dtype != b[k].dtype or not (a[k] == b[k]).all()]
print(f"{len(a)} carried tensors, {len(bad)} differ: {bad[:3]}")
sys.exit(1 if bad or not a or set(a) != set(b) else 0)
PY
}

echo "== 1. vision-language checkpoints, trained and saved"
for name in tiny-qwen3_5 tiny-qwen3_5-moe; do
    M=$F/models/$name
    BATCH=$F/golden/$name.safetensors
    run tr "$M" --save-hf "$W/$name-hf" &&
        run gold "$W/$name-hf" "$BATCH" "$W/$name.gold.safetensors" &&
        run python3 tests/hf_check.py "$W/$name-hf" "$W/$name.gold.safetensors" "$BATCH" &&
        cat "$W/last.log" && run same_carried "$M" "$W/$name-hf" && cat "$W/last.log"
done

echo "== 2. the text-only layout"
run $L init --preset tiny-qwen3.5 --out "$W/text" --seed 3 --log-level warn &&
    run tr "$W/text" --save-hf "$W/text-hf" &&
    run gold "$W/text-hf" "$F/golden/tiny-qwen3_5.safetensors" "$W/text.gold.safetensors" &&
    run python3 tests/hf_check.py "$W/text-hf" "$W/text.gold.safetensors" \
        "$F/golden/tiny-qwen3_5.safetensors" && cat "$W/last.log"

echo "== 3. an adapter on both layer kinds, placed by PEFT"
M=$F/models/tiny-qwen3_5
BATCH=$F/golden/tiny-qwen3_5.safetensors
run tr "$M" --lora-r 4 --lora-alpha 8 --lora-target all-linear,in_proj_a,in_proj_b \
    --save-adapter "$W/ad" &&
    run gold "$M" "$BATCH" "$W/ad.gold.safetensors" --adapter "$W/ad" &&
    run python3 tests/peft_check.py "$M" "$W/ad" "$W/ad.gold.safetensors" "$BATCH" &&
    cat "$W/last.log"

echo "qwen35 exports: $fails failed (work dir $W)"
exit $((fails > 0))
