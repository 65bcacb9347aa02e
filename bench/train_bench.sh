#!/usr/bin/env bash
# Training throughput, memory and loss: loom against Hugging Face transformers
# (+ PEFT for LoRA) on the same GPU, same random-weight Qwen3 model directory,
# same documents in the same order (issue 8). See bench/README.md.
#
# Usage: bash bench/train_bench.sh [case ...]
#   cases: 0.6b-full 4b-lora 8b-lora (default: all three, in this order);
#          30b-a3b-lora (Qwen3-MoE), q35-4b-lora q35-0.8b-full (Qwen3.5);
#          tiny-full tiny-lora tiny-moe-lora tiny-q35-lora are smoke tests of
#          the script itself.
# Environment (all optional):
#   LOOM_BIN=PATH            use this loom binary (default: build build-cuda/loom)
#   LOOM_BENCH_DIR=DIR       work dir (default /tmp/loom-bench); logs under DIR/CASE/
#   LOOM_BENCH_STEPS=N       steps of every case (default 30; 25 for 8b-lora)
#   LOOM_BENCH_GA=G          micro-batches an optimizer step (default 1): loom
#                            --global-batch-size G x micro-batch, the peer
#                            --grad-accum G; tokens/s counts all of a step's
#                            micro-batches
#   LOOM_BENCH_MB=B          sequences a micro-batch (default: the case's, 1 or 2)
#   LOOM_BENCH_SEQ_LEN=S     tokens per row (default 4096)
#   LOOM_BENCH_LR=X          learning rate, constant (default 1e-4)
#   LOOM_BENCH_WARMUP=N      steps left out of the tokens/s mean (default 3)
#   LOOM_BENCH_PEAK_TFLOPS=X peak for MFU (default 989.4, H100 SXM dense bf16)
#   LOOM_BENCH_SIDES="loom peer"  which sides to run
#   LOOM_BENCH_KEEP_MODELS=1 keep the model directories (default: deleted after each case)
#   LOOM_BENCH_RUN_TIMEOUT=S limit of each run (init, loom, peer; default 300 s)
#   LOOM_BENCH_LAYERS=N      the preset with N layers (num_hidden_layers; default: the preset's)
#   LOOM_BENCH_EMBED_STD=X   the random model's token embedding std (loom init
#                            --init-embedding-std; default: the preset's 0.02). A
#                            random MoE routes nearly all of a layer's tokens to the
#                            same few experts with either (1 evened it only at small
#                            width); for even routing pass loom
#                            --moe-router-force-load-balancing in LOOM_BENCH_LOOM_ARGS
#   LOOM_BENCH_OUT=DIR       copy logs and the summary here (default $OUT when set)
#   LOOM_BENCH_DEVICE, LOOM_BENCH_DTYPE, LOOM_BENCH_PEER_ARGS, LOOM_BENCH_LOOM_ARGS:
#                            for CPU smoke tests (cuda, bf16, "", "")
#   PYTHON=python3           the Python with torch, transformers and peft
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}
W=${LOOM_BENCH_DIR:-/tmp/loom-bench}
SEQ=${LOOM_BENCH_SEQ_LEN:-4096}
LR=${LOOM_BENCH_LR:-1e-4}
WARMUP=${LOOM_BENCH_WARMUP:-3}
PEAK=${LOOM_BENCH_PEAK_TFLOPS:-989.4}
DEVICE=${LOOM_BENCH_DEVICE:-cuda}
LDTYPE=${LOOM_BENCH_DTYPE:-bf16}
SIDES=${LOOM_BENCH_SIDES:-loom peer}
KEEP=${LOOM_BENCH_KEEP_MODELS:-0}
RUN_TIMEOUT=${LOOM_BENCH_RUN_TIMEOUT:-300}
OUTDIR=${LOOM_BENCH_OUT:-${OUT:-}}
LAYERS=${LOOM_BENCH_LAYERS:-}
GA=${LOOM_BENCH_GA:-1}
MB_SET=${LOOM_BENCH_MB:-}
[[ -z $MB_SET || ( $MB_SET =~ ^[1-9][0-9]*$ && $MB_SET -le 1024 ) ]] || { echo "train_bench.sh: LOOM_BENCH_MB=$MB_SET: give the sequences a micro-batch, 1 to 1024" >&2; exit 2; }
[[ $GA =~ ^[1-9][0-9]*$ ]] && [ "$GA" -le 1024 ] || { echo "train_bench.sh: LOOM_BENCH_GA=$GA: give the micro-batches an optimizer step takes, 1 to 1024" >&2; exit 2; }
[[ -z $LAYERS || $LAYERS =~ ^[1-9][0-9]*$ ]] || { echo "train_bench.sh: LOOM_BENCH_LAYERS=$LAYERS: give a number of layers" >&2; exit 2; }
INIT_EXTRA=()
[ -n "$LAYERS" ] && INIT_EXTRA=(--config-override "{\"num_hidden_layers\": $LAYERS}")
EMBED_STD=${LOOM_BENCH_EMBED_STD:-}
[ -n "$EMBED_STD" ] && INIT_EXTRA+=(--init-embedding-std "$EMBED_STD")
MODEL_TAG="seed 1 bfloat16${LAYERS:+ layers $LAYERS}${EMBED_STD:+ embed-std $EMBED_STD}"
read -r -a PEER_EXTRA <<< "${LOOM_BENCH_PEER_ARGS:-}"
read -r -a LOOM_EXTRA <<< "${LOOM_BENCH_LOOM_ARGS:-}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# case -> preset, LoRA rank (0: full fine-tuning), micro-batch, default steps
case_cfg() {
    case "$1" in
        0.6b-full) PRESET=qwen3-0.6b; LORA_R=0; MB=2; STEPS=30 ;;
        4b-lora)   PRESET=qwen3-4b;   LORA_R=8; MB=1; STEPS=30 ;;
        8b-lora)   PRESET=qwen3-8b;   LORA_R=8; MB=1; STEPS=25 ;;
        30b-a3b-lora) PRESET=qwen3-30b-a3b; LORA_R=8; MB=1; STEPS=10 ;;
        q35-4b-lora) PRESET=qwen3.5-4b; LORA_R=8; MB=1; STEPS=20 ;;
        q35-0.8b-full) PRESET=qwen3.5-0.8b; LORA_R=0; MB=1; STEPS=20 ;;
        tiny-q35-lora) PRESET=tiny-qwen3.5; LORA_R=8; MB=1; STEPS=10 ;;
        tiny-moe-lora) PRESET=tiny-qwen3-moe; LORA_R=8; MB=1; STEPS=10 ;;
        tiny-full) PRESET=tiny-qwen3; LORA_R=0; MB=2; STEPS=10 ;;
        tiny-lora) PRESET=tiny-qwen3; LORA_R=8; MB=1; STEPS=10 ;;
        *) return 1 ;;
    esac
    STEPS=${LOOM_BENCH_STEPS:-$STEPS}
    MB=${MB_SET:-$MB}
    LORA_ALPHA=16
}

