#!/usr/bin/env python3
"""A Qwen3 model directory with random weights (Qwen3-0.6B's layer shape,
fewer layers and a smaller vocabulary, so that every gradient can be written
and compared) and a golden batch for `loom golden`.

  make_model.py OUT_DIR BATCH.safetensors [--layers 4] [--vocab 32000]
                [--rows 4] [--seq 512] [--packed]
"""
import argparse
import json
import os

import numpy as np
from safetensors.numpy import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("batch")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--packed", action="store_true", help="3 documents per row (cu_seqlens)")
    a = ap.parse_args()
    H, I, Hq, Hkv, D = 1024, 3072, 16, 8, 128
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": a.vocab,
           "hidden_size": H, "intermediate_size": I, "num_hidden_layers": a.layers,
           "num_attention_heads": Hq, "num_key_value_heads": Hkv, "head_dim": D,
           "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
           "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1}
    os.makedirs(a.out, exist_ok=True)
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=1)
    rng = np.random.default_rng(11)
    t = {}

    def lin(o, i):
        return (rng.standard_normal((o, i)) * 0.02).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t["model.embed_tokens.weight"] = lin(a.vocab, H)
    t["model.norm.weight"] = norm(H)
    for l in range(a.layers):
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        t[p + "self_attn.q_proj.weight"] = lin(Hq * D, H)
        t[p + "self_attn.k_proj.weight"] = lin(Hkv * D, H)
        t[p + "self_attn.v_proj.weight"] = lin(Hkv * D, H)
        t[p + "self_attn.o_proj.weight"] = lin(H, Hq * D)
        t[p + "self_attn.q_norm.weight"] = norm(D)
        t[p + "self_attn.k_norm.weight"] = norm(D)
        t[p + "mlp.gate_proj.weight"] = lin(I, H)
        t[p + "mlp.up_proj.weight"] = lin(I, H)
        t[p + "mlp.down_proj.weight"] = lin(H, I)
    save_file(t, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    # tokens with structure (repeated phrases) so the loss is not flat
    phrases = rng.integers(0, a.vocab, size=(64, 16))
    ids = np.concatenate([phrases[rng.integers(0, 64)] for _ in range(a.rows * a.seq // 16 + 1)])
    ids = ids[: a.rows * a.seq].reshape(a.rows, a.seq).astype(np.int64)
    tgt = np.full_like(ids, -100)
    tgt[:, :-1] = ids[:, 1:]
    out = {"input_ids": ids, "targets": tgt}
    if a.packed:
        cuts = [0]
        for r in range(a.rows):
            base = r * a.seq
            cuts += [base + a.seq // 3, base + (2 * a.seq) // 3 + 5, base + a.seq]
        flat = tgt.reshape(-1)
        for c in cuts[1:]:
            flat[c - 1] = -100  # no target across a document's end
        out["targets"] = flat.reshape(a.rows, a.seq)
        out["cu_seqlens"] = np.array(cuts, dtype=np.int64)
    save_file(out, a.batch)


if __name__ == "__main__":
    main()
