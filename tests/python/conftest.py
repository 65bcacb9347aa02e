"""Shared pieces of the Python API tests: the package from this checkout, a
tiny random Qwen3 model, `loom train` as the reference, launchers."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
BUILD = os.environ.get("LOOM_BUILD", os.path.join(ROOT, "build"))
os.environ.setdefault("LOOM_LIBRARY", os.path.join(BUILD, "libloom.so"))
LOOM = os.path.join(BUILD, "loom")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none", "OMP_NUM_THREADS": "1",
           "LOOM_COMM_TIMEOUT": "120"}


def have_mpirun():
    return shutil.which("mpirun") is not None and "mpi" in features()


def features():
    import loom._lib as L
    return L.features()


def env(**extra):
    e = dict(os.environ)
    e.update(MPI_ENV)
    e["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + e.get("PYTHONPATH", "")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run(cmd, timeout=600, **kw):
    """Runs a command; fails the test with its output when it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if p.returncode:
        pytest.fail("%s exited %d\nstdout:\n%s\nstderr:\n%s" % (
            " ".join(map(str, cmd)), p.returncode, p.stdout[-4000:], p.stderr[-4000:]))
    return p


def mpirun(np_, argv, timeout=600, **extra):
    return run(["mpirun", "-np", str(np_)] + list(argv), timeout=timeout, env=env(**extra))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen3 (2 layers; 4 layers for pp x vpp) with the test tokenizer."""
    d = str(tmp_path_factory.mktemp("models") / "tiny-qwen3")
    run([LOOM, "init", "--out", d, "--config-override", '{"num_hidden_layers": 4}'])
    return d


def random_samples(n, length, vocab=1024, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, vocab, length).tolist()} for _ in range(n)]


def train_reference(model, tokens, steps, seq_len, gbs, mesh=None, np_=1, lr=1e-3, extra=()):
    """Per-step losses of `loom train` on a token file (file order, one
    document per row when each is seq_len long)."""
    out = os.path.join(os.path.dirname(tokens), "ref-%d-%s.jsonl" % (np_, mesh or "one"))
    if os.path.exists(out):
        os.unlink(out)
    argv = [LOOM, "train", "--model", model, "--data", tokens, "--train-steps", str(steps),
            "--seq-len", str(seq_len), "--global-batch-size", str(gbs), "--lr", str(lr),
            "--lr-decay-style", "constant", "--metrics-file", out, "--no-progress",
            "--log-level", "warn"] + list(extra)
    for kv in (mesh or "").split(","):
        if kv:
            k, v = kv.split("=")
            argv += ["--" + k, v]
    if np_ > 1:
        mpirun(np_, argv)
    else:
        run(argv, env=env())
    with open(out) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]
