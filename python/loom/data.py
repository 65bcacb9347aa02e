"""DataLoader: global batches of samples, each data-parallel rank given its
slice (Twinkle's slice_dp), with a position that resumes it; write_tokens:
loom's .tokens file from pre-tokenized samples (docs/token-file.md)."""
import json
import os
import struct
import tempfile

import numpy as np

from .errors import FormatError, InvalidArgumentError, LoomIOError, ShapeError
from .mesh import DeviceMesh, launcher_world


def _read_jsonl(path):
    out = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise LoomIOError("DataLoader: cannot open %s: %s" % (path, e.strerror))
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                s = json.loads(line)
            except ValueError as e:
                raise FormatError("%s:%d: not JSON (%s)" % (path, n, e))
            if not isinstance(s, dict):
                raise FormatError("%s:%d: a sample must be a JSON object" % (path, n))
            out.append(s)
    if not out:
        raise FormatError("%s: no samples" % path)
    return out


class DataLoader:
    """Iterates global batches of `batch_size` samples; with a device_mesh of
    dp > 1 in an SPMD job each rank gets its data-parallel rank's contiguous
    slice of batch_size / dp samples. In a Ray driver (or alone) it yields the
    whole batch: the remote group slices it."""

    def __init__(self, dataset, batch_size, device_mesh=None, shuffle=False, seed=42,
                 drop_last=False, **kwargs):
        if kwargs:
            raise InvalidArgumentError("DataLoader: unknown option(s) %s (loom takes dataset, "
                                       "batch_size, device_mesh, shuffle, seed, drop_last)"
                                       % ", ".join(sorted(kwargs)))
        if isinstance(dataset, (str, os.PathLike)):
            dataset = _read_jsonl(os.fspath(dataset))
        try:
            n = len(dataset)
        except TypeError:
            raise InvalidArgumentError("DataLoader: dataset must be a list of samples or a JSONL "
                                       "path, not %s" % type(dataset).__name__)
        if n == 0:
            raise InvalidArgumentError("DataLoader: the dataset is empty")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError("DataLoader: batch_size=%r must be an int >= 1"
                                       % (batch_size,))
        if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
            raise InvalidArgumentError("DataLoader: device_mesh must be a loom.DeviceMesh")
        self.dataset, self.batch_size, self.device_mesh = dataset, batch_size, device_mesh
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.dp_size, self.dp_rank = 1, 0
        rank, world, var = launcher_world()
        if device_mesh is not None and var is not None and world > 1:
            if device_mesh.world_size != world:
                raise ShapeError("DataLoader: device_mesh %r has %d ranks, the launcher %d"
                                 % (device_mesh, device_mesh.world_size, world))
            self.dp_size, self.dp_rank = device_mesh.dp_size, device_mesh.dp_rank_of(rank)
        if batch_size % self.dp_size:
            raise ShapeError("DataLoader: batch_size=%d cannot be split over dp=%d ranks; use a "
                             "multiple of %d" % (batch_size, self.dp_size, self.dp_size))
        self.epoch, self.index = 0, 0

    def _order(self, epoch):
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __len__(self):
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        order = self._order(self.epoch)
        n = len(order)
        while self.index < n:
            idx = order[self.index:self.index + self.batch_size]
            if len(idx) < self.batch_size and self.drop_last:
                break
            self.index += len(idx)
            if self.dp_size > 1:
                if len(idx) % self.dp_size:  # a short last batch: whole samples per rank
                    idx = idx[:len(idx) - len(idx) % self.dp_size]
                    if not len(idx):
                        break
                per = len(idx) // self.dp_size
                idx = idx[self.dp_rank * per:(self.dp_rank + 1) * per]
            yield [self.dataset[int(i)] for i in idx]
        self.epoch += 1
        self.index = 0

    def state_dict(self):
        """Where the next batch starts: {epoch, index} (load_state_dict resumes there)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state):
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def write_tokens(path, samples, vocab_size=0):
    """Writes loom's token file (docs/token-file.md): one document per sample
    (its input_ids; a loss mask from labels != -100 or loss_mask when any is
    given). Atomic: a temporary file renamed over `path`."""
    docs, masks, any_mask = [], [], False
    for i, s in enumerate(samples):
        ids = np.asarray(s["input_ids"] if isinstance(s, dict) else s, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or (ids < 0).any() or (ids >= 2 ** 32).any():
            raise InvalidArgumentError("write_tokens: sample %d: input_ids must be a non-empty "
                                       "1-D list of ids >= 0" % i)
        m = np.ones(ids.size, np.uint8)
        if isinstance(s, dict) and s.get("labels") is not None:
            m = (np.asarray(s["labels"]) != -100).astype(np.uint8)
            any_mask = True
        elif isinstance(s, dict) and s.get("loss_mask") is not None:
            m = np.asarray(s["loss_mask"]).astype(np.uint8)
            any_mask = True
        if vocab_size and (ids >= vocab_size).any():
            raise InvalidArgumentError("write_tokens: sample %d has an id >= vocab_size=%d"
                                       % (i, vocab_size))
        docs.append(ids.astype(np.uint32))
        masks.append(m)
    if not docs:
        raise InvalidArgumentError("write_tokens: no samples")
    offsets = np.zeros(len(docs) + 1, np.uint64)
    offsets[1:] = np.cumsum([d.size for d in docs])
    head = b"LOOMTOK1" + struct.pack("<IIQQQ", 1, 1 if any_mask else 0, int(offsets[-1]),
                                     len(docs), vocab_size) + b"\0" * 24
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tokens.", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(offsets.astype("<u8").tobytes())
            f.write(np.concatenate(docs).astype("<u4").tobytes())
            if any_mask:
                f.write(np.concatenate(masks).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
