#!/usr/bin/env python3
"""Compares two loom runs; exits 1 when they differ by more than the tolerance.

  compare.py curves REF.log RUN.log [--tol 0.02]
      per-step losses of two `loom train` logs ("step N/M | loss X | ...")
      differ by at most tol relative, at every step.
  compare.py golden REF.safetensors RUN.safetensors [--tol 0.02]
      two `loom golden` outputs: the loss (relative), the token log-probs
      (max abs error over max |ref|) and every grad.* / final.* tensor (relative
      L2 error ||run - ref|| / ||ref||) within tol.
"""
import re
import sys

import numpy as np


def losses(path):
    out = {}
    for line in open(path):
        m = re.search(r"step (\d+)/\d+ \| loss ([0-9.eE+-]+|nan|inf)", line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out


def curves(ref, run, tol):
    a, b = losses(ref), losses(run)
    if not a or set(a) != set(b):
        print(f"curves: the logs have different steps ({len(a)} vs {len(b)})")
        return 1
    worst = max(abs(b[s] - a[s]) / abs(a[s]) for s in a)
    first, last = min(a), max(a)
    print(f"curves: {len(a)} steps, loss {a[first]:.4f} -> {a[last]:.4f} (ref) vs "
          f"{b[first]:.4f} -> {b[last]:.4f}; worst relative difference {worst:.2e} (tol {tol})")
    return 0 if worst <= tol else 1


def golden(ref, run, tol):
    from safetensors.numpy import load_file
    a, b = load_file(ref), load_file(run)
    bad, n, worst_name, worst = 0, 0, "", 0.0
    for k in sorted(a):
        if k not in b:
            print(f"golden: {k} missing from {run}")
            bad += 1
            continue
        x, y = a[k].astype(np.float64), b[k].astype(np.float64)
        if x.shape != y.shape:
            print(f"golden: {k} shape {x.shape} vs {y.shape}")
            bad += 1
            continue
        if k.startswith(("grad.", "final.")):
            den = np.linalg.norm(x)
            e = np.linalg.norm(y - x) / den if den > 0 else np.linalg.norm(y - x)
        elif k in ("loss", "adamw_losses", "adamw_grad_norms"):
            e = float(np.max(np.abs(y - x) / np.maximum(np.abs(x), 1e-12)))
        elif k in ("token_logprobs", "entropy", "logits"):
            e = float(np.max(np.abs(y - x)) / max(np.max(np.abs(x)), 1e-12))
        else:
            continue
        n += 1
        if e > worst:
            worst, worst_name = e, k
        if not e <= tol:
            bad += 1
            if bad <= 10:
                print(f"golden: {k}: error {e:.3e} > {tol}")
    print(f"golden: {n} tensors compared, worst {worst_name} {worst:.2e} (tol {tol}), "
          f"{bad} over")
    return 1 if bad or n == 0 else 0


def main():
    args = sys.argv[1:]
    tol = 0.02
    if "--tol" in args:
        i = args.index("--tol")
        tol = float(args[i + 1])
        del args[i:i + 2]
    if len(args) != 3 or args[0] not in ("curves", "golden"):
        print(__doc__)
        return 2
    return (curves if args[0] == "curves" else golden)(args[1], args[2], tol)


if __name__ == "__main__":
    sys.exit(main())
