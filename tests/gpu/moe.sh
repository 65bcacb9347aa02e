#!/usr/bin/env bash
# Mixture of experts on GPUs: the MoE ops against the CPU (test_backend_ops),
# tiny-qwen3-moe and tiny-qwen2-moe (tests/fixtures_moe) against the HF
# fixtures on one GPU (fp32), LoRA on the experts and Qwen2-MoE's shared
# expert (test_moe_shared) against the CPU, then with 2+ GPUs the expert layouts against one
# GPU: `loom golden` (loss, log-probs, every gradient, the weights after 3
# AdamW steps) of tiny-qwen3-moe with its load-balancing loss, compared by
# tests/gpu/compare.py golden (fp32 within 1e-5; bf16 within 3% where tp
# does not split the experts' sums: under tp, bf16 rounding of the partial
# sums moves a few near-tie tokens to another expert, whose few-token
# gradient then jumps; fp32 is the exact check of those layouts, and of
# the default once-per-rank dispatch under ep, whose ranks' partial sums
# are rounded alike; names ending -choice send once per choice,
# LOOM_MOE_DEDUP=0, which bf16 checks too); then
# Megatron's router options (z-loss, capacity under both drop policies) in
# fp32 on ep2 against one GPU; with 4+ GPUs the four-rank expert layouts.
# Usage: bash tests/gpu/moe.sh [BUILD_DIR]   (built when missing)
# LOOM_MOE_PARTS="ops layouts router four" (the default: all) runs some of
# the parts: the op tests, the 2-GPU layouts, the router options on ep2, the
# 4-GPU layouts. Each layout's line ends with its run's seconds.
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build-cuda}
py_lib() { python3 -c "import importlib.util as u; s=u.find_spec('nvidia.$1'); print(list(s.submodule_search_locations)[0]+'/lib' if s else '')" 2>/dev/null || true; }
export LD_LIBRARY_PATH="$(py_lib nccl):$(py_lib cudnn):${LD_LIBRARY_PATH:-}"
export LOOM_COMM_TIMEOUT=${LOOM_COMM_TIMEOUT:-120}
[ -x "$B/loom_tests" ] || make -j"$(nproc)" CUDA=1 BUILD="$B" config "$B/loom" "$B/loom_tests" > /tmp/moe-build.log 2>&1 || { tail -30 /tmp/moe-build.log; exit 1; }
PARTS=" ${LOOM_MOE_PARTS:-ops layouts router four} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
rc=0
if part ops; then
LOOM_BIN=$B/loom $B/loom_tests backend_ moe_ model_cuda_qwen3_moe lora_moe_cuda \
    model_qwen3_moe model_cuda_qwen2_moe model_qwen2_moe 2>&1 | tee /tmp/moe-tests.log | grep -vE "^ok " || true
grep -q "^FAIL" /tmp/moe-tests.log && rc=1
echo "tests: $(grep -c '^ok ' /tmp/moe-tests.log) ok, $(grep -c '^FAIL' /tmp/moe-tests.log) failed, $(grep -c '^skip' /tmp/moe-tests.log) skipped"
fi
ngpu=$(nvidia-smi -L | wc -l)
[ "$ngpu" -ge 2 ] || exit $rc
W=${LOOM_GPU_WORK:-/tmp/loom-gpu-moe}
rm -rf "$W" && mkdir -p "$W"
F=${LOOM_FIXTURES:-tests/fixtures}
M=$F/models/tiny-qwen3-moe
BATCH=$F/golden/tiny-qwen3-moe.safetensors
G="$B/loom golden --device cuda --model $M --batch $BATCH --steps 3 --lr 1e-3 --log-level warn --config-override {\"router_aux_loss_coef\":0.1}"
part layouts && for dt in fp32 bf16; do
    tol="--tol 0.03"
    [ $dt = fp32 ] && tol="--tol 1e-5 --tol-weights 5e-5"
    for nm in 1 2; do
        $G --dtype $dt --num-micro-batches $nm --out "$W/ref-$dt-$nm.safetensors" > "$W/ref-$dt-$nm.log" 2>&1 || { tail "$W/ref-$dt-$nm.log"; rc=1; }
    done
    # name, dtypes, micro-batches of the one-GPU reference, flags
    while read -r name dts nm flags; do
        [ -n "$name" ] || continue
        [[ ",$dts," == *",$dt,"* ]] || continue
        out="$W/$name-$dt"
        # shellcheck disable=SC2086
        env=""; [[ "$name" == *-choice ]] && env="LOOM_MOE_DEDUP=0"
        # shellcheck disable=SC2086
        SECONDS=0
        if env $env CUDA_VISIBLE_DEVICES=0,1 $G --dtype $dt --nproc-per-node 2 $flags --out "$out.safetensors" > "$out.log" 2>&1; then
            # shellcheck disable=SC2086
            res=$(python3 tests/gpu/compare.py golden "$W/ref-$dt-$nm.safetensors" "$out.safetensors" $tol 2>&1)
            c=$?
            printf '%-14s %-5s %-4s %s (%d s)\n' "$name" "$dt" "$([ $c = 0 ] && echo ok || echo FAIL)" "$(echo "$res" | tail -1)" "$SECONDS"
            [ $c = 0 ] || { echo "$res"; rc=1; }
        else
            printf '%-14s %-5s FAIL exit status (log %s)\n' "$name" "$dt" "$out.log"
            tail -15 "$out.log"
            rc=1
        fi
    done <<'EOF'
