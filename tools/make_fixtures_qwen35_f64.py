#!/usr/bin/env python3
"""tools/make_fixtures_qwen35.py with the Gated DeltaNet rule in float64.

transformers computes the gated delta rule (torch_chunk_gated_delta_rule) in
float32 even inside a float64 model, so the fixtures it writes carry that
kernel's rounding: loom's gradients differ from them by 4e-5..8e-5 of a
tensor's largest, uniformly over all tensors, and a 5-step AdamW trajectory
of the MoE model leaves them by 1.5e-4 from step 3 (issue 38's notes). This
runs the same generator with the rule replaced by a float64 token-by-token
recurrence of the same semantics (q and k L2-normalised with eps 1e-6, q
scaled by dk^-1/2; S <- exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q),
after checking it against transformers' own kernel on random inputs. The
rotary tables stay transformers' (float32).

    python3 tools/make_fixtures_qwen35_f64.py OUT_DIR

Needs what make_fixtures_qwen35.py needs (torch, transformers >= 5.2 with
qwen3_5, safetensors) and no flash-linear-attention (its kernels would be
used instead). OUT_DIR gets the same files as make_fixtures_qwen35.py's.
"""
import os
import runpy
import sys

import torch


def rule_f64(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """[B, T, H, d] inputs, as transformers' torch_chunk_gated_delta_rule: q
    and k with the key heads (newer transformers repeat them to the value
    heads inside the kernel, older ones before it; both are taken)."""
    if cu_seqlens is not None:
        sys.exit('transformers passed cu_seqlens to the rule: packed documents in one row are '
                 'not handled by the float64 replacement')
    dt = query.dtype
    q, k, v, g, beta = (x.double() for x in (query, key, value, g, beta))
    if q.shape[2] != v.shape[2]:
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    B, T, H, dk = q.shape
    S = (initial_state.double() if initial_state is not None
         else q.new_zeros(B, H, dk, v.shape[-1]))
    out = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None, None]
        u = (v[:, t] - torch.einsum('bhk,bhkv->bhv', k[:, t], S)) * beta[:, t][..., None]
        S = S + torch.einsum('bhk,bhv->bhkv', k[:, t], u)
        out.append(torch.einsum('bhk,bhkv->bhv', q[:, t], S))
    o = torch.stack(out, 1)
    return o.to(dt), (S.to(dt) if output_final_state else None)


def patch():
    import importlib
    mods = []
    for name in ('transformers.models.qwen3_5.modeling_qwen3_5',
                 'transformers.models.qwen3_5_moe.modeling_qwen3_5_moe'):
        m = importlib.import_module(name)
        if getattr(m, 'chunk_gated_delta_rule', None) is not None:
            sys.exit(f'{name} uses flash-linear-attention\'s kernel: uninstall fla-core first')
        mods.append(m)
    # the replacement against transformers' own kernel (fp32) on random inputs
    g = torch.Generator().manual_seed(1)
    B, T, Hh, dk, dv = 2, 150, 3, 16, 8
    args = [torch.randn(B, T, Hh, d, generator=g, dtype=torch.float64) for d in (dk, dk, dv)]
    gate = -torch.rand(B, T, Hh, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, Hh, generator=g, dtype=torch.float64)
    ref, _ = mods[0].torch_chunk_gated_delta_rule(*args, g=gate, beta=beta,
                                                  use_qk_l2norm_in_kernel=True)
    got, _ = rule_f64(*args, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    err = ((got - ref.double()).abs().max() / ref.double().abs().max()).item()
    print(f'float64 rule against transformers\' fp32 kernel: {err:.3g} of the largest output')
    if not err < 1e-4:
        sys.exit('the float64 rule does not compute what transformers\' kernel does')
    for m in mods:
        m.torch_chunk_gated_delta_rule = rule_f64
        m.torch_recurrent_gated_delta_rule = rule_f64


if __name__ == '__main__':
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    patch()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.argv = [os.path.join(here, 'make_fixtures_qwen35.py'), sys.argv[1]]
    runpy.run_path(sys.argv[0], run_name='__main__')
