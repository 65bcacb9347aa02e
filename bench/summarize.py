#!/usr/bin/env python3
"""Summarizes one case of bench/train_bench.sh: a `loom train` log against
the peer's log (bench/peer_hf.py), both printing

  step N/M | loss X | grad norm G | lr L | T tokens/s
  peak GPU memory X GiB          (optional: n/a when absent)

  summarize.py LOOM.log PEER.log --case NAME --config MODEL/config.json
               [--lora-r R] [--seq-len S] [--steps M] [--warmup 3]
               [--parity-steps 20] [--parity-tol 0.02] [--peak-tflops 989.4]
               [--params N] [--trainable N] [--loom-rc RC] [--peer-rc RC]
               [--row-out FILE] [--note TEXT]
  summarize.py --header          the Markdown table header of the rows

Prints a report, a per-step loss comparison, and one Markdown table row
(appended to --row-out too) for bench/RESULTS.md. Exits 0 even when a side
failed (the row says so); 2 on bad arguments.

Definitions (bench/README.md):
  tokens/s   mean of the per-step tokens/s of the steps after the first
             --warmup steps (rows x seq_len tokens per step, over all of a
             step's micro-batches; the last position of each row included).
  N          parameters of the matrices a token goes through: attention
             (q, k, v, o and the q/k norms), MLP (gate, up, down), the
             RMSNorm weights, and the output layer V x H -- counted once
             whether it is tied to the input embedding or not; the input
             embedding (a lookup) is not counted.
  FLOP/token full fine-tuning 6N + 6 L S Hq D; LoRA 4N + 6 L S Hq D (frozen
             weights: forward 2N plus the input-gradient backward 2N, no
             weight gradients; the adapters' own FLOPs ignored). Attention:
             QK^T and PV are 2 x 2 S D FLOPs per query token per head
             without a mask; causality halves the mean context to S/2, so
             2 S Hq D per token per layer forward; backward (dQ, dK, dV, dP)
             is twice the forward in both modes: x3.
  TFLOP/s    tokens/s x FLOP/token / 1e12; MFU = TFLOP/s / --peak-tflops
             (H100 SXM dense bf16: 989.4).
  parity     max over steps 1..--parity-steps of |loom - peer| / |peer|
             of the loss; flagged above --parity-tol.
"""
import argparse
import json
import math
import re
import sys

STEP_RE = re.compile(r"step (\d+)/(\d+) \| loss ([0-9.eE+-]+|nan|inf|-inf) \| grad norm "
                     r"([0-9.eE+-]+|nan|inf) \| lr ([0-9.eE+-]+) \| ([0-9.eE+-]+) tokens/s")
MEM_RE = re.compile(r"peak GPU memory ([0-9.]+) GiB")
DEV_RE = re.compile(r"([0-9.]+) GiB on the device with the CUDA context")
OOM_RE = re.compile(r"out of memory|OutOfMemory|\bOOM\b|CUDA_ERROR_OUT_OF_MEMORY", re.I)
ERR_RE = re.compile(r"error|Error|ERROR|Traceback|failed|Killed|Aborted|Segmentation")

