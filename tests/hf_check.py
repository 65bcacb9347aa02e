#!/usr/bin/env python3
"""Checks that Hugging Face transformers loads a directory that `loom train
--save-hf` wrote, and computes the same logits as `loom golden` on it.

usage: python3 tests/hf_check.py SAVED_DIR GOLDEN_OUT.safetensors BATCH.safetensors [...]
(triples of arguments). Needs torch, transformers and safetensors; runs on CPU
in float64 so the only differences are loom's fp32 rounding. Exit 0 when every
directory loads and its logits agree within 1e-4 relative (max abs diff / max
abs logit)."""
import sys

import torch
from safetensors.torch import load_file
from hf_load import load_f64


def check(saved, golden, batch):
    model = load_f64(saved)
    model.eval()
    b = load_file(batch)
    g = load_file(golden)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"].long()).logits
    ref = g["logits"].double()
    err = ((logits - ref).abs().max() / ref.abs().max()).item()
    ok = logits.shape == ref.shape and err <= 1e-4
    vocab = model.config.get_text_config().vocab_size  # a vision-language config nests it
    print(f"{'ok  ' if ok else 'FAIL'} {saved}: {type(model).__name__}, "
          f"vocab {vocab}, logits {tuple(logits.shape)}, relative error {err:.3g}")
    return ok


def main(argv):
    if len(argv) < 3 or len(argv) % 3:
        print(__doc__)
        return 2
    results = [check(*argv[i:i + 3]) for i in range(0, len(argv), 3)]
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
