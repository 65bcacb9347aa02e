#!/usr/bin/env bash
# Checkpoints on a GPU (issue 35): a bf16 Qwen3-0.6B-shaped full fine-tuning
# run saved at step 3 and resumed, against the uninterrupted run, bitwise
# with deterministic attention (LOOM_ATTN_DETERMINISTIC=1); and the step's
# pause for a save (the state copied to host memory) beside the background
# write's time, for 0.6B full fine-tuning and Qwen3-4B LoRA.
# Usage: bash bench/ckpt_bench.sh   (OUT: where the logs and summary go;
#        LOOM_CKPT_BENCH_PARTS="resume pause" picks the parts)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
W=${LOOM_BENCH_DIR:-/tmp/loom-ckpt}
mkdir -p "$W"
make -j"$(nproc)" CUDA=1 BUILD=build-cuda build-cuda/loom build-cuda/libloom.so >"$W/build.log" 2>&1 \
    || { tail -30 "$W/build.log"; exit 1; }
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} LOOM_LIBRARY=$PWD/build-cuda/libloom.so
export NCCL_NVLS_ENABLE=0
L=build-cuda/loom
summary="$W/summary.txt"; : >"$summary"
for preset in qwen3-0.6b qwen3-4b; do
    [ -d "$W/$preset" ] || $L init --preset "$preset" --out "$W/$preset" --save-dtype bfloat16 --log-level warn || exit 1
done
python3 - "$W/data.tokens" <<'PY' || exit 1
import sys, numpy as np, loom
rng = np.random.default_rng(0)
loom.write_tokens(sys.argv[1], [{"input_ids": rng.integers(0, 151936, 4096)} for _ in range(64)], 151936)
PY
common=(--data "$W/data.tokens" --seq-len 4096 --micro-batch-size 1 --lr 1e-5 --lr-warmup-steps 2
        --no-progress --log-level info)
losses() { python3 -c "import json,sys; print(' '.join('%.9f' % json.loads(l)['loss'] for l in open(sys.argv[1])))" "$1"; }

PARTS=${LOOM_CKPT_BENCH_PARTS:-resume pause}
# 1. bitwise resume, bf16 full fine-tuning, deterministic attention
if [[ " $PARTS " == *" resume "* ]]; then
export LOOM_ATTN_DETERMINISTIC=1
rm -rf "$W/ck" "$W"/*.jsonl
$L train --model "$W/qwen3-0.6b" "${common[@]}" --global-batch-size 2 --train-steps 6 \
    --metrics-file "$W/full.jsonl" >"$W/full.log" 2>&1 || { tail "$W/full.log"; exit 1; }
$L train --model "$W/qwen3-0.6b" "${common[@]}" --global-batch-size 2 --train-steps 3 \
    --save "$W/ck" --metrics-file "$W/first.jsonl" >"$W/first.log" 2>&1 || { tail "$W/first.log"; exit 1; }
$L train --model "$W/qwen3-0.6b" "${common[@]}" --global-batch-size 2 --train-steps 6 \
    --load "$W/ck" --metrics-file "$W/resumed.jsonl" >"$W/resumed.log" 2>&1 || { tail "$W/resumed.log"; exit 1; }
a=$(losses "$W/full.jsonl"); b=$(losses "$W/first.jsonl")" "$(losses "$W/resumed.jsonl")
echo "0.6B bf16 deterministic: uninterrupted: $a" | tee -a "$summary"
echo "0.6B bf16 deterministic: saved at 3 and resumed: $b" | tee -a "$summary"
[ "$a" = "$b" ] && echo "bitwise: yes" | tee -a "$summary" || echo "bitwise: NO" | tee -a "$summary"
unset LOOM_ATTN_DETERMINISTIC
fi

# 2. the pause and the background write (save every 2 steps)
[[ " $PARTS " == *" pause "* ]] && for c in "qwen3-0.6b full:" "qwen3-4b lora:--lora-r 8 --lora-alpha 16"; do
    preset=${c%%:*}; preset=${preset% *}; kind=${c%%:*}; kind=${kind#* }; extra=${c#*:}
    rm -rf "$W/ck2"
    # shellcheck disable=SC2086
    $L train --model "$W/$preset" "${common[@]}" --global-batch-size 2 --train-steps 6 \
        --save "$W/ck2" --save-interval 2 $extra >"$W/save-$preset.log" 2>&1 || { tail "$W/save-$preset.log"; exit 1; }
    du -sh "$W/ck2"/iter_0000006 | awk -v p="$preset $kind" '{print p ": checkpoint size " $1}' | tee -a "$summary"
    grep -o "state copied in [0-9.]* s\|written ([0-9.]* s in the background)" "$W/save-$preset.log" \
        | paste -sd ' ' | sed "s/^/$preset $kind: /" | tee -a "$summary"
    grep -o "step [0-9]*/6 | loss [0-9.]* | grad norm [0-9.]* | lr [0-9.e+-]* | [0-9]* tokens/s" "$W/save-$preset.log" \
        | tail -3 | sed "s/^/  /" | tee -a "$summary"
done
[ -n "${OUT:-}" ] && cp "$summary" "$W"/*.log "$OUT"/ 2>/dev/null
exit 0
