"""Inputs to loom batches: samples (pre-tokenized, or text/messages through
the model's tokenizer and chat template) packed into rows, split into
micro-batches the pipeline schedule accepts.

A sample is HF-style: input_ids and labels of the same length (labels[t] =
input_ids[t] where token t is trained, -100 where not), or a loss_mask (1:
trained); optionally loss_weights, one finite number per token aligned as
labels (weight t scales the loss of label t and its gradient; a policy
gradient's advantages, a soft mask). loom's batches are next-token style:
targets[t] = labels[t + 1] within the sample, -100 at its last token, and
the weights move with the labels.
"""
import json
import numbers

import numpy as np

from .errors import InvalidArgumentError, ShapeError, ConfigError

IGNORE = -100


def _int_array(name, v, where):
    try:
        a = np.asarray(v)
    except Exception as e:  # ragged lists and such
        raise InvalidArgumentError("%s: %s cannot be read as an array (%s)" % (where, name, e))
    if a.dtype == object or not (np.issubdtype(a.dtype, np.integer) or a.dtype == bool
                                 or a.size == 0):
        raise InvalidArgumentError("%s: %s must hold integers, not %s" % (where, name, a.dtype))
    return a.astype(np.int64, copy=False)


def _shape(v):
    """np.shape of v; None when it is no array (ragged lists)."""
    try:
        return np.shape(v)
    except ValueError:
        return None


def _weights(v, shape, where, against="input_ids"):
    """loss_weights as float32 of `shape` (a sample's 1-D, or the rows of a
    dict of arrays), every one a finite number; errors name the index."""
    try:
        a = np.asarray(v)
    except Exception as e:  # ragged lists and such
        raise InvalidArgumentError("%s: loss_weights cannot be read as an array (%s)" % (where, e))
    if a.dtype == object or not (np.issubdtype(a.dtype, np.integer) or
                                 np.issubdtype(a.dtype, np.floating) or a.dtype == bool):
        raise InvalidArgumentError("%s: loss_weights must hold real numbers, not %s"
                                   % (where, a.dtype))
    if a.shape != tuple(shape):
        raise ShapeError("%s: loss_weights has shape %s, %s %s; give one weight per token, "
                         "aligned as labels" % (where, a.shape, against, tuple(shape)))
    with np.errstate(over="ignore"):  # too large for float32: refused below
        w = a.astype(np.float32)
    bad = ~np.isfinite(w)
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        raise InvalidArgumentError("%s: loss_weights[%s] = %r is not a finite number%s" % (
            where, ", ".join(map(str, i)), a[i].item(),
            "" if not np.isfinite(a[i]) else " as float32"))
    return w


def _sample_from_ids(d, where):
    ids = _int_array("input_ids", d["input_ids"], where)
    if ids.ndim != 1:
        raise ShapeError("%s: input_ids must be 1-D per sample, got shape %s" % (where, ids.shape))
    if ids.size == 0:
        raise ShapeError("%s: input_ids is empty" % where)
    if "labels" in d and d["labels"] is not None:
        labels = _int_array("labels", d["labels"], where)
        if labels.shape != ids.shape:
            raise ShapeError("%s: labels has shape %s, input_ids %s; give one label per token "
                             "(-100 for no loss)" % (where, labels.shape, ids.shape))
        bad = (labels != IGNORE) & (labels < 0)
        if bad.any():
            raise InvalidArgumentError("%s: labels[%d] = %d is negative and not -100"
                                       % (where, int(np.argmax(bad)), int(labels[bad][0])))
    elif "loss_mask" in d and d["loss_mask"] is not None:
        mask = _int_array("loss_mask", d["loss_mask"], where)
        if mask.shape != ids.shape:
            raise ShapeError("%s: loss_mask has shape %s, input_ids %s"
                             % (where, mask.shape, ids.shape))
        if ((mask != 0) & (mask != 1)).any():
            raise InvalidArgumentError("%s: loss_mask must hold 0 and 1 only" % where)
        labels = np.where(mask == 1, ids, IGNORE)
    else:
        labels = ids.copy()
    pos = None
    if d.get("position_ids") is not None:
        pos = _int_array("position_ids", d["position_ids"], where)
        if pos.shape != ids.shape:
            raise ShapeError("%s: position_ids has shape %s, input_ids %s"
                             % (where, pos.shape, ids.shape))
        if (pos < 0).any():
            raise InvalidArgumentError("%s: position_ids must be >= 0" % where)
    w = None if d.get("loss_weights") is None else _weights(d["loss_weights"], ids.shape, where)
    return ids, labels, pos, w


