#!/usr/bin/env bash
# Two loom builds on one GPU, the same runs with each, outputs compared byte
# for byte: for refactors that must not change results (issue 36's layer
# table). bf16 goldens of the fixtures (LoRA with and without dropout, full
# fine-tuning with biases; each recomputation mode) and a Qwen3-0.6B-shaped
# 4-layer model trained with LoRA (all-linear, and a subset under
# --recompute mlp) and in full (--recompute full), its adapters, HF export
# and loss lines. A runs twice (its own repeatability), B once. The
# attention's deterministic backward is asked for (LOOM_ATTN_DETERMINISTIC).
# Usage: bash tests/gpu/same_bits.sh BIN_A BIN_B
#   e.g. BIN_A built from the commit before: git archive BASE | tar -x -C
#   /tmp/base && make -C /tmp/base CUDA=1 BUILD=build-cuda build-cuda/loom
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
[ $# -eq 2 ] || { sed -n '2,14p' "$0"; exit 2; }
A=$(readlink -f "$1") B=$(readlink -f "$2")
export LOOM_ATTN_DETERMINISTIC=1
py_lib() { python3 -c "import importlib.util as u; s=u.find_spec('nvidia.$1'); print(list(s.submodule_search_locations)[0]+'/lib' if s else '')" 2>/dev/null || true; }
export LD_LIBRARY_PATH="$(py_lib nccl):$(py_lib cudnn):${LD_LIBRARY_PATH:-}"
F=${LOOM_FIXTURES:-tests/fixtures}
W=${LOOM_GPU_WORK:-/tmp/loom-same-bits}
rm -rf "$W" && mkdir -p "$W/dad"
"$A" init --preset qwen3-0.6b --config-override '{"num_hidden_layers": 4}' --out "$W/m06" --seed 7 \
    --save-dtype bfloat16 --log-level warn >/dev/null || exit 1
"$A" data --text tests/gpu/train_text.txt --out "$W/d.tokens" --log-level warn >/dev/null || exit 1
cp "$F/models/tiny-qwen3-lora/adapter_model.safetensors" "$W/dad/"
echo '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.2, "target_modules": "all-linear"}' \
    >"$W/dad/adapter_config.json"
G=(golden --device cuda --dtype bf16 --steps 3 --lr 1e-3 --log-level warn)
T=(train --device cuda --dtype bf16 --model "$W/m06" --data "$W/d.tokens" --seq-len 2048
   --micro-batch-size 1 --global-batch-size 2 --lr 3e-4 --log-level info)
fail=0
runs() { # BIN DIR
    local bin=$1 d=$2 rc f
    mkdir -p "$d"
    for rc in none mlp full; do
        "$bin" "${G[@]}" --model "$F/models/tiny-qwen3" --batch "$F/golden/tiny-qwen3-lora.safetensors" \
            --adapter "$F/models/tiny-qwen3-lora" --recompute $rc --out "$d/lora-$rc.safetensors" || fail=1
        "$bin" "${G[@]}" --model "$F/models/tiny-qwen3" --batch "$F/golden/tiny-qwen3-lora.safetensors" \
            --adapter "$W/dad" --recompute $rc --out "$d/drop-$rc.safetensors" || fail=1
        "$bin" "${G[@]}" --model "$F/models/tiny-qwen2" --batch "$F/golden/tiny-qwen2.safetensors" \
            --recompute $rc --out "$d/qwen2-$rc.safetensors" || fail=1
    done
    "$bin" "${T[@]}" --train-steps 4 --lora-r 16 --save-adapter "$d/lora" >"$d/lora.log" 2>&1 || fail=1
    "$bin" "${T[@]}" --train-steps 4 --lora-r 16 --lora-target q_proj,v_proj,down_proj --recompute mlp \
        --save-adapter "$d/lora-sub" >"$d/lora-sub.log" 2>&1 || fail=1
    "$bin" "${T[@]}" --train-steps 3 --recompute full --save-hf "$d/full" >"$d/full.log" 2>&1 || fail=1
    for f in "$d"/*.log; do
        grep -oE "step [0-9]+/[0-9]+ \| loss [0-9.]+ \| grad norm [0-9.e+-]+" "$f" >"${f%.log}.loss"
    done
}
same() { # DIR1 DIR2
    local n=0 bad=0 f
    for f in $(cd "$1" && find . -type f \( -name '*.safetensors' -o -name '*.loss' -o -name '*.json' \) | sort); do
        n=$((n + 1))
        cmp -s "$1/$f" "$2/$f" || { echo "  differ: $f"; bad=$((bad + 1)); }
    done
    echo "  $n files, $bad differ"
    [ $bad -eq 0 ]
}
runs "$A" "$W/a" && runs "$B" "$W/b" && runs "$A" "$W/a2"
[ $fail -eq 0 ] || { echo "same_bits: a run failed (logs in $W)"; exit 1; }
echo "A against A (repeatability):"
same "$W/a" "$W/a2" || fail=1
echo "A against B:"
same "$W/a" "$W/b" || fail=1
[ $fail -eq 0 ] && echo "same_bits: B gives A's bits" || echo "same_bits: the bits differ"
exit $fail
