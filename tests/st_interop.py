"""Interop between loom's safetensors code and Python's safetensors (used by
tests/test_safetensors.c, test st_python_interop).

Tensors are named "layer.<k>.<DTYPE>"; element i of tensor k holds a value
both sides compute: base = (7 i + 13 k) % 101, then base - 50 for signed
integers, (base - 50) / 4 for floats, base for U8 and (i + k) % 2 for BOOL.

  st_interop.py check DIR BASE COUNT
      loads DIR/BASE.safetensors, or every shard that
      DIR/BASE.safetensors.index.json names, with safetensors.numpy.load_file,
      and checks COUNT tensors, their values and the {"format": "pt"} metadata.
  st_interop.py write PATH NAME=D0,D1,... ...
      writes those tensors (NAME=  for a scalar) with safetensors.numpy.save_file,
      or, when one is BF16 (which numpy lacks), with safetensors' serialize_file.
"""
import json
import os
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def expected(name, shape):
    _, k, dtype = name.split(".")
    k = int(k)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    i = np.arange(n, dtype=np.int64)
    base = (i * 7 + k * 13) % 101
    if dtype == "BF16":  # exact: the values are small multiples of 1/4
        f = ((base - 50) * 0.25).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).reshape(shape)
    if dtype == "BOOL":
        v = ((i + k) % 2).astype(np.bool_)
    elif dtype == "U8":
        v = base.astype(np.uint8)
    elif dtype.startswith("F"):
        v = ((base - 50) * 0.25).astype(DTYPES[dtype])
    else:
        v = (base - 50).astype(DTYPES[dtype])
    return v.reshape(shape)


def check(directory, base, count):
    index = os.path.join(directory, base + ".safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        files = sorted(set(idx["weight_map"].values()))
        total = idx["metadata"]["total_size"]
    else:
        files, total, idx = [base + ".safetensors"], None, None
    seen = {}
    for leaf in files:
        path = os.path.join(directory, leaf)
        with safe_open(path, framework="numpy") as f:
            if f.metadata() != {"format": "pt"}:
                sys.exit(f"{path}: metadata {f.metadata()!r}")
        for name, arr in load_file(path).items():
            if name in seen:
                sys.exit(f"{name} in two files")
            if idx is not None and idx["weight_map"][name] != leaf:
                sys.exit(f"{name} is in {leaf}, the index says {idx['weight_map'][name]}")
            want = expected(name, arr.shape)
            if arr.dtype != want.dtype:
                sys.exit(f"{name}: dtype {arr.dtype}, expected {want.dtype}")
            if arr.tobytes() != want.tobytes():
                sys.exit(f"{name}: values differ")
            seen[name] = arr.nbytes
    if len(seen) != count:
        sys.exit(f"{len(seen)} tensors, expected {count}")
    if total is not None and total != sum(seen.values()):
        sys.exit(f"total_size {total}, tensors hold {sum(seen.values())} bytes")
    print(f"ok {len(seen)} tensors in {len(files)} files")


def serialize_raw(tensors, path, metadata):
    """Writes {name: (safetensors dtype name, shape, array)} through the
    low-level API: TensorSpec in safetensors >= 0.8, plain dicts before."""
    from safetensors import serialize_file
    try:
        from safetensors._safetensors_rust import TensorSpec

        def spec(dt, shape, a):
            return TensorSpec(dtype=dt, shape=list(shape), data_ptr=a.ctypes.data,
                              data_len=a.nbytes)
    except ImportError:
        def spec(dt, shape, a):
            return {"dtype": dt, "shape": list(shape), "data": a.tobytes()}
    specs = {k: spec(dt, shape, a) for k, (dt, shape, a) in tensors.items()}
    serialize_file(specs, path, metadata=metadata)


def write(path, specs):
    tensors = {}
    for s in specs:
        name, dims = s.split("=")
        shape = tuple(int(d) for d in dims.split(",")) if dims else ()
        tensors[name] = expected(name, shape)
    if any(k.endswith(".BF16") for k in tensors):
        raw = {k: ("bfloat16" if k.endswith(".BF16") else a.dtype.name, a.shape,
                   np.ascontiguousarray(a)) for k, a in tensors.items()}
        serialize_raw(raw, path, {"format": "pt"})
    else:
        save_file(tensors, path, metadata={"format": "pt"})
    print(f"ok wrote {len(tensors)} tensors")


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) >= 3 and sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