HEADER = ("| case | loom tokens/s | peer tokens/s | loom / peer | loom TFLOP/s (MFU) | "
          "peer TFLOP/s (MFU) | loom peak GiB | peer peak GiB | memory loom / peer | "
          "loss first → last (loom / peer) | loss parity |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


class Run:
    def __init__(self, name, path, rc, want_steps):
        self.name, self.path, self.rc = name, path, rc
        self.steps = {}  # step -> (loss, grad norm, lr, tokens/s)
        self.mem = None
        self.dev_mem = None  # the device's count: the CUDA context and libraries too
        self.oom = False
        self.err = ""
        self.missing = False
        try:
            text = open(path, errors="replace").read()
        except OSError:
            self.missing = True
            text = ""
        for line in text.splitlines():
            m = STEP_RE.search(line)
            if m:
                self.steps[int(m.group(1))] = tuple(float(m.group(i)) for i in range(3, 7))
                continue
            m = MEM_RE.search(line)
            if m:
                self.mem = float(m.group(1))
                d = DEV_RE.search(line)
                self.dev_mem = float(d.group(1)) if d else None
            if OOM_RE.search(line):
                self.oom = True
            if ERR_RE.search(line) and not line.startswith("  "):
                self.err = line.strip()
        if want_steps is None and self.steps:
            want_steps = max(self.steps)
        self.want = want_steps
        complete = bool(self.steps) and want_steps is not None and \
            all(s in self.steps for s in range(1, want_steps + 1))
        self.ok = (not self.missing) and complete and (rc is None or rc == 0) and not any(
            math.isnan(v[0]) for v in self.steps.values())

    def failure(self):
        if self.missing:
            return "not run"
        done = max(self.steps) if self.steps else 0
        if self.oom:
            return f"OOM at step {done + 1}" if done < (self.want or 0) else "OOM"
        if any(math.isnan(v[0]) for v in self.steps.values()):
            return "loss NaN"
        why = f"exit {self.rc}" if self.rc not in (None, 0) else "incomplete"
        why += f" after {done} step{'s' if done != 1 else ''}"
        return why

    def tokens_per_s(self, warmup):
        keys = sorted(s for s in self.steps if s > warmup)
        if not keys:
            return None
        return sum(self.steps[s][3] for s in keys) / len(keys)


def model_shape(path):
    cfg = json.load(open(path))
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]
    H = cfg["hidden_size"]
    I = cfg["intermediate_size"]
    L = cfg["num_hidden_layers"]
    Hq = cfg["num_attention_heads"]
    Hkv = cfg.get("num_key_value_heads") or Hq
    D = cfg.get("head_dim") or H // Hq
    V = cfg["vocab_size"]
    tied = bool(cfg.get("tie_word_embeddings", False))
    mt = cfg.get("model_type", "?")
    qwen35 = mt.startswith("qwen3_5")
    qkv_bias = bool(cfg.get("attention_bias", mt == "qwen2"))
    qk_norm = mt == "qwen3" or qwen35
    gate = 2 if qwen35 else 1  # Qwen3.5's q_proj: query and output gate per head
    attn = H * gate * Hq * D + 2 * H * Hkv * D + Hq * D * H
    if qkv_bias:
        attn += Hq * D + 2 * Hkv * D
    if qk_norm:
        attn += 2 * D
    mlp = 3 * H * I
    norms = 2 * H * L + H
    # Qwen3.5: three of four layers are Gated DeltaNet (linear attention)
    types = cfg.get("layer_types") or (
        ["full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
         else "linear_attention" for i in range(L)] if qwen35 else ["full_attention"] * L)
    Ll = sum(t == "linear_attention" for t in types)
    Lf = L - Ll
    Hk, Hv = cfg.get("linear_num_key_heads", 0), cfg.get("linear_num_value_heads", 0)
    dk, dv = cfg.get("linear_key_head_dim", 0), cfg.get("linear_value_head_dim", 0)
    C, K = 2 * Hk * dk + Hv * dv, cfg.get("linear_conv_kernel_dim", 4)
    gdn = H * C + H * Hv * dv + 2 * H * Hv + C * K + 2 * Hv + dv + Hv * dv * H
    lora_attn = (H + gate * Hq * D) + (H + Hkv * D) * 2 + (Hq * D + H)
    lora_gdn = (H + C) + (H + Hv * dv) + (Hv * dv + H)  # in_proj_qkv, in_proj_z, out_proj
    mats = attn * Lf + gdn * Ll + mlp * L
    return dict(model_type=mt, H=H, I=I, L=L, Lf=Lf, Ll=Ll, Hq=Hq, Hkv=Hkv, D=D, V=V,
                Hv=Hv, dk=dk, dv=dv, tied=tied, attention=attn * Lf + gdn * Ll, mlp=mlp * L,
                norms=norms, embedding=V * H, lm_head=0 if tied else V * H,
                total=mats + norms + V * H + (0 if tied else V * H),
                n_flop=mats + norms + V * H,
                lora_per_r=Lf * lora_attn + Ll * lora_gdn + L * (H + I) * 3)


GDN_CHUNK = 64


def gdn_flops(shape):
    """FLOPs per token of the chunked gated delta rule over the model's linear
    layers, training (forward + backward = 3 x forward; bench/README.md): per
    value head and token, with chunks of c = 64, the forward's matmuls
    K K^T, W = T(beta K), U = T(beta V), Q K^T and (Q K^T)V' cost
    2c(3 dk + 2 dv), the state's W S, Q S and K^T V' 6 dk dv, and the
    triangular solve 2c^2/3."""
    c, dk, dv = GDN_CHUNK, shape["dk"], shape["dv"]
    fwd = 2 * c * (3 * dk + 2 * dv) + 6 * dk * dv + 2 * c * c / 3
    return 3 * shape["Ll"] * shape["Hv"] * fwd


