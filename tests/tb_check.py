"""Checks loom's TensorBoard event files with TensorBoard's own reader.

usage: tb_check.py DIR METRICS.jsonl

Loads DIR with tensorboard's EventAccumulator and checks that every scalar
tag holds exactly the steps and values of the matching key of the metrics
JSONL that the same run wrote (values as float32; peak_mem_bytes in GiB).
Also re-reads each event file's records directly, checking the framing and
both masked CRC32Cs. Prints "ok" and exits 0, or says what differs and
exits 1 (2 when tensorboard is not installed).
"""
import glob
import json
import math
import os
import struct
import sys

# JSONL key -> TensorBoard tag (src/train/metrics.c, tb_tags)
TAGS = {
    "consumed_samples": "consumed-samples",
    "consumed_tokens": "consumed-tokens",
    "loss": "lm loss",
    "grad_norm": "grad-norm",
    "lr": "learning-rate",
    "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "mfu",
    "peak_mem_bytes": "mem/peak_gib",
    "skipped_steps": "skipped-iterations",
    "elapsed_s": "elapsed-time-s",
    "aux_loss": "load_balancing_loss",
    "expert_tokens_max": "moe/expert_tokens_max",
    "expert_imbalance": "moe/expert_imbalance",
    "z_loss": "z_loss",
}


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def check_framing(path):
    data = open(path, "rb").read()
    off, n = 0, 0
    while off < len(data):
        if off + 12 > len(data):
            return f"{path}: truncated record header at byte {off}"
        (length,) = struct.unpack_from("<Q", data, off)
        (lcrc,) = struct.unpack_from("<I", data, off + 8)
        if lcrc != masked(crc32c(data[off:off + 8])):
            return f"{path}: record {n}: bad length CRC"
        body = data[off + 12:off + 12 + length]
        if len(body) != length or off + 16 + length > len(data):
            return f"{path}: record {n}: truncated"
        (dcrc,) = struct.unpack_from("<I", data, off + 12 + length)
        if dcrc != masked(crc32c(body)):
            return f"{path}: record {n}: bad data CRC"
        off += 16 + length
        n += 1
    if n < 2:
        return f"{path}: {n} records (want the version event and one per logged step)"
    return None


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 1
    logdir, jsonl = sys.argv[1], sys.argv[2]
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        print(f"tensorboard not installed: {e}")
        return 2
    files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    if not files:
        print(f"{logdir}: no events.out.tfevents.* file")
        return 1
    for f in files:
        err = check_framing(f)
        if err:
            print(err)
            return 1
    want = {}  # tag -> [(step, value)]
    with open(jsonl) as fh:
        for line in fh:
            rec = json.loads(line)
            for key, tag in TAGS.items():
                v = rec.get(key)
                if v is None:
                    continue
                if key == "peak_mem_bytes":
                    v = v / 2**30
                want.setdefault(tag, []).append((rec["step"], float(v)))
            # a mixture of experts: each layer's imbalance, tagged by layer
            for layer, v in zip(rec.get("moe_layers", []), rec.get("expert_imbalance_by_layer", [])):
                want.setdefault(f"moe/expert_imbalance/layer_{layer}", []).append((rec["step"], float(v)))
    if not want:
        print(f"{jsonl}: no scalars")
        return 1
    ea = EventAccumulator(logdir, size_guidance={"scalars": 0})
    ea.Reload()
    have = set(ea.Tags().get("scalars", []))
    if have != set(want):
        print(f"tags: TensorBoard has {sorted(have)}, the JSONL gives {sorted(want)}")
        return 1
    for tag, pts in want.items():
        got = [(e.step, e.value) for e in ea.Scalars(tag)]
        if [s for s, _ in got] != [s for s, _ in pts]:
            print(f"{tag}: steps {[s for s, _ in got]} != {[s for s, _ in pts]}")
            return 1
        for (s, g), (_, w) in zip(got, pts):
            f32 = struct.unpack("<f", struct.pack("<f", w))[0]
            if not math.isclose(g, f32, rel_tol=1e-6, abs_tol=1e-30):
                print(f"{tag} at step {s}: TensorBoard reads {g!r}, the JSONL has {w!r}")
                return 1
    print(f"ok: {len(want)} tags, {len(next(iter(want.values())))} steps, {len(files)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
