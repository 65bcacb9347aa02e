"""Trains STEPS steps on a mesh, saving the state after SAVE_AT steps, or
loads a saved state and trains the remaining steps; rank 0 writes the losses.

    resume.py MODEL OUT.json DP TP PP STEPS SAVE_AT STATE_DIR [load] [lora]
"""
import json
import os
import sys

import numpy as np

from loom import MegatronModel, DeviceMesh

model_id, out = sys.argv[1:3]
dp, tp, pp, steps, save_at = (int(x) for x in sys.argv[3:8])
state = sys.argv[8]
load = 'load' in sys.argv[9:]
lora = 'lora' in sys.argv[9:]
cp = int(os.environ.get('LOOM_EXAMPLE_CP', '1'))
mesh = DeviceMesh.from_sizes(dp_size=dp, tp_size=tp, pp_size=pp, cp_size=cp)
model = MegatronModel(model_id, device_mesh=mesh, mixed_precision='no')
if lora:
    model.add_adapter_to_model('a', {'r': 4, 'lora_alpha': 8, 'target_modules': 'all-linear',
                                     'lora_dropout': 0.1})
model.set_optimizer('default', lr=1e-2)
model.set_lr_scheduler('default', max_lr=1e-2, lr_warmup_steps=1, lr_decay_steps=steps)
rng = np.random.default_rng(11)
batches = [[{'input_ids': rng.integers(0, 1024, 32)} for _ in range(8)] for _ in range(steps)]
first = 0
if load:
    first = model.load_state(state)['step']
losses = []
for k in range(first, steps):
    dr = mesh.dp_rank_of(model.rank)
    per = 8 // mesh.dp_size
    data = batches[k][dr * per:(dr + 1) * per]
    losses.append(model.forward_backward(inputs=data)['loss'])
    model.clip_grad_and_step()
    if not load and k + 1 == save_at:
        model.save_state(state, progress={'consumed_samples': 8 * save_at})
if model.rank == 0:
    with open(out, 'w') as f:
        json.dump({'losses': losses, 'first': first}, f)