_KNOWN = {"input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "loss_weights"}
_RAW = {"text", "messages", "prompt", "completion"}


def to_samples(inputs, encoder=None, append_eos=True, vocab_size=None):
    """[(ids, labels, position_ids or None, loss_weights or None)] of the
    inputs (see the module)."""
    if isinstance(inputs, dict):
        if "input_ids" in inputs:
            ids = np.asarray(inputs["input_ids"]) if not isinstance(inputs["input_ids"], list) \
                else None
            if ids is not None and ids.ndim == 2:  # a dict of (rows, seq) arrays
                for k, v in inputs.items():
                    if k in _KNOWN and v is not None and _shape(v) != ids.shape:
                        raise ShapeError("inputs: %s has shape %s, input_ids %s" % (
                            k, _shape(v) or "of no array (ragged rows?)", ids.shape))
                if inputs.get("loss_weights") is not None:  # indices of the whole array
                    _weights(inputs["loss_weights"], ids.shape, "inputs")
                rows = []
                am = inputs.get("attention_mask")
                for r in range(ids.shape[0]):
                    d = {k: np.asarray(v)[r] for k, v in inputs.items()
                         if k in _KNOWN and v is not None}
                    if am is not None:
                        keep = np.asarray(d.pop("attention_mask")).astype(bool)
                        d = {k: v[keep] for k, v in d.items()}
                    rows.append(d)
                inputs = rows
            else:
                inputs = [inputs]
        else:
            inputs = [inputs]
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__iter__"):
        raise InvalidArgumentError("inputs must be a list of samples (dicts with input_ids, or "
                                   "text/messages with set_template), or a dict of arrays; got %s"
                                   % type(inputs).__name__)
    out = []
    for i, s in enumerate(inputs):
        where = "inputs[%d]" % i
        if not isinstance(s, dict):
            raise InvalidArgumentError("%s is a %s; each sample must be a dict" %
                                       (where, type(s).__name__))
        if "input_ids" in s:
            # other keys (e.g. Twinkle's bookkeeping) ride along unused
            ids, labels, pos, w = _sample_from_ids(s, where)
        elif _RAW & set(s):
            if encoder is None:
                raise ConfigError("%s has %s but no input_ids: call set_template() first so loom "
                                  "tokenizes it with the model's tokenizer and chat template"
                                  % (where, "/".join(sorted(_RAW & set(s)))))
            ids, labels = encoder.encode(s, append_eos=append_eos, where=where)
            pos = None
            w = None if s.get("loss_weights") is None else \
                _weights(s["loss_weights"], ids.shape, where, "its tokens (as tokenized) have")
        else:
            raise InvalidArgumentError("%s has none of input_ids, text, messages, prompt/completion "
                                       "(keys: %s)" % (where, ", ".join(sorted(s)) or "none"))
        if vocab_size is not None:
            bad = (ids < 0) | (ids >= vocab_size)
            if bad.any():
                t = int(np.argmax(bad))
                raise InvalidArgumentError("%s: input_ids[%d] = %d is outside the vocabulary "
                                           "[0, %d) of this model; was it tokenized for another "
                                           "model?" % (where, t, int(ids[t]), vocab_size))
            bad = (labels != IGNORE) & (labels >= vocab_size)
            if bad.any():
                t = int(np.argmax(bad))
                raise InvalidArgumentError("%s: labels[%d] = %d is outside the vocabulary [0, %d)"
                                           % (where, t, int(labels[t]), vocab_size))
        out.append((ids, labels, pos, w))
    if not out:
        raise InvalidArgumentError("inputs is empty: give at least one sample")
    return out


def _round_up(n, k):
    return (n + k - 1) // k * k


def micro_batch_count(rows, mbs, pp, vpp, group):
    """Micro-batches for `rows` rows of `mbs`: enough, and a count the
    interleaved schedule accepts (>= group, last group whole or >= pp)."""
    n_micro = max(1, -(-rows // mbs))
    if vpp > 1:
        g = group or pp
        while n_micro < g or (n_micro % g and n_micro % g < pp):
            n_micro += 1
    return n_micro


class Packed:
    """Rows of a batch and where each sample sits in them; loss_weights None
    when no sample has any (the library then weighs every token 1)."""

    def __init__(self, input_ids, targets, position_ids, cu_seqlens, places, n_micro,
                 loss_weights=None):
        self.input_ids, self.targets, self.position_ids = input_ids, targets, position_ids
        self.cu_seqlens, self.places, self.n_micro = cu_seqlens, places, n_micro
        self.loss_weights = loss_weights

    rows = property(lambda self: self.input_ids.shape[0])
    seq_len = property(lambda self: self.input_ids.shape[1])


def pack(samples, seq_len=None, divisor=1, micro_batch_size=None, pp=1, vpp=1, group=None):
    """Samples into rows: with seq_len, greedily as `loom train` packs (the next
    sample goes into the current row when it fits, else starts the next); without,
    one sample per row padded to the longest. Row length a multiple of `divisor`.
    Then padded with empty rows to whole micro-batches of micro_batch_size rows
    (default: all rows in one micro-batch without a pipeline, 1 row with one).
    Weights, when a sample has them, shift with its labels; every other token
    (samples without weights, padding) weighs 1."""
    lens = [len(s[0]) for s in samples]
    if seq_len is not None:
        if not isinstance(seq_len, numbers.Integral) or seq_len < 2:
            raise InvalidArgumentError("seq_len=%r must be an int >= 2" % (seq_len,))
        S = _round_up(int(seq_len), divisor)
        for i, n in enumerate(lens):
            if n > S:
                raise ShapeError("inputs[%d] has %d tokens, more than seq_len=%d; truncate it or "
                                 "raise seq_len" % (i, n, S))
        rows, cur, room = [], [], S
        for i, n in enumerate(lens):
            if n > room and cur:
                rows.append(cur)
                cur, room = [], S
            cur.append(i)
            room -= n
        rows.append(cur)
    else:
        S = _round_up(max(lens), divisor)
        rows = [[i] for i in range(len(samples))]
    if micro_batch_size is None:
        mbs = len(rows) if pp == 1 else 1
    else:
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, numbers.Integral) \
                or micro_batch_size < 1:
            raise InvalidArgumentError("micro_batch_size=%r must be an int >= 1"
                                       % (micro_batch_size,))
        mbs = int(micro_batch_size)
    n_micro = micro_batch_count(len(rows), mbs, pp, vpp, group)
    R = n_micro * mbs
    ids = np.zeros((R, S), np.int32)
    tg = np.full((R, S), IGNORE, np.int32)
    pos = np.zeros((R, S), np.int32)
    wt = np.ones((R, S), np.float32) if any(s[3] is not None for s in samples) else None
    cu, places = [0], [None] * len(samples)
    for r in range(R):
        off = 0
        for i in (rows[r] if r < len(rows) else ()):
            sid, lab, p, w = samples[i]
            n = len(sid)
            ids[r, off:off + n] = sid
            tg[r, off:off + n - 1] = lab[1:]
            if w is not None:
                wt[r, off:off + n - 1] = w[1:]
            pos[r, off:off + n] = p if p is not None else np.arange(n)
            places[i] = (r, off, n)
            off += n
            cu.append(r * S + off)
        if off < S:  # padding: a segment of its own
            pos[r, off:] = np.arange(S - off)
            cu.append((r + 1) * S)
    return Packed(ids, tg, pos, np.asarray(cu, np.int32), places, n_micro, wt)


def rows_in_place(inputs, vocab_size, divisor, micro_batch_size, pp, vpp, group):
    """A dict of (rows, seq) arrays whose input_ids loom can read where they
    lie (int32, C order, seq a multiple of divisor, whole micro-batches the
    schedule takes, no attention_mask / position_ids): a Packed holding that
    array itself and the one array of next-token targets (and of shifted
    weights, with loss_weights); else None."""
    if not isinstance(inputs, dict):
        return None
    ids = inputs.get("input_ids")
    if not isinstance(ids, np.ndarray) or ids.ndim != 2 or ids.dtype != np.int32 or \
            not ids.flags["C_CONTIGUOUS"] or ids.size == 0:
        return None
    if inputs.get("attention_mask") is not None or inputs.get("position_ids") is not None or \
            inputs.get("loss_mask") is not None:
        return None
    R, S = ids.shape
    if S < 2 or S % divisor:
        return None
    mbs = (R if pp == 1 else 1) if micro_batch_size is None else micro_batch_size
    if isinstance(mbs, bool) or not isinstance(mbs, numbers.Integral) or mbs < 1 or R % mbs:
        return None
    n_micro = R // mbs
    if micro_batch_count(R, mbs, pp, vpp, group) != n_micro:
        return None
    labels = inputs.get("labels")
    if labels is None:
        labels = ids
    labels = np.asarray(labels)
    if labels.shape != ids.shape or not np.issubdtype(labels.dtype, np.integer):
        return None  # the general path names what is wrong
    weights = inputs.get("loss_weights")
    if weights is not None and _shape(weights) != ids.shape:
        return None
    where = "inputs"
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        r, t = np.argwhere(bad)[0]
        raise InvalidArgumentError("%s: input_ids[%d, %d] = %d is outside the vocabulary [0, %d) "
                                   "of this model; was it tokenized for another model?"
                                   % (where, r, t, int(ids[r, t]), vocab_size))
    bad = (labels != IGNORE) & ((labels < 0) | (labels >= vocab_size))
    if bad.any():
        r, t = np.argwhere(bad)[0]
        raise InvalidArgumentError("%s: labels[%d, %d] = %d is outside the vocabulary [0, %d) "
                                   "and is not -100" % (where, r, t, int(labels[r, t]), vocab_size))
    tg = np.full((R, S), IGNORE, np.int32)
    tg[:, :-1] = labels[:, 1:]
    wt = None
    if weights is not None:
        w = _weights(weights, ids.shape, where)
        wt = np.ones((R, S), np.float32)
        wt[:, :-1] = w[:, 1:]
    return Packed(ids, tg, None, None, [(r, 0, S) for r in range(R)], n_micro, wt)


def unpack(flat, packed, shift=True):
    """Per-sample arrays from a per-token (rows*seq_len) output, label-aligned:
    out[t] belongs to token t (the prediction made at t-1); out[0] = 0."""
    S = packed.seq_len
    res = []
    for (r, off, n) in packed.places:
        a = np.zeros(n, flat.dtype)
        seg = flat[r * S + off: r * S + off + n]
        if shift:
            a[1:] = seg[:n - 1]
        else:
            a[:] = seg
        res.append(a)
    return res


def dumps(sample):
    try:
        return json.dumps(sample, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError("a sample cannot be written as JSON for the tokenizer: %s" % e)
