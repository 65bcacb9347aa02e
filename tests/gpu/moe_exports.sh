#!/usr/bin/env bash
# Mixture-of-experts files out where transformers and PEFT are (issue 37):
#  1. tiny-qwen3-moe and tiny-qwen2-moe (per-expert tensors) trained 3 steps
#     in full and saved (--save-hf): transformers loads each with `loom
#     golden`'s logits (tests/hf_check.py);
#  2. the fused layout transformers v5 holds (mlp.experts.gate_up_proj
#     [E, 2I, H], down_proj [E, H, I]): tiny-qwen3-moe rewritten so, trained
#     by loom and saved in the layout read, loaded by transformers the same
#     way, and the saved file's tensor names those of the file read;
#  3. adapters: attention and every expert (all-linear), and with the router
#     (all-linear,gate), --save-adapter: PEFT loads them onto the
#     per-expert checkpoint with `loom golden --adapter`'s logits
#     (tests/peft_check.py: a name PEFT could not place leaves that part of
#     the adapter out, and the logits then differ).
# Usage: bash tests/gpu/moe_exports.sh [BUILD]   (BUILD: a loom build dir,
#        default build-cuda; made when missing). Needs torch, transformers,
#        peft, safetensors. CPU runs only: the GPU machine is where they are.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. tests/gpu/exports_lib.sh
exports_setup moe "${1:-build-cuda}"
F=${LOOM_FIXTURES:-tests/fixtures}
FM=tests/fixtures_moe
make_tokens 5 || exit 1
tr() { # tr MODEL args...: 3 steps on the CPU
    local m=$1; shift
    $L train --device cpu --model "$m" --data "$W/t.tokens" --seq-len 24 --global-batch-size 2 \
        --lr 1e-2 --lr-warmup-steps 0 --train-steps 3 --no-progress --log-level warn "$@"
}
gold() { # gold MODEL BATCH OUT [args]
    local m=$1 b=$2 o=$3; shift 3
    $L golden --device cpu --model "$m" --batch "$b" --out "$o" --log-level warn "$@"
}

echo "== 1. per-expert checkpoints, trained and saved"
for name in tiny-qwen3-moe tiny-qwen2-moe; do
    d=$F; [ -d "$d/models/$name" ] || d=$FM
    M=$d/models/$name
    BATCH=$d/golden/$name.safetensors
    run tr "$M" --save-hf "$W/$name-hf" &&
        run gold "$W/$name-hf" "$BATCH" "$W/$name-g.safetensors" &&
        { python3 tests/hf_check.py "$W/$name-hf" "$W/$name-g.safetensors" "$BATCH" || fails=$((fails + 1)); }
done

echo "== 2. the fused layout of transformers v5"
M=$F/models/tiny-qwen3-moe
BATCH=$F/golden/tiny-qwen3-moe.safetensors
# transformers 5.17's save_pretrained writes the hub's per-expert names
# again (seen 2026-11-28), so the fused file is built here, as v5 holds it
python3 - "$M" "$W/fused" <<'PY' || fails=$((fails + 1))
import glob, os, re, shutil, sys
import numpy as np
from safetensors.numpy import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
for p in glob.glob(src + "/*"):
    if not p.endswith(".safetensors") and not p.endswith(".index.json"):
        shutil.copy(p, dst)
t = {}
for p in sorted(glob.glob(src + "/*.safetensors")):
    t.update(load_file(p))
pat = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
layers = sorted({pat.match(k).group(1) for k in t if pat.match(k)})
E = 1 + max((int(pat.match(k).group(2)) for k in t if pat.match(k)), default=-1)
out = {k: v for k, v in t.items() if not pat.match(k)}
for pre in layers:
    g = [t[f"{pre}.{e}.gate_proj.weight"] for e in range(E)]
    u = [t[f"{pre}.{e}.up_proj.weight"] for e in range(E)]
    out[pre + ".gate_up_proj"] = np.ascontiguousarray(np.stack([np.concatenate([a, b], 0) for a, b in zip(g, u)]))
    out[pre + ".down_proj"] = np.ascontiguousarray(np.stack([t[f"{pre}.{e}.down_proj.weight"] for e in range(E)]))
save_file(out, dst + "/model.safetensors", metadata={"format": "pt"})
print(f"fused file: {len(out)} tensors, {len(layers)} fused gate_up_proj")
sys.exit(0 if layers else 1)
PY
if [ -d "$W/fused" ]; then
    run tr "$W/fused" --save-hf "$W/fused-hf" &&
        run gold "$W/fused-hf" "$BATCH" "$W/fused-g.safetensors" &&
        { python3 tests/hf_check.py "$W/fused-hf" "$W/fused-g.safetensors" "$BATCH" || fails=$((fails + 1)); }
    python3 - "$W/fused" "$W/fused-hf" <<'PY' || { echo "FAIL: the fused layout was not kept"; fails=$((fails + 1)); }
import glob, sys
from safetensors import safe_open
def names(d):
    out = set()
    for p in glob.glob(d + "/*.safetensors"):
        with safe_open(p, "pt") as f:
            out |= set(f.keys())
    return out
a, b = names(sys.argv[1]), names(sys.argv[2])
print("ok   fused layout kept" if a == b else f"names differ: {sorted(a ^ b)[:6]}")
sys.exit(0 if a == b else 1)
PY
fi

echo "== 3. expert (and router) adapters in PEFT"
for tg in all-linear all-linear,gate; do
    o=$W/ad-${tg//,/-}
    run tr "$M" --lora-r 4 --lora-alpha 8 --seed 7 --lora-target "$tg" --save-adapter "$o" &&
        run gold "$M" "$BATCH" "$o-g.safetensors" --adapter "$o" &&
        { python3 tests/peft_check.py "$M" "$o" "$o-g.safetensors" "$BATCH" || fails=$((fails + 1)); }
done
echo "moe_exports: $fails failed (work dir $W)"
[ "$fails" -eq 0 ]
