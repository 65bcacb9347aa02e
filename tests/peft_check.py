#!/usr/bin/env python3
"""Checks that PEFT loads an adapter `loom train --save-adapter` wrote, and
computes the same logits as `loom golden --adapter` on it.

usage: python3 tests/peft_check.py BASE_DIR ADAPTER_DIR GOLDEN_OUT.safetensors BATCH.safetensors
Needs torch, transformers, peft and safetensors; runs on CPU in float64."""
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from hf_load import load_f64


def main(base, adapter, golden, batch):
    model = load_f64(base)
    model = PeftModel.from_pretrained(model, adapter).eval()
    b, g = load_file(batch), load_file(golden)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"].long()).logits
    ref = g["logits"].double()
    err = ((logits - ref).abs().max() / ref.abs().max()).item()
    ok = logits.shape == ref.shape and err <= 1e-4
    print(f"{'ok  ' if ok else 'FAIL'} {adapter}: PEFT {type(model.base_model).__name__}, "
          f"r={model.peft_config['default'].r}, relative error {err:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 5:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
