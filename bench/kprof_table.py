#!/usr/bin/env python3
"""Where a training step's GPU time goes, from a bench/kprof.c report.

  kprof_table.py LOG --steps N [--top K] [--loom-log]
  kprof_table.py --self-test

LOG holds the `kprof:` lines that libloom_kprof.so printed at exit (any other
lines are ignored). The report must cover whole steps, N of them:
bench/profile.sh arranges that (LOOM_KPROF_SKIP = the kernels of a shorter run
of the same command). Prints Markdown for bench/RESULTS.md, per step:

  - the step's window (first record to last), the GPU busy and idle in it;
  - kernel time by kind of work (GEMMs of loom's own kernel, forward and
    input-gradient sums apart; cuBLASLt's GEMMs; attention; LoRA's passes;
    norms with q/k norm and RoPE; SwiGLU; the loss; residual adds; the
    optimizer and the gradient norm; the embedding; anything else), memsets
    and copies, and the idle time;
  - the K kernels that take the most time, with calls and ms a step;
  - the largest idle gaps by the records on either side (LOOM_KPROF_GAPS).

Kernel names are demangled with c++filt when it is on PATH. Exits 2 on bad
arguments or a log without a kprof report, 1 when --self-test fails.
"""
import argparse
import re
import shutil
import subprocess
import sys

GROUP = re.compile(r"^kprof:\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+(\S.*)$")
HEAD = re.compile(r"^kprof: (\d+) kernels \((\d+) skipped\), ([\d.]+) ms of kernel time")
WINDOW = re.compile(r"^kprof: window ([\d.]+) ms, GPU busy ([\d.]+) ms \(([\d.]+)%\), idle ([\d.]+) ms")
COPY = re.compile(r"^kprof: memcpy (\S+)\s+(\d+) calls\s+([\d.]+) ms\s+([\d.]+) MB")
SET = re.compile(r"^kprof: memset\s+(\d+) calls\s+([\d.]+) ms")
GAP = re.compile(r"^kprof: idle\s+([\d.]+) ms\s+(\d+) gaps\s+after (.*?)\s+before (.*)$")

# (kind, test on the demangled name in lower case), first match wins; loom's
# GEMM is told apart by its BT template argument (B N-major: input gradients)
KINDS = [
    ("attention", lambda n: any(s in n for s in ("cudnn", "sdpa", "fmha", "flash")) or n.startswith("attn_")
     or "::attn_" in n or " attn_" in n or "stats_layout" in n),
    ("Gated DeltaNet (delta rule, conv1d, q/k L2 norm, gated norm)",
     lambda n: re.search(r"\b(prep|out|dul|state_fwd|state_bwd|chunk_bwd|chunks|conv_fwd|conv_bwd|l2_fwd"
                         r"|l2_bwd|col_final|norm_fwd|norm_bwd|norm_dw_partial)(_tc|_tile|_staged|_dw|_h)?_kernel", n)
     or re.search(r"anonymous namespace\)::gate_(fwd|bwd|partial)_kernel", n)),
    ("GEMMs, cuBLASLt's (the output layer; LoRA's x A^T and dA)",
     lambda n: "gemm_sm90" not in n and "gemm_scale" not in n and any(s in n for s in ("nvjet", "cutlass", "cublas", "xmma", "gemm", "splitk"))),
    ("LoRA's passes (dy, finish, dropout)", lambda n: "lora" in n),
    ("norms (RMSNorm, with residual adds; q/k norm + RoPE)", lambda n: "norm" in n or "rope" in n),
    ("SwiGLU", lambda n: "swiglu" in n),
    ("loss (cross-entropy)", lambda n: "ce_vp" in n or "xent" in n),
    ("residual adds", lambda n: "residual" in n),
    ("optimizer and gradient norm", lambda n: "adamw" in n or "sumsq" in n or "zero_chunks" in n),
    ("embedding", lambda n: "embedding" in n),
]
FWD, DX = "GEMMs, loom's: forward projections (with LoRA's term)", "GEMMs, loom's: input-gradient sums"
BT_MANGLED = re.compile(r"gemm_sm90I(?:L[ib]\d+E){5}Lb([01])E")


