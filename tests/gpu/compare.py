#!/usr/bin/env python3
"""Compares two loom runs; exits 1 when they differ by more than the tolerance.

  compare.py curves REF.log RUN.log [--tol 0.02]
      per-step losses of two `loom train` logs ("step N/M | loss X | ..."):
      their means over every 5 steps in a row differ by at most tol relative,
      and the per-step differences by at most tol / 2 on average. (A single
      step may differ more: bf16 against fp32 over 50 steps, one batch's loss
      came out 4.2% apart on the H200 while its neighbours' were 0.1-0.6%.)
  compare.py golden REF.safetensors RUN.safetensors [--tol 0.02] [--tol-weights T]
      two `loom golden` outputs: the loss (relative), the token log-probs
      (max abs error over max |ref|) and every grad.* / final.* tensor (relative
      L2 error ||run - ref|| / ||ref||) within tol; the final.* weights after
      the AdamW steps within --tol-weights when given (AdamW's first steps
      move an element by ~lr whatever its gradient's size, so fp32 rounding
      of a near-zero gradient moves the weights more than the gradients).
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
    steps = sorted(a)
    rel = [abs(b[s] - a[s]) / abs(a[s]) for s in steps]
    mean, worst = sum(rel) / len(rel), max(rel)
    n = min(5, len(steps))
    windows = [abs(sum(b[s] for s in steps[i:i + n]) - sum(a[s] for s in steps[i:i + n])) /
               abs(sum(a[s] for s in steps[i:i + n])) for i in range(len(steps) - n + 1)]
    wworst = max(windows)
    ok = wworst <= tol and mean <= tol / 2
    print(f"curves: {len(a)} steps, loss {a[steps[0]]:.4f} -> {a[steps[-1]]:.4f} (ref) vs "
          f"{b[steps[0]]:.4f} -> {b[steps[-1]]:.4f}; relative difference of {n}-step means "
          f"at most {wworst:.2e} (tol {tol}), per step {mean:.2e} on average (tol {tol / 2}), "
          f"{worst:.2e} at most (step {steps[rel.index(worst)]}){'' if ok else '  FAIL'}")
    return 0 if ok else 1


def golden(ref, run, tol, tol_weights=None):
    from safetensors.numpy import load_file
    a, b = load_file(ref), load_file(run)
    bad, n, worst_name, worst, worst_ratio = 0, 0, "", 0.0, 0.0
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
        t = tol_weights if tol_weights is not None and k.startswith("final.") else tol
        n += 1
        if e / t > worst_ratio:
            worst, worst_name, worst_ratio = e, k, e / t
        if not e <= t:
            bad += 1
            if bad <= 10:
                print(f"golden: {k}: error {e:.3e} > {t}")
    tw = "" if tol_weights is None else f", weights {tol_weights}"
    print(f"golden: {n} tensors compared, worst {worst_name} {worst:.2e} (tol {tol}{tw}), "
          f"{bad} over")
    return 1 if bad or n == 0 else 0


def main():
    args = sys.argv[1:]
    tol, tol_weights = 0.02, None
    if "--tol" in args:
        i = args.index("--tol")
        tol = float(args[i + 1])
        del args[i:i + 2]
    if "--tol-weights" in args:
        i = args.index("--tol-weights")
        tol_weights = float(args[i + 1])
        del args[i:i + 2]
    if len(args) != 3 or args[0] not in ("curves", "golden"):
        print(__doc__)
        return 2
    if args[0] == "curves":
        return curves(args[1], args[2], tol)
    return golden(args[1], args[2], tol, tol_weights)


if __name__ == "__main__":
    sys.exit(main())