ep2            fp32      2 --ep 2
ep2-choice     fp32,bf16 2 --ep 2
tp2-sp         fp32      1 --tp 2 --sequence-parallel
ep2-tp2-etp1   fp32      1 --ep 2 --tp 2 --etp 1 --sequence-parallel
tp2-etp1       fp32      1 --tp 2 --etp 1 --sequence-parallel
pp2            fp32,bf16 1 --pp 2
EOF
done
# Megatron's router options (the z-loss, a capacity under each drop policy)
# in fp32 on ep2, whose ranks route the one GPU's micro-batches
part router && for opt in "--moe-z-loss-coeff 0.1" "--moe-expert-capacity-factor 0.75" \
           "--moe-expert-capacity-factor 0.75 --moe-token-drop-policy position --moe-z-loss-coeff 0.1"; do
    tag=$(echo "$opt" | tr -d ' -' | cut -c1-40)
    # shellcheck disable=SC2086
    $G --dtype fp32 --num-micro-batches 2 $opt --out "$W/ref-$tag.safetensors" > "$W/ref-$tag.log" 2>&1 || { tail "$W/ref-$tag.log"; rc=1; continue; }
    # shellcheck disable=SC2086
    SECONDS=0
    if CUDA_VISIBLE_DEVICES=0,1 $G --dtype fp32 --nproc-per-node 2 --ep 2 $opt --out "$W/ep2-$tag.safetensors" > "$W/ep2-$tag.log" 2>&1; then
        res=$(python3 tests/gpu/compare.py golden "$W/ref-$tag.safetensors" "$W/ep2-$tag.safetensors" --tol 1e-5 --tol-weights 5e-5 2>&1)
        c=$?
        printf 'ep2 %-70s %s (%d s)\n' "$opt" "$([ $c = 0 ] && echo ok || echo FAIL) $(echo "$res" | tail -1)" "$SECONDS"
        [ $c = 0 ] || { echo "$res"; rc=1; }
    else
        printf 'ep2 %s FAIL exit status (log %s)\n' "$opt" "$W/ep2-$tag.log"
        tail -15 "$W/ep2-$tag.log"
        rc=1
    fi
done
# with 4+ GPUs the four-rank layouts of test_parallel.c's list, fp32 against
# one GPU cut into the same micro-batches: etp 2 x ep 2 under tp 2, ep 2 x
# pp 2, ep 2 folded out of dp 4 (edp 2), ep 4; the dp 4 ones on an 8-row
# batch (the fixture's 2 rows four times)
{ [ "$ngpu" -ge 4 ] && part four; } || exit $rc
B8=$W/batch8.safetensors
python3 - "$BATCH" "$B8" <<'PY' || { echo "FAIL: could not write the 8-row batch"; exit 1; }
import sys
import numpy as np
from safetensors.numpy import load_file, save_file
b = load_file(sys.argv[1])
save_file({k: np.concatenate([b[k]] * 4).astype(np.int64) for k in ("input_ids", "targets")}, sys.argv[2])
PY
G4="$B/loom golden --device cuda --model $M --steps 3 --lr 1e-3 --log-level warn --dtype fp32 --config-override {\"router_aux_loss_coef\":0.1}"
for nm in 2 4; do
    bt=$BATCH; [ $nm = 4 ] && bt=$B8
    # shellcheck disable=SC2086
    $G4 --batch "$bt" --num-micro-batches $nm --out "$W/ref4-$nm.safetensors" > "$W/ref4-$nm.log" 2>&1 || { tail "$W/ref4-$nm.log"; rc=1; }
done
while read -r name nm flags; do
    [ -n "$name" ] || continue
    bt=$BATCH; [ $nm = 4 ] && bt=$B8
    # shellcheck disable=SC2086
    SECONDS=0
    if CUDA_VISIBLE_DEVICES=0,1,2,3 $G4 --batch "$bt" --nproc-per-node 4 $flags --out "$W/$name.safetensors" < /dev/null > "$W/$name.log" 2>&1; then
        res=$(python3 tests/gpu/compare.py golden "$W/ref4-$nm.safetensors" "$W/$name.safetensors" --tol 1e-5 --tol-weights 5e-5 2>&1)
        c=$?
        printf '%-14s fp32  %-4s %s (%d s)\n' "$name" "$([ $c = 0 ] && echo ok || echo FAIL)" "$(echo "$res" | tail -1)" "$SECONDS"
        [ $c = 0 ] || { echo "$res"; rc=1; }
    else
        printf '%-14s fp32  FAIL exit status (log %s)\n' "$name" "$W/$name.log"
        tail -15 "$W/$name.log"
        rc=1
    fi
done <<'EOF'
ep2-etp2-tp2   2 --ep 2 --etp 2 --tp 2 --sequence-parallel
ep2-pp2        2 --ep 2 --pp 2
ep2-dp4        4 --ep 2 --dp 4
ep4            4 --ep 4
EOF
exit $rc
