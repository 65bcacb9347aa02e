#!/usr/bin/env bash
# Qwen3.5 on one GPU, everything issue 38 asks of it in one call:
#  1. the Gated DeltaNet and zero-centred norm CUDA ops against the CPU's on
#     fresh random inputs (tests/test_backend_gdn.c, test_backend.c's norms,
#     test_cuda_ops.c's RMSNorm);
#  2. the model on the GPU in fp32 against transformers (tests/test_qwen35.c's
#     qwen35_cuda_*: logits, log-probs, entropy, every gradient, packed
#     documents; dense and MoE) and the memory prediction against the run;
#  3. Qwen3.5-0.8B shapes (random weights) trained 50 steps in bf16 and in
#     fp32 on the same data (tests/gpu/train_text.txt, a frozen copy of
#     docs/DESIGN.md): the curves agree within bf16 noise
#     (tests/gpu/compare.py curves);
#  4. with QWEN35_BENCH=1, bench/train_bench.sh q35-4b-lora q35-0.8b-full
#     against transformers + PEFT on the same GPU (peft from .whl).
# Usage: bash tests/gpu/qwen35.sh [BUILD]   (default build-cuda)
#   QWEN35_STEPS="1 2 3" which steps (default all but the benchmark),
#   QWEN35_TIMEOUT=S     limit of each command (default 300 s),
#   LOOM_GPU_WORK=DIR    logs and models (default /tmp/loom-gpu-qwen35).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
py_lib() { python3 -c "import importlib.util as u; s=u.find_spec('nvidia.$1'); print(list(s.submodule_search_locations)[0]+'/lib' if s else '')" 2>/dev/null || true; }
export LD_LIBRARY_PATH="$(py_lib nccl):$(py_lib cudnn):${LD_LIBRARY_PATH:-}"
B=${1:-build-cuda}
W=${LOOM_GPU_WORK:-/tmp/loom-gpu-qwen35}
rm -rf "$W" && mkdir -p "$W"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
make -j"$(nproc)" CUDA=1 BUILD="$B" "$B/loom" "$B/loom_tests" >"$W/build.log" 2>&1 || { tail -40 "$W/build.log"; exit 1; }
fails=0
part=0
STEPS=" ${QWEN35_STEPS:-1 2 3} "
[ "${QWEN35_BENCH:-0}" = 1 ] && STEPS="$STEPS 4 "
T=${QWEN35_TIMEOUT:-300} # seconds, each command: a hang fails its step, not the call
tests() { # tests NAME... : loom_tests on these (log $W/tests-N.log), its summary line
    part=$((part + 1))
    LOOM_BIN=$B/loom timeout "$T" "$B/loom_tests" "$@" >"$W/tests-$part.log" 2>&1 || fails=$((fails + 1))
    grep -E '^(FAIL|skip) |passed' "$W/tests-$part.log"
    grep -B2 -A12 '^FAIL' "$W/tests-$part.log" | head -80
}
step() { [[ "$STEPS" == *" $1 "* ]]; }
step 1 && echo "== 1. the ops against the CPU's" &&
tests backend_gdn backend_norm backend_elementwise cuda_ops_gate cuda_ops_rmsnorm cuda_ops_fused_norms \
    cuda_ops_attention
step 2 && echo "== 2. the model in fp32 against transformers, and the memory prediction" &&
    tests qwen35_cuda memory_prediction
if step 3; then
echo "== 3. Qwen3.5-0.8B shapes, 50 steps, bf16 against fp32"
"$B/loom" init --preset qwen3.5-0.8b --out "$W/m08" --seed 7 >/dev/null &&
    "$B/loom" data --text tests/gpu/train_text.txt --out "$W/d.tokens" >/dev/null || fails=$((fails + 1))
for dt in fp32 bf16; do
    timeout "$T" "$B/loom" train --device cuda --dtype $dt --model "$W/m08" --data "$W/d.tokens" \
        --train-steps 50 --seq-len 1024 --micro-batch-size 2 --global-batch-size 4 --lr 3e-4 \
        --lr-warmup-steps 5 2>&1 | tee "$W/train-$dt.log" |
        grep -E "^(step +(1|10|25|50)/|trained|memory)" || fails=$((fails + 1))
done
python3 tests/gpu/compare.py curves "$W/train-fp32.log" "$W/train-bf16.log" || fails=$((fails + 1))
fi
if step 4; then
    echo "== 4. speed against transformers + PEFT"
    LOOM_BIN=$B/loom bash bench/train_bench.sh q35-4b-lora q35-0.8b-full || fails=$((fails + 1))
fi
echo "qwen35 on the GPU: $fails failed (work dir $W)"
[ "$fails" = 0 ]
