#!/usr/bin/env bash
# The model on one GPU: the fixture tests on CUDA (tests/test_model.c's
# model_cuda_*), then a Qwen3-0.6B-shaped model with random weights trained
# 50 steps in bf16 and in fp32 on the same data; the two loss curves must
# agree within bf16 noise (tests/gpu/compare.py curves); then activation
# recomputation against none, byte for byte (LoRA, deterministic attention).
# Usage: bash tests/gpu/model.sh [BUILD_DIR]   (default build-cuda, built by tests/gpu/run.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build-cuda}
py_lib() { python3 -c "import importlib.util as u; s=u.find_spec('nvidia.$1'); print(list(s.submodule_search_locations)[0]+'/lib' if s else '')" 2>/dev/null || true; }
export LD_LIBRARY_PATH="$(py_lib nccl):$(py_lib cudnn):${LD_LIBRARY_PATH:-}"
W=${LOOM_GPU_WORK:-/tmp/loom-gpu-model}
rm -rf "$W" && mkdir -p "$W"
LOOM_BIN=$B/loom $B/loom_tests model_cuda
# a Qwen3-0.6B-shaped model (28 layers, hidden 1024, vocab 151936), random weights
$B/loom init --preset qwen3-0.6b --out "$W/m06" --seed 7 >/dev/null
# the text: a frozen copy of docs/DESIGN.md, so that editing the docs does not change the runs
$B/loom data --text tests/gpu/train_text.txt --out "$W/d.tokens" >/dev/null
for dt in fp32 bf16; do
    $B/loom train --device cuda --dtype $dt --model "$W/m06" --data "$W/d.tokens" --train-steps 50 \
        --seq-len 1024 --micro-batch-size 2 --global-batch-size 4 --lr 3e-4 --lr-warmup-steps 5 \
        2>&1 | tee "$W/train-$dt.log" | grep -E "^(step +(1|10|25|50)/|trained|memory)" || true
done
python3 tests/gpu/compare.py curves "$W/train-fp32.log" "$W/train-bf16.log"
# Activation recomputation on the GPU: with the bitwise-repeatable attention
# backward, `--recompute mlp` and `--recompute full` give the golden file of
# the run without it byte for byte (LoRA with dropout: no atomics left in the
# step; the masks are drawn again).
F=${LOOM_FIXTURES:-tests/fixtures}
mkdir -p "$W/dad"
cp "$F/models/tiny-qwen3-lora/adapter_model.safetensors" "$W/dad/"
echo '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.2, "target_modules": "all-linear"}' > "$W/dad/adapter_config.json"
for r in none mlp full; do
    LOOM_ATTN_DETERMINISTIC=1 $B/loom golden --device cuda --dtype bf16 --model "$F/models/tiny-qwen3" \
        --batch "$F/golden/tiny-qwen3-lora.safetensors" --adapter "$W/dad" --steps 3 --lr 1e-3 \
        --recompute $r --out "$W/rc-$r.safetensors" --log-level warn
done
cmp "$W/rc-none.safetensors" "$W/rc-mlp.safetensors" && cmp "$W/rc-none.safetensors" "$W/rc-full.safetensors" &&
    echo "recompute: mlp and full give the same golden file as none on the GPU"
