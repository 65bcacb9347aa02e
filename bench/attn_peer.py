#!/usr/bin/env python3
"""The peer of loom's attention kernels: PyTorch's scaled_dot_product_attention
(FlashAttention-2 backend, bf16, causal, grouped-query) on the shapes that
`LOOM_CUDA_OPS_BENCH=1 build-cuda/loom_tests cuda_ops_bench` times, with the
same FLOP count (forward 2 matmuls over the causal half, backward 2.5x the
forward). Run both in one job on one GPU and divide.

usage: python3 bench/attn_peer.py [--seq 4096] [--hq 32] [--hkv 8] [--reps 10]
                                 [--backend flash|cudnn]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps):
    for _ in range(2):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backend", choices=("flash", "cudnn"), default="flash",
                    help="PyTorch's FlashAttention-2 kernels, or cuDNN's fused attention")
    args = ap.parse_args()
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[args.backend]
    T, Hq, Hkv = args.seq, args.hq, args.hkv
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}, backend {args.backend}")
    for D in (64, 128):
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda h: (torch.rand(1, h, T, D, device="cuda", generator=g) - 0.5).to(torch.bfloat16)
        q, k, v = mk(Hq).requires_grad_(), mk(Hkv).requires_grad_(), mk(Hkv).requires_grad_()
        dout = mk(Hq)
        # the flash kernel takes grouped K/V directly when enable_gqa is known
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            kw, kk, vv, how = {"enable_gqa": True}, k, v, "enable_gqa"
        except (RuntimeError, TypeError):
            rep = Hq // Hkv
            kk = k.detach().repeat_interleave(rep, 1).requires_grad_()
            vv = v.detach().repeat_interleave(rep, 1).requires_grad_()
            kw, how = {}, "K/V repeated"
        fl = 4.0 * T * T / 2 * D * Hq

        def fwd():
            with torch.no_grad(), sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw)

        def fwd_bwd():
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw)
            torch.autograd.grad(o, (q, kk, vv), dout)

        tf = timed(fwd, args.reps)
        tb = timed(fwd_bwd, args.reps) - tf
        lab = f"T={T} Hq={Hq} Hkv={Hkv} D={D} bf16 ({args.backend}, {how})"
        print(f"    peer attention fwd {lab:44s} {tf:9.3f} ms {fl / tf / 1e9:8.1f} T/s")
        print(f"    peer attention bwd {lab:44s} {tb:9.3f} ms {2.5 * fl / tb / 1e9:8.1f} T/s")


if __name__ == "__main__":
    main()
