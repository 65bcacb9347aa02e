#!/usr/bin/env python3
"""Synthetic training data for bench/train_bench.sh: the same documents as a
loom token file (docs/token-file.md) and as a NumPy array for the peer.

  make_data.py --out PREFIX [--n-docs N] [--seq-len S] [--vocab V] [--seed K]

writes PREFIX.tokens (LOOMTOK1, version 1, no loss mask, vocab_size V
recorded) and PREFIX.npy (int32, shape (N, S)): N documents of exactly S
tokens each, document d of one is row d of the other.

The ids are drawn with a fixed seed (numpy's PCG64) from a skewed
distribution so that a model can learn something in a few steps: a Zipf-like
unigram law (p(rank k) ~ 1/(k + 10)^1.1) over a random permutation of
[0, V), and a bank of recurring phrases (4 to 32 tokens) that make up about
half of every document. The unigram entropy of the data is printed as a
reference for how far the loss can fall from ln V on unigram statistics
alone (the phrases let it fall further).
"""
import argparse
import os
import struct
import sys

import numpy as np

MAGIC = b"LOOMTOK1"
VERSION = 1


def zipf_probs(n, offset=10.0, power=1.1):
    p = 1.0 / np.power(np.arange(n, dtype=np.float64) + offset, power)
    return p / p.sum()


def make_docs(n_docs, seq_len, vocab, seed):
    rng = np.random.default_rng(seed)
    ids_by_rank = rng.permutation(vocab).astype(np.int64)
    p_tok = zipf_probs(vocab)
    cdf_tok = np.cumsum(p_tok)
    cdf_tok[-1] = 1.0

    def draw(k):
        r = np.searchsorted(cdf_tok, rng.random(k), side="right")
        return ids_by_rank[np.minimum(r, vocab - 1)]

    n_phrases = 512
    phrases = [draw(int(rng.integers(4, 33))) for _ in range(n_phrases)]
    cdf_phrase = np.cumsum(zipf_probs(n_phrases, offset=2.0, power=1.0))
    cdf_phrase[-1] = 1.0

    out = np.empty((n_docs, seq_len), dtype=np.int32)
    for d in range(n_docs):
        parts, have = [], 0
        while have < seq_len:
            if rng.random() < 0.5:
                j = int(np.searchsorted(cdf_phrase, rng.random(), side="right"))
                piece = phrases[min(j, n_phrases - 1)]
            else:
                piece = draw(int(rng.integers(1, 9)))
            parts.append(piece)
            have += len(piece)
        out[d] = np.concatenate(parts)[:seq_len]
    return out


def write_tokens(path, docs, vocab):
    """docs/token-file.md, exactly: 64-byte header, u64 offsets, u32 ids."""
    n_docs, seq_len = docs.shape
    n_tokens = n_docs * seq_len
    header = MAGIC + struct.pack("<IIQQQ", VERSION, 0, n_tokens, n_docs, vocab) + bytes(24)
    assert len(header) == 64
    offsets = np.arange(n_docs + 1, dtype="<u8") * seq_len
    ids = np.ascontiguousarray(docs, dtype="<u4").reshape(-1)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(offsets.tobytes())
        f.write(ids.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    size = os.path.getsize(path)
    want = 64 + 8 * (n_docs + 1) + 4 * n_tokens
    if size != want:
        sys.exit(f"make_data.py: {path} has {size} bytes, expected {want}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="writes OUT.tokens and OUT.npy")
    ap.add_argument("--n-docs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.n_docs < 1 or a.seq_len < 2 or a.vocab < 2 or a.vocab > 2**32:
        sys.exit("make_data.py: need --n-docs >= 1, --seq-len >= 2, 2 <= --vocab <= 2^32")
    docs = make_docs(a.n_docs, a.seq_len, a.vocab, a.seed)
    assert docs.min() >= 0 and docs.max() < a.vocab
    write_tokens(a.out + ".tokens", docs, a.vocab)
    np.save(a.out + ".npy.tmp.npy", docs)
    os.replace(a.out + ".npy.tmp.npy", a.out + ".npy")
    counts = np.bincount(docs.reshape(-1), minlength=a.vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    print(f"make_data.py: {a.out}.tokens and {a.out}.npy: {a.n_docs} documents x {a.seq_len} "
          f"tokens, ids in [0, {a.vocab}), seed {a.seed}; {len(p)} distinct ids, unigram "
          f"entropy {-(p * np.log(p)).sum():.3f} nats (ln V = {np.log(a.vocab):.3f})")


if __name__ == "__main__":
    main()