CASES=("$@")
[ ${#CASES[@]} -eq 0 ] && CASES=(0.6b-full 4b-lora 8b-lora)
VOCAB=151936
NDOCS=1
for c in "${CASES[@]}"; do
    if ! case_cfg "$c"; then
        echo "train_bench.sh: unknown case '$c' (0.6b-full 4b-lora 8b-lora tiny-full tiny-lora)" >&2
        exit 2
    fi
    case "$PRESET" in tiny-*) VOCAB=1024 ;; esac # the tiny models' vocabulary
    [ $((STEPS * MB * GA)) -gt "$NDOCS" ] && NDOCS=$((STEPS * MB * GA))
done

mkdir -p "$W" || exit 1
T0=$SECONDS
RUN_TIMEOUT_NAME=LOOM_BENCH_RUN_TIMEOUT
DRY=0
. bench/lib.sh # say, show_cmd, run_logged

main() { # (body not indented: it holds a Python snippet)
echo "=================== loom vs HF transformers/PEFT training benchmark ==================="
echo "date:    $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "host:    $(hostname); CPU: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"
GPU_NAME="no GPU"
if command -v nvidia-smi > /dev/null; then
    GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -1)
    echo "GPU:     $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
    echo "GPU use: $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>&1 | head -1) (before the runs)"
else
    echo "GPU:     no nvidia-smi"
fi
echo "repo:    $(git rev-parse --short HEAD 2>/dev/null || echo '?')$( [ -n "$(git status --porcelain 2>/dev/null)" ] && echo ' (with uncommitted changes)')"
echo "python:  $("$PY" -c 'import sys, importlib
v = lambda m: (lambda x: getattr(x, "__version__", "?"))(importlib.import_module(m))
out = []
for m in ("torch", "transformers", "peft", "accelerate"):
    try:
        out.append(f"{m} {v(m)}")
    except Exception as e:
        out.append(f"{m} missing")
print(sys.version.split()[0] + ", " + ", ".join(out))' 2>&1 | tail -1)"
echo "cases:   ${CASES[*]}; seq_len $SEQ, lr $LR constant, work dir $W"

# NCCL and cuDNN of a PyTorch installation live in its nvidia/* packages (as tests/gpu/run.sh).
py_lib() { "$PY" -c "import importlib.util as u; s=u.find_spec('nvidia.$1'); print(list(s.submodule_search_locations)[0]+'/lib' if s else '')" 2>/dev/null || true; }
export LD_LIBRARY_PATH="$(py_lib nccl):$(py_lib cudnn):${LD_LIBRARY_PATH:-}"

if [ -n "${LOOM_BIN:-}" ]; then
    LOOM=$LOOM_BIN
    say "using LOOM_BIN=$LOOM"
else
    LOOM=build-cuda/loom
    say "building loom"
    show_cmd make -j"$(nproc)" CUDA=1 BUILD=build-cuda config build-cuda/loom
    if ! make -j"$(nproc)" CUDA=1 BUILD=build-cuda config build-cuda/loom > "$W/build.log" 2>&1; then
        tail -30 "$W/build.log"
        echo "train_bench.sh: the build failed (log: $W/build.log)"
        exit 1
    fi
    grep -E '^(CC=|CUDA_HOME=)' "$W/build.log"
fi
"$LOOM" version || { echo "train_bench.sh: $LOOM does not run"; exit 1; }

say "data: $NDOCS documents of $SEQ tokens, vocab $VOCAB"
DATA=$W/data
show_cmd "$PY" bench/make_data.py --out "$DATA" --n-docs "$NDOCS" --seq-len "$SEQ" --vocab "$VOCAB" --seed 1
"$PY" bench/make_data.py --out "$DATA" --n-docs "$NDOCS" --seq-len "$SEQ" --vocab "$VOCAB" --seed 1 || exit 1
"$LOOM" data "$DATA.tokens" || { echo "train_bench.sh: loom refuses $DATA.tokens"; exit 1; }

ROWS=$W/rows.md
: > "$ROWS"
REPORTS=$W/reports.txt
: > "$REPORTS"

copy_out() {
    [ -n "$OUTDIR" ] || return 0
    mkdir -p "$OUTDIR" && cp -r "$W"/*.log "$W"/*.md "$W"/*.txt "$OUTDIR"/ 2> /dev/null
    for c in "${CASES[@]}"; do
        [ -d "$W/$c" ] && mkdir -p "$OUTDIR/$c" && cp "$W/$c"/*.log "$OUTDIR/$c"/ 2> /dev/null
    done
    return 0
}

for c in "${CASES[@]}"; do
    case_cfg "$c"
    D=$W/$c
    M=$W/models/$c
    rm -rf "$D" && mkdir -p "$D"
    echo
    say "=== case $c: $PRESET, $([ "$LORA_R" -gt 0 ] && echo "LoRA r=$LORA_R alpha=$LORA_ALPHA all-linear" || echo "full fine-tuning"), micro-batch $MB, $GA of them a step, $STEPS steps ==="
    LOOM_RC=1
    PEER_RC=1
    NOTE=""
    if [ -f "$M/.bench-ok" ] && [ "$(cat "$M/.bench-ok")" = "$PRESET $MODEL_TAG" ]; then
        say "model $M exists (kept from an earlier run)"
    else
        rm -rf "$M"
        say "model: random weights, $(df -h --output=avail "$W" 2> /dev/null | tail -1 | tr -d ' ') free on $W"
        if run_logged "$D/init.log" "$LOOM" init --preset "$PRESET" --seed 1 --save-dtype bfloat16 --out "$M" "${INIT_EXTRA[@]}"; then
            echo "$PRESET $MODEL_TAG" > "$M/.bench-ok"
        else
            NOTE="loom init failed"
        fi
    fi
    LORA_LOOM=()
    LORA_PEER=()
    if [ "$LORA_R" -gt 0 ]; then
        LORA_LOOM=(--lora-r "$LORA_R" --lora-alpha "$LORA_ALPHA" --lora-target all-linear)
        LORA_PEER=(--lora-r "$LORA_R" --lora-alpha "$LORA_ALPHA")
    fi
    if [ -z "$NOTE" ]; then
        if [[ " $SIDES " == *" loom "* ]]; then
            say "loom"
            run_logged "$D/loom.log" "$LOOM" train --device "$DEVICE" --dtype "$LDTYPE" --model "$M" \
                --data "$DATA.tokens" --seq-len "$SEQ" --micro-batch-size "$MB" \
                --global-batch-size "$((MB * GA))" --train-steps "$STEPS" --lr "$LR" --lr-warmup-steps 0 \
                --lr-decay-style constant --clip-grad 1.0 --weight-decay 0.0 --log-interval 1 \
                "${LORA_LOOM[@]}" "${LOOM_EXTRA[@]}"
            LOOM_RC=$?
        fi
        if [[ " $SIDES " == *" peer "* ]]; then
            say "peer (transformers$([ "$LORA_R" -gt 0 ] && echo " + PEFT"))"
            run_logged "$D/peer.log" "$PY" bench/peer_hf.py --model "$M" --data "$DATA.npy" \
                --steps "$STEPS" --micro-batch-size "$MB" --grad-accum "$GA" --seq-len "$SEQ" --lr "$LR" \
                --clip-grad 1.0 --weight-decay 0.0 --device "$DEVICE" \
                "${LORA_PEER[@]}" "${PEER_EXTRA[@]}"
            PEER_RC=$?
        fi
    fi
    say "summary of $c"
    LABEL=$c${MB_SET:+, micro-batch $MB} # (the case's own micro-batch unnamed)
    "$PY" bench/summarize.py "$D/loom.log" "$D/peer.log" --case "$LABEL" --config "$M/config.json" \
        --lora-r "$LORA_R" --seq-len "$SEQ" --micro-batch-size "$MB" --grad-accum "$GA" --steps "$STEPS" \
        --warmup "$WARMUP" --peak-tflops "$PEAK" --loom-rc "$LOOM_RC" --peer-rc "$PEER_RC" \
        ${NOTE:+--note "$NOTE"} --row-out "$ROWS" 2>&1 | tee "$D/summary.txt" | tee -a "$REPORTS"
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
        echo "| $LABEL | summarize.py failed (see $D/summary.txt) | | | | | | | | | |" >> "$ROWS"
    fi
    if [ "$KEEP" != 1 ]; then
        rm -rf "$M"
    fi
    copy_out
done

echo
say "all cases done"
{
    echo "date $(date -u '+%Y-%m-%d'), $GPU_NAME, seq_len $SEQ, lr $LR constant, tokens/s = mean of per-step tokens/s after $WARMUP steps, MFU against $PEAK TFLOP/s"
    printf 'command: '
    for v in $(compgen -v | grep -E '^(LOOM_BIN|LOOM_BENCH_[A-Z_]+|PYTHON)$'); do
        printf '%s=%q ' "$v" "${!v}"
    done
    echo "bash bench/train_bench.sh ${CASES[*]}"
    echo
    "$PY" bench/summarize.py --header
    cat "$ROWS"
} > "$W/summary.md"
echo "================================== summary (Markdown) =================================="
cat "$W/summary.md"
echo "(logs: $W/<case>/{init,loom,peer}.log, per-case reports: $W/reports.txt)"
copy_out
return 0
}

# the whole output also goes to $W/bench.log
main 2>&1 | tee "$W/bench.log"
rc=${PIPESTATUS[0]}
if [ -n "$OUTDIR" ]; then cp "$W/bench.log" "$OUTDIR"/ 2> /dev/null; fi
exit "$rc"