def kind_of(name):
    n = name.lower()
    if "gemm_sm90" in n:
        m = re.search(r"gemm_sm90<([^>]*)>", n)
        if m:
            args = [a.strip() for a in m.group(1).split(",")]
            return DX if len(args) > 5 and args[5] == "true" else FWD
        m = BT_MANGLED.search(name)
        return DX if m and m.group(1) == "1" else FWD
    for k, test in KINDS:
        if test(n):
            return k
    return "other"


def demangle(names):
    tool = shutil.which("c++filt")
    if not tool or not names:
        return dict(zip(names, names))
    try:
        out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True,
                             timeout=60).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return dict(zip(names, names))
    return dict(zip(names, out)) if len(out) == len(names) else dict(zip(names, names))


def parse(lines):
    r = {"groups": [], "copies": [], "sets": None, "gaps": [], "head": None, "window": None}
    for line in lines:
        line = line.rstrip("\n")
        if not line.startswith("kprof:"):
            continue
        m = HEAD.match(line)
        if m:
            r["head"] = (int(m.group(1)), int(m.group(2)), float(m.group(3)))
            continue
        m = WINDOW.match(line)
        if m:
            r["window"] = tuple(float(x) for x in m.groups())
            continue
        m = COPY.match(line)
        if m:
            r["copies"].append((m.group(1), int(m.group(2)), float(m.group(3))))
            continue
        m = SET.match(line)
        if m:
            r["sets"] = (int(m.group(1)), float(m.group(2)))
            continue
        m = GAP.match(line)
        if m:
            r["gaps"].append((float(m.group(1)), int(m.group(2)), m.group(3), m.group(4)))
            continue
        m = GROUP.match(line)
        if m and m.group(5) != "kernel":
            r["groups"].append((int(m.group(1)), float(m.group(2)), m.group(5)))
    return r


def table(r, steps, top):
    """The report's Markdown lines, per step; raises ValueError on a report that cannot be read."""
    if r["head"] is None or r["window"] is None:
        raise ValueError("no kprof report (its 'kernels' and 'window' lines): was libloom_kprof.so preloaded, "
                         "and did CUPTI start (see the program's stderr)?")
    nk, skipped, ktime = r["head"]
    window, busy, _, idle = r["window"]
    listed = sum(g[1] for g in r["groups"])
    if ktime > 0 and listed < 0.999 * ktime:
        raise ValueError(f"the report lists {listed:.1f} of {ktime:.1f} ms of kernel time: "
                         "run with LOOM_KPROF_TOP large enough to list every kernel")
    names = demangle([g[2] for g in r["groups"]])
    by_kind = {}
    for calls, ms, name in r["groups"]:
        k = kind_of(names[name])
        c, t = by_kind.get(k, (0, 0.0))
        by_kind[k] = (c + calls, t + ms)
    out = [f"Per step, over {steps} steps: window {window / steps:.1f} ms, GPU busy {busy / steps:.1f} ms, "
           f"idle {idle / steps:.1f} ms; {nk / steps:.0f} kernels a step ({skipped} kernels before the window "
           "left out).", "", "| what | ms a step | share of the window | launches a step |", "| --- | --- | --- | --- |"]
    rows = sorted(by_kind.items(), key=lambda kv: -kv[1][1])
    for k, (calls, ms) in rows:
        out.append(f"| {k} | {ms / steps:.1f} | {100 * ms / window:.1f}% | {calls / steps:.0f} |")
    if r["sets"] and r["sets"][0]:
        out.append(f"| memsets | {r['sets'][1] / steps:.1f} | {100 * r['sets'][1] / window:.1f}% | "
                   f"{r['sets'][0] / steps:.0f} |")
    for kind, calls, ms in r["copies"]:
        out.append(f"| memcpy {kind} | {ms / steps:.1f} | {100 * ms / window:.1f}% | {calls / steps:.0f} |")
    out.append(f"| GPU idle | {idle / steps:.1f} | {100 * idle / window:.1f}% | |")
    out += ["", f"The {min(top, len(r['groups']))} kernels with the most time:", "",
            "| ms a step | calls a step | mean us | kind | kernel |", "| --- | --- | --- | --- | --- |"]
    for calls, ms, name in sorted(r["groups"], key=lambda g: -g[1])[:top]:
        d = names[name]
        short = d if len(d) <= 110 else d[:107] + "..."
        out.append(f"| {ms / steps:.2f} | {calls / steps:g} | {1e3 * ms / calls:.1f} | {kind_of(d)} | "
                   f"`{short.replace('|', '/')}` |")
    if r["gaps"]:
        out += ["", "The largest idle, by the records before and after each gap:", "",
                "| ms a step | gaps a step | after | before |", "| --- | --- | --- | --- |"]
        gn = demangle(sorted({g[2] for g in r["gaps"]} | {g[3] for g in r["gaps"]}))
        for ms, n, a, b in r["gaps"]:
            out.append(f"| {ms / steps:.2f} | {n / steps:g} | `{gn[a][:60]}` | `{gn[b][:60]}` |")
    return out


