#!/usr/bin/env python3
"""Reference fixtures of MoE variants from Hugging Face transformers, beside
../shared/tools/make_fixtures.py's (same conventions: float64 on the CPU,
stored float32, random weights of std 0.1, norms 1 +- 0.1).  Usage:

    python3 tools/make_fixtures_moe.py OUT_DIR      (e.g. tests/fixtures_moe)

tiny-qwen2-moe: Qwen2-MoE, the shared expert scaled by
sigmoid(shared_expert_gate(x)), q/k/v biases, norm_topk_prob false, layer 2
dense (mlp_only_layers).  Written under OUT_DIR:
  models/tiny-qwen2-moe/config.json, model.safetensors   hub names, one tensor per expert
  golden/tiny-qwen2-moe.safetensors   input_ids, targets, logits, token_logprobs,
      router_logits.<i> ([B*T, E] of the i-th MoE layer), grad.<name> (LM loss
      alone), final.<name> (after 5 AdamW steps)
  golden/tiny-qwen2-moe.json          loss, hf_aux_loss_unscaled (transformers'
      load_balancing_loss_func over all MoE layers), router_z_loss (Megatron's
      z-loss mean_t logsumexp(z_t)^2 summed over the MoE layers, unscaled),
      adamw_losses, adamw_grad_norms_before_clip, hp
"""
import json, os, sys
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = sys.argv[1]
torch.set_default_dtype(torch.float64)
SEED = 4321
NTOK, V = 1000, 1024
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

def hub_state(sd):
    out = {}
    for n, p in sd.items():
        if n.endswith('experts.gate_up_proj'):
            pre = n[:-len('gate_up_proj')]
            for e in range(p.shape[0]):
                g, u = p[e].chunk(2, dim=0)
                out[f'{pre}{e}.gate_proj.weight'] = g; out[f'{pre}{e}.up_proj.weight'] = u
        elif n.endswith('experts.down_proj'):
            pre = n[:-len('down_proj')]
            for e in range(p.shape[0]): out[f'{pre}{e}.down_proj.weight'] = p[e]
        else:
            out[n] = p
    return out

def lm_loss(logits, tgt):
    logp = F.log_softmax(logits, dim=-1)
    m = tgt != -100
    tlp = torch.where(m, logp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1), torch.zeros_like(logp[..., 0]))
    return -tlp.sum() / m.sum(), tlp

HP = dict(lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay_2d=0.1, weight_decay_1d=0.0, clip_grad=1.0, steps=5)
name = 'tiny-qwen2-moe'
cfg = Qwen2MoeConfig(vocab_size=V, rms_norm_eps=1e-6, max_position_embeddings=512, initializer_range=0.1,
                     hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                     intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                     mlp_only_layers=[2], router_aux_loss_coef=0.01, tie_word_embeddings=False, rope_theta=1e6,
                     attn_implementation='eager')
cfg.output_router_logits = True
cfg._experts_implementation = 'eager'
g = torch.Generator().manual_seed(SEED)
model = Qwen2MoeForCausalLM(cfg).double()
with torch.no_grad():
    for n, p in model.named_parameters():
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if p.ndim == 1 and 'norm' in n
                else 0.1 * torch.randn(p.shape, generator=g))
model.eval()
os.makedirs(f'{OUT}/golden', exist_ok=True)
mdir = f'{OUT}/models/{name}'; os.makedirs(mdir, exist_ok=True)
cfg.save_pretrained(mdir)
save_file({k: v.float().contiguous() for k, v in hub_state(model.state_dict()).items()},
          f'{mdir}/model.safetensors', metadata={'format': 'pt'})
B, T = 2, 24
ids = torch.randint(0, NTOK, (B, T), generator=g)
tgt = torch.full_like(ids, -100); tgt[:, :-1] = ids[:, 1:]; tgt[0, :5] = -100
out = model(input_ids=ids)
loss, tlp = lm_loss(out.logits, tgt)
model.zero_grad(); loss.backward()
grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
Tn = {'input_ids': ids, 'targets': tgt, 'logits': out.logits.float(), 'token_logprobs': tlp.float()}
Tn.update({'grad.' + k: v.float().contiguous() for k, v in hub_state(grads).items()})
for i, rl in enumerate(out.router_logits): Tn[f'router_logits.{i}'] = rl.float()
S = dict(model=name, loss=loss.item(), n_valid_tokens=int((tgt != -100).sum()), hp=HP,
         hf_aux_loss_unscaled=float(load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, None)),
         router_z_loss=float(sum(torch.logsumexp(rl, -1).square().mean() for rl in out.router_logits)),
         note='targets are already shifted; grads are of the LM loss alone (aux coefficient 0); router_logits.i: [B*T, E] of the i-th MoE layer (layer 2 is dense)')
model.zero_grad()
named = list(model.named_parameters())
opt = torch.optim.AdamW([{'params': [p for n, p in named if p.ndim >= 2], 'weight_decay': 0.1},
                         {'params': [p for n, p in named if p.ndim < 2], 'weight_decay': 0.0}],
                        lr=HP['lr'], betas=tuple(HP['betas']), eps=HP['eps'])
losses, norms = [], []
for s in range(HP['steps']):
    opt.zero_grad(); l = lm_loss(model(input_ids=ids).logits, tgt)[0]; l.backward()
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), HP['clip_grad']))); losses.append(l.item()); opt.step()
S['adamw_losses'] = losses; S['adamw_grad_norms_before_clip'] = norms
Tn.update({'final.' + k: v.float().contiguous() for k, v in hub_state(model.state_dict()).items()})
save_file(Tn, f'{OUT}/golden/{name}.safetensors'); json.dump(S, open(f'{OUT}/golden/{name}.json', 'w'), indent=1)
import transformers
json.dump({'seed': SEED, 'tokenizer_vocab': NTOK, 'model_vocab': V,
           'versions': {'torch': torch.__version__, 'transformers': transformers.__version__}},
          open(f'{OUT}/MANIFEST.json', 'w'), indent=1)
print(name, 'loss', S['loss'], 'aux', S['hf_aux_loss_unscaled'], 'z', S['router_z_loss'], 'adamw', [round(x, 5) for x in losses])
print('tensors', sorted(k for k in hub_state(model.state_dict()) if 'layers.0.' in k and 'experts.' not in k))