def fmt_int(n):
    return f"{n:,}"


def fmt_tps(x):
    return "n/a" if x is None else f"{x:,.0f}"


def main():
    ap = argparse.ArgumentParser(description="loom vs peer training benchmark: one case")
    ap.add_argument("loom_log", nargs="?")
    ap.add_argument("peer_log", nargs="?")
    ap.add_argument("--header", action="store_true", help="print the table header and exit")
    ap.add_argument("--case", default="?")
    ap.add_argument("--config", help="the model's config.json (parameter counts)")
    ap.add_argument("--params", type=int, help="N of the FLOP formula (overrides --config)")
    ap.add_argument("--trainable", type=int, help="trainable parameters (report only)")
    ap.add_argument("--lora-r", type=int, default=0, help="0: full fine-tuning")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches a step (report only)")
    ap.add_argument("--steps", type=int, help="steps each side should have logged")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--parity-steps", type=int, default=20)
    ap.add_argument("--parity-tol", type=float, default=0.02)
    ap.add_argument("--peak-tflops", type=float, default=989.4)
    ap.add_argument("--loom-rc", type=int)
    ap.add_argument("--peer-rc", type=int)
    ap.add_argument("--row-out", help="append the table row to this file")
    ap.add_argument("--note", help="a remark put in the row's case cell (e.g. 'loom init failed')")
    a = ap.parse_args()
    if a.header:
        print(HEADER)
        return 0
    if not a.loom_log or not a.peer_log:
        ap.print_usage(sys.stderr)
        return 2

    lora = a.lora_r > 0
    S = a.seq_len
    shape = None
    if a.config:
        try:
            shape = model_shape(a.config)
        except (OSError, ValueError, KeyError) as e:
            print(f"summarize.py: {a.config}: {e!r}; no FLOP counts", file=sys.stderr)
    N = a.params if a.params is not None else (shape["n_flop"] if shape else None)
    trainable = a.trainable
    if trainable is None and shape:
        trainable = a.lora_r * shape["lora_per_r"] if lora else shape["total"]
    attn_flops = 6 * shape["Lf"] * S * shape["Hq"] * shape["D"] if shape else None
    if shape and shape["Ll"]:
        attn_flops += gdn_flops(shape)
    flop_tok = (4 if lora else 6) * N + attn_flops if N is not None and shape else None

    loom = Run("loom", a.loom_log, a.loom_rc, a.steps)
    peer = Run("peer", a.peer_log, a.peer_rc, a.steps)

    mode = f"LoRA r={a.lora_r} all-linear" if lora else "full fine-tuning"
    ga = f", {a.grad_accum} micro-batches a step" if a.grad_accum > 1 else ""
    print(f"=== {a.case}: {mode}, seq {S}, micro-batch {a.micro_batch_size}{ga} ===")
    if a.note:
        print(f"note: {a.note}")
    if shape:
        print(f"model: {shape['model_type']}, {shape['L']} layers, hidden {shape['H']}, "
              f"mlp {shape['I']}, heads {shape['Hq']} (kv {shape['Hkv']}, head_dim "
              f"{shape['D']}), vocab {shape['V']}, {'tied' if shape['tied'] else 'untied'} "
              f"embeddings; {fmt_int(shape['total'])} parameters")
    if flop_tok is not None:
        print(f"N = {fmt_int(N)} (attention + MLP + norms + output layer V x H; input "
              f"embedding not counted); trainable "
              f"{fmt_int(trainable) if trainable is not None else 'n/a'}")
        mix = " + the chunked delta rule's" if shape["Ll"] else ""
        print(f"FLOP/token = {4 if lora else 6}N + 6 L S Hq D{mix} = "
              f"{(4 if lora else 6) * N:.4g} + {attn_flops:.4g} = {flop_tok:.4g}; "
              f"peak {a.peak_tflops} TFLOP/s")
    else:
        print("FLOP/token: n/a (no readable --config)")

    res = {}
    for r in (loom, peer):
        tps = r.tokens_per_s(a.warmup)
        tf = tps * flop_tok / 1e12 if tps is not None and flop_tok is not None else None
        res[r.name] = (tps, tf)
        status = "ok" if r.ok else "FAILED: " + r.failure()
        n_after = len([s for s in r.steps if s > a.warmup])
        print(f"{r.name}: {status}; {len(r.steps)} steps logged"
              + (f"; {fmt_tps(tps)} tokens/s (mean of {n_after} steps after {a.warmup})"
                 if tps else "")
              + (f", {tf:.1f} TFLOP/s, MFU {100 * tf / a.peak_tflops:.1f}%" if tf else "")
              + f"; peak memory {f'{r.mem:.2f} GiB' if r.mem is not None else 'n/a'}"
              + (f" ({r.dev_mem:.2f} GiB on the device with the CUDA context and libraries)"
                 if r.dev_mem is not None else "")
              + (f"\n      last error line: {r.err[:200]}" if not r.ok and r.err else ""))

    # loss parity
    common = sorted(set(loom.steps) & set(peer.steps))
    par = [s for s in common if s <= a.parity_steps]
    worst, worst_step = None, None
    for s in par:
        lp = peer.steps[s][0]
        d = abs(loom.steps[s][0] - lp) / abs(lp) if lp else float("inf")
        if worst is None or d > worst or math.isnan(d):
            worst, worst_step = d, s
    if par:
        flag = "FLAG" if (worst > a.parity_tol or math.isnan(worst)) else "ok"
        print(f"loss parity: max |loom - peer| / peer over steps 1..{max(par)} = "
              f"{100 * worst:.3f}% at step {worst_step} ({flag}, tolerance "
              f"{100 * a.parity_tol:g}%)")
    else:
        print("loss parity: n/a (no step logged by both)")
    allsteps = sorted(set(loom.steps) | set(peer.steps))
    if allsteps:
        print(" step | loom loss | peer loss |  rel diff | loom gnorm | peer gnorm")
        for s in allsteps:
            lo, pe = loom.steps.get(s), peer.steps.get(s)
            rel = f"{100 * (lo[0] - pe[0]) / abs(pe[0]):+8.3f}%" if lo and pe and pe[0] else \
                "      n/a"
            print(f" {s:4d} | {lo[0] if lo else float('nan'):9.4f} | "
                  f"{pe[0] if pe else float('nan'):9.4f} | {rel} | "
                  f"{lo[1] if lo else float('nan'):10.4f} | {pe[1] if pe else float('nan'):10.4f}")

    # table row
    def cell_tps(r):
        tps = res[r.name][0]
        if r.ok:
            return fmt_tps(tps)
        return f"failed ({r.failure()})" + (f", {fmt_tps(tps)} before" if tps else "")

    def cell_tf(r):
        tf = res[r.name][1]
        return "n/a" if tf is None else f"{tf:.1f} ({100 * tf / a.peak_tflops:.1f}%)"

    def cell_mem(r):
        return "n/a" if r.mem is None else f"{r.mem:.2f}"

    lt, pt = res["loom"][0], res["peer"][0]
    ratio = f"{lt / pt:.2f}x" if lt and pt and loom.ok and peer.ok else "n/a"
    mratio = f"{loom.mem / peer.mem:.2f}x" if loom.mem and peer.mem else "n/a"

    def first_last(r):
        if not r.steps:
            return "n/a"
        return f"{r.steps[min(r.steps)][0]:.3f} → {r.steps[max(r.steps)][0]:.3f}"

    if par:
        parity = f"{100 * worst:.2f}% (steps 1–{max(par)}){' FLAG' if flag == 'FLAG' else ''}"
    else:
        parity = "n/a"
    case = a.case + (f", {a.grad_accum} micro-batches a step" if a.grad_accum > 1 else "")
    case = f"{case} ({a.note})" if a.note else case
    row = (f"| {case} | {cell_tps(loom)} | {cell_tps(peer)} | {ratio} | {cell_tf(loom)} | "
           f"{cell_tf(peer)} | {cell_mem(loom)} | {cell_mem(peer)} | {mratio} | "
           f"{first_last(loom)} / {first_last(peer)} | {parity} |")
    print("row:")
    print(row)
    if a.row_out:
        with open(a.row_out, "a") as f:
            f.write(row + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