SAMPLE = """\
step 4/5 | loss 11.0
kprof: idle    2.000 ms     10 gaps  after _ZN9loom_sm909gemm_sm90ILi4ELi2ELi2ELb0ELi128ELb1ENS_5NoActELi1ELb1EEEvNS_4ArgsE  before lora_pass_kernel
kprof: 90 kernels (1000 skipped), 190.0 ms of kernel time
kprof: window 200.0 ms, GPU busy 196.0 ms (98.0%), idle 4.0 ms
kprof:    calls   total ms   mean us  share  kernel
kprof:       20      80.00    4000.0  42.1%  _ZN9loom_sm909gemm_sm90ILi4ELi2ELi2ELb0ELi128ELb0ENS_5NoActELi1ELb1EEEvNS_4ArgsE
kprof:       10      60.00    6000.0  31.6%  _ZN9loom_sm909gemm_sm90ILi4ELi2ELi2ELb0ELi128ELb1ENS_5NoActELi1ELb1EEEvNS_4ArgsE
kprof:       10      30.00    3000.0  15.8%  cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma
kprof:       20       8.00     400.0   4.2%  nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT
kprof:       10       6.00     600.0   3.2%  _Z16lora_pass_kernelILi8EEvPK13__nv_bfloat16
kprof:       10       4.00     400.0   2.1%  _Z15swiglu_bwd_vec_kernelPK13__nv_bfloat16
kprof:       10       2.00     200.0   1.1%  mystery_kernel
kprof: memcpy DtoH         2 calls       0.02 ms          0.1 MB
kprof: memset             4 calls       0.04 ms
"""


def self_test():
    r = parse(SAMPLE.splitlines())
    lines = table(r, 2, 5)
    text = "\n".join(lines)
    want = [f"| {FWD} | 40.0 | 40.0% | 10 |", f"| {DX} | 30.0 | 30.0% | 5 |", "| attention | 15.0 | 15.0% | 5 |",
            "| GEMMs, cuBLASLt's (the output layer; LoRA's x A^T and dA) | 4.0 | 4.0% | 10 |",
            "| LoRA's passes (dy, finish, dropout) | 3.0 | 3.0% | 5 |", "| SwiGLU | 2.0 | 2.0% | 5 |",
            "| other | 1.0 | 1.0% | 5 |", "| GPU idle | 2.0 | 2.0% | |", "| memsets | 0.0 | 0.0% | 2 |",
            "| 1.00 | 5 | `"]  # the idle gaps' row
    bad = [w for w in want if w not in text]
    try:
        table(parse(SAMPLE.splitlines()[:5]), 2, 5)
        bad.append("a report that lists part of the kernel time was accepted")
    except ValueError:
        pass
    try:
        table(parse(["step 1/2 | loss 3.0"]), 2, 5)
        bad.append("a log without a report was accepted")
    except ValueError:
        pass
    for b in bad:
        print(f"kprof_table.py self-test: missing or wrong: {b}", file=sys.stderr)
    if not bad:
        print(f"kprof_table.py self-test: {len(want) + 2} checks passed")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", nargs="?")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.log or a.steps is None:
        ap.error("give LOG and --steps N (or --self-test)")
    if a.steps < 1 or a.top < 0:
        ap.error("--steps must be at least 1 and --top at least 0")
    try:
        with open(a.log, errors="replace") as f:
            r = parse(f)
        print("\n".join(table(r, a.steps, a.top)))
    except (OSError, ValueError) as e:
        print(f"kprof_table.py: {a.log}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
