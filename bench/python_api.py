"""The Python API's training speed against `loom train` (issue 34): the usage
example (MegatronModel, DeviceMesh, DataLoader, forward_backward,
clip_grad_and_step) on a token file's documents, one per row, timed per step.

    python_api.py MODEL DATA.tokens OUT.json STEPS LORA_R [MODE]

Run alone (1 GPU), under torchrun --nproc-per-node N (SPMD), or with MODE=ray
(a driver with remote_group='actor', N = LOOM_BENCH_GPUS actors). Writes
{"tokens_per_s": [...], "losses": [...]} from rank 0 / the driver.
"""
import json
import os
import struct
import sys
import time

import numpy as np

import loom
from loom import DataLoader, DeviceMesh, MegatronModel

model_id, data, out = sys.argv[1:4]
steps, lora_r = int(sys.argv[4]), int(sys.argv[5])
mode = sys.argv[6] if len(sys.argv) > 6 else "spmd"


def read_tokens(path):
    with open(path, "rb") as f:
        head = f.read(64)
        n_tok, n_docs = struct.unpack("<QQ", head[16:32])
        off = np.frombuffer(f.read(8 * (n_docs + 1)), "<u8")
        ids = np.frombuffer(f.read(4 * n_tok), "<u4").astype(np.int64)
    return [{"input_ids": ids[off[i]:off[i + 1]]} for i in range(n_docs)]


samples = read_tokens(data)
if mode == "ray":
    loom.init(mode="ray")
    n = int(os.environ.get("LOOM_BENCH_GPUS", "1"))
    mesh = DeviceMesh.from_sizes(dp_size=n, world_size=n)
    model = MegatronModel(model_id, device_mesh=mesh, remote_group="actor")
else:
    mesh = DeviceMesh.from_sizes()
    model = MegatronModel(model_id, device_mesh=mesh)
model.add_adapter_to_model("default", {"r": lora_r, "lora_alpha": 2 * lora_r,
                                       "target_modules": "all-linear"})
model.set_optimizer("default", adapter_name="default", lr=1e-4)
dl = DataLoader(samples, batch_size=mesh.dp_size, device_mesh=mesh)
tps, losses = [], []
for i, batch in enumerate(dl):
    if i == steps:
        break
    t0 = time.perf_counter()
    r = model.forward_backward(inputs=batch, adapter_name="default")
    s = model.clip_grad_and_step(adapter_name="default")
    dt = time.perf_counter() - t0
    ntok = sum(len(x["input_ids"]) for x in batch) * (mesh.dp_size if mode != "ray" else 1)
    tps.append(ntok / dt)
    losses.append(float(r["loss"]))
rank = int(os.environ.get("RANK", "0"))
if rank == 0:
    with open(out, "w") as f:
        json.dump({"tokens_per_s": tps, "losses": losses, "mode": mode}, f)
