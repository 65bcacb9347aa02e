"""The issue's usage example, as a user writes it (only the import is loom's):
every rank runs this under mpirun / torchrun; rank 0 writes the step losses.

    example.py MODEL SAMPLES.jsonl OUT.json DP TP PP [LORA_R] [GAS] [freeze]

freeze: a pre-wrap hook freezes layer 0 and the embedding (full fine-tuning).
LOOM_EXAMPLE_CP, LOOM_EXAMPLE_SP and LOOM_EXAMPLE_VPP (environment) add
context and sequence parallelism and virtual pipeline stages to the mesh.
"""
import os
import json
import sys

from loom import MegatronModel, DeviceMesh, DataLoader

model_id, samples, out = sys.argv[1:4]
dp, tp, pp = (int(x) for x in sys.argv[4:7])
lora_r = int(sys.argv[7]) if len(sys.argv) > 7 else 0
gas = int(sys.argv[8]) if len(sys.argv) > 8 else 1
freeze = len(sys.argv) > 9 and sys.argv[9] == 'freeze'


def freeze_first_layer(table):
    for p in table:
        if p['layer'] == 0 or p['name'] == 'model.embed_tokens.weight':
            p['trainable'] = False


cp = int(os.environ.get('LOOM_EXAMPLE_CP', '1'))
sp = os.environ.get('LOOM_EXAMPLE_SP') == '1'
vpp = int(os.environ.get('LOOM_EXAMPLE_VPP', '1'))
model = MegatronModel(model_id=model_id,
                      device_mesh=DeviceMesh.from_sizes(dp_size=dp, tp_size=tp, pp_size=pp,
                                                        cp_size=cp, sequence_parallel=sp,
                                                        vpp_size=vpp if vpp > 1 else None),
                      mixed_precision='no',
                      pre_wrap_hook=freeze_first_layer if freeze else None)
adapter = None
if lora_r:
    adapter = 'default'
    model.add_adapter_to_model(adapter, {'r': lora_r, 'lora_alpha': 2 * lora_r,
                                         'target_modules': 'all-linear'})
model.set_optimizer('default', adapter_name=adapter, lr=1e-3)
dataloader = DataLoader(samples, batch_size=8, device_mesh=model.device_mesh)
losses, steps = [], []
for data in dataloader:
    r = model.forward_backward(inputs=data, adapter_name=adapter)
    s = model.clip_grad_and_step(gradient_accumulation_steps=gas, adapter_name=adapter)
    losses.append(r['loss'])
    steps.append(s['stepped'])
if model.rank == 0:
    with open(out, 'w') as f:
        json.dump({'losses': losses, 'stepped': steps}, f)
