"""The usage example under mpirun and under a torchrun-style environment
without MPI, against `loom train` on the same data and settings."""
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import LOOM, ROOT, env, have_mpirun, features, mpirun, random_samples, run, \
    train_reference

import loom

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "example.py")
SEQ = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """32 samples of exactly SEQ tokens (one per row in `loom train`), as JSONL
    for the DataLoader and as a token file for `loom train`."""
    d = tmp_path_factory.mktemp("spmd")
    samples = random_samples(32, SEQ, seed=7)
    jl = str(d / "samples.jsonl")
    with open(jl, "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    tok = str(d / "samples.tokens")
    loom.write_tokens(tok, samples, vocab_size=1024)
    return jl, tok


def _losses(out):
    with open(out) as f:
        return json.load(f)


@pytest.mark.skipif(not have_mpirun(), reason="no mpirun, or loom built without MPI")
def test_example_under_mpirun_matches_loom_train(tiny_model, data, tmp_path):
    jl, tok = data
    out = str(tmp_path / "losses.json")
    mpirun(8, [sys.executable, SCRIPT, tiny_model, jl, out, "2", "2", "2"])
    got = _losses(out)["losses"]
    ref = train_reference(tiny_model, tok, steps=4, seq_len=SEQ, gbs=8, mesh="tp=2,pp=2", np_=8)
    assert len(got) == len(ref) == 4
    for g, r in zip(got, ref):
        assert abs(g - r) < 1e-5, (got, ref)
    # and the one-process run of the same script
    out1 = str(tmp_path / "losses1.json")
    subprocess.run([sys.executable, SCRIPT, tiny_model, jl, out1, "1", "1", "1"], check=True,
                   env=env(), capture_output=True)
    for g, r in zip(_losses(out1)["losses"], ref):
        assert abs(g - r) < 1e-5


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif("gloo" not in features(),
                    reason="loom built without Gloo: install libgloo-dev and rebuild")
def test_example_under_torchrun_environment_without_mpi(tiny_model, data, tmp_path):
    jl, tok = data
    out = str(tmp_path / "losses.json")
    port = _free_port()
    procs = []
    for r in range(8):
        e = env(RANK=r, WORLD_SIZE=8, LOCAL_RANK=r, LOCAL_WORLD_SIZE=8, MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port, LOOM_COMM_TIMEOUT=60)
        for k in list(e):
            if k.startswith(("OMPI_", "PMI", "PMIX")) and k not in ("OMPI_ALLOW_RUN_AS_ROOT",
                                                                    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
                del e[k]
        procs.append(subprocess.Popen([sys.executable, SCRIPT, tiny_model, jl, out, "2", "2",
                                       "2"], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, "rank %d:\n%s" % (r, logs[r][-3000:])
    ref = train_reference(tiny_model, tok, steps=4, seq_len=SEQ, gbs=8)
    for g, rr in zip(_losses(out)["losses"], ref):
        assert abs(g - rr) < 1e-5


@pytest.mark.skipif(not have_mpirun(), reason="no mpirun, or loom built without MPI")
def test_lora_example_under_mpirun_matches_loom_train(tiny_model, data, tmp_path):
    jl, tok = data
    out = str(tmp_path / "losses.json")
    mpirun(4, [sys.executable, SCRIPT, tiny_model, jl, out, "2", "1", "2", "4"])
    ref = train_reference(tiny_model, tok, steps=4, seq_len=SEQ, gbs=8,
                          extra=["--lora-r", "4", "--lora-alpha", "8", "--lora-target",
                                 "all-linear", "--seed", "42"])
    got = _losses(out)["losses"]
    for g, r in zip(got, ref):
        assert abs(g - r) < 1e-5, (got, ref)


@pytest.mark.skipif(not have_mpirun(), reason="no mpirun, or loom built without MPI")
def test_frozen_layers_under_mpirun_match_one_process(tiny_model, data, tmp_path):
    jl, _ = data
    runs = {}
    for name, np_, mesh, extra in (("mesh", 8, ["2", "2", "2"], ["0", "1", "freeze"]),
                                   ("one", 1, ["1", "1", "1"], ["0", "1", "freeze"]),
                                   ("unfrozen", 1, ["1", "1", "1"], [])):
        out = str(tmp_path / (name + ".json"))
        argv = [sys.executable, SCRIPT, tiny_model, jl, out] + mesh + extra
        if np_ > 1:
            mpirun(np_, argv)
        else:
            subprocess.run(argv, check=True, env=env(), capture_output=True)
        runs[name] = _losses(out)["losses"]
    for g, r in zip(runs["mesh"], runs["one"]):
        assert abs(g - r) < 1e-5, runs
    assert abs(runs["one"][-1] - runs["unfrozen"][-1]) > 1e-4  # freezing changed training


META_CHECK = """
import sys
from loom import MegatronModel, DeviceMesh
mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2)
meta = {p['name']: p for p in MegatronModel.meta(sys.argv[1], device_mesh=mesh).parameters}
m = MegatronModel(sys.argv[1], device_mesh=mesh, mixed_precision='no')
pp = m.mesh_coords()['pp_rank']
n = 0
for p in m.parameters_table():
    q = meta[p['name']]
    assert q['pp_stage'] == p['pp_stage'], (p, q)
    if p['local_shape'] is not None and p['pp_stage'] == pp:
        assert q['local_shape'] == p['local_shape'], (p, q)
        n += 1
assert n > 0
print('ok', n)
"""


@pytest.mark.skipif(not have_mpirun(), reason="no mpirun, or loom built without MPI")
def test_meta_model_matches_what_each_rank_holds(tiny_model):
    p = mpirun(4, [sys.executable, "-c", META_CHECK, tiny_model])
    assert p.stdout.count("ok") == 4  # mpirun interleaves the ranks' lines; each asserts itself


LOOP = """
import sys, time
from loom import MegatronModel, DeviceMesh
m = MegatronModel(sys.argv[1], device_mesh=DeviceMesh.from_sizes(), mixed_precision='no')
m.set_optimizer('default', lr=1e-3)
data = [{'input_ids': list(range(i, i + 32))} for i in range(4)]
print('training', flush=True)
while True:
    m.forward_backward(inputs=data)
    m.clip_grad_and_step()
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_stops_training_cleanly(tiny_model, ranks):
    import signal
    import time
    if ranks > 1 and not have_mpirun():
        pytest.skip("no mpirun, or loom built without MPI")
    argv = [sys.executable, "-c", LOOP, tiny_model]
    if ranks > 1:
        argv = ["mpirun", "-np", str(ranks)] + argv
    p = subprocess.Popen(argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().startswith("training")
        time.sleep(1.0)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0 and took < 20, (p.returncode, took)
    assert "KeyboardInterrupt" in err or ranks > 1, err[-2000:]


@pytest.mark.skipif(not have_mpirun(), reason="no mpirun, or loom built without MPI")
@pytest.mark.parametrize("np_,mesh,cp,sp,vpp", [(4, ["1", "2", "1"], 2, True, 1),
                                                (8, ["2", "1", "2"], 2, False, 1),
                                                (4, ["2", "1", "2"], 1, False, 2)],
                         ids=["tp2-sp-cp2", "dp2-cp2-pp2", "dp2-pp2-vpp2"])
def test_other_layouts_match_loom_train(tiny_model, data, tmp_path, np_, mesh, cp, sp, vpp):
    jl, tok = data
    out = str(tmp_path / "losses.json")
    mpirun(np_, [sys.executable, SCRIPT, tiny_model, jl, out] + mesh,
           LOOM_EXAMPLE_CP=cp, LOOM_EXAMPLE_SP=int(sp), LOOM_EXAMPLE_VPP=vpp)
    ref = train_reference(tiny_model, tok, steps=4, seq_len=SEQ, gbs=8)
    got = _losses(out)["losses"]
    for g, r in zip(got, ref):
        assert abs(g - r) < 1e-5, (got, ref)


@pytest.fixture(scope="module")
def weighted(tmp_path_factory, tiny_model):
    """24 samples of 20..32 tokens (the prompt of every third masked) with
    random loss_weights (a quarter 0, about half the rest negative), as
    JSONL; and the usage example's 3 losses on it in one process."""
    import numpy as np
    d = tmp_path_factory.mktemp("weighted")
    rng = np.random.default_rng(11)
    samples = []
    for i in range(24):
        n = int(rng.integers(20, SEQ + 1))
        ids = rng.integers(0, 1024, n)
        w = rng.normal(size=n)
        w[rng.random(n) < 0.25] = 0
        s = {"input_ids": ids.tolist(), "loss_weights": w.tolist()}
        if i % 3 == 0:
            s["labels"] = [-100] * 6 + ids[6:].tolist()
        samples.append(s)
    runs = {}
    for name, keep in (("weighted", True), ("plain", False)):
        jl = str(d / (name + ".jsonl"))
        with open(jl, "w") as f:
            for s in samples:
                f.write(json.dumps(s if keep else {k: v for k, v in s.items()
                                                   if k != "loss_weights"}) + "\n")
        out = str(d / (name + ".json"))
        subprocess.run([sys.executable, SCRIPT, tiny_model, jl, out, "1", "1", "1"], check=True,
                       env=env(), capture_output=True)
        runs[name] = (jl, _losses(out)["losses"])
    assert len(runs["weighted"][1]) == 3
    assert all(abs(a - b) > 1e-3 for a, b in zip(runs["weighted"][1], runs["plain"][1]))
    return runs["weighted"]


@pytest.mark.skipif(not have_mpirun(), reason="no mpirun, or loom built without MPI")
@pytest.mark.parametrize("np_,mesh,cp,sp", [(8, ["2", "2", "2"], 1, False),
                                            (4, ["1", "2", "1"], 2, True)],
                         ids=["dp2-tp2-pp2", "tp2-sp-cp2"])
def test_loss_weights_under_mpirun_match_one_process(tiny_model, weighted, tmp_path, np_, mesh,
                                                     cp, sp):
    """The usage example on samples carrying loss_weights: each rank's slice,
    padded, shifted and cut by cp / sp, weighs its tokens as one process does."""
    jl, want = weighted
    out = str(tmp_path / "losses.json")
    mpirun(np_, [sys.executable, SCRIPT, tiny_model, jl, out] + mesh, LOOM_EXAMPLE_CP=cp,
           LOOM_EXAMPLE_SP=int(sp))
    got = _losses(out)["losses"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) < 1e-5, (got, want)


RESUME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "resume.py")


@pytest.mark.skipif(not have_mpirun(), reason="no mpirun, or loom built without MPI")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_state_saved_on_one_mesh_resumes_on_another(tiny_model, tmp_path, lora):
    """Saved at dp2 tp2 pp2 (8 ranks) after 2 of 4 steps; resumed in one
    process, at dp4 and at tp2 cp2: the last 2 losses as the uninterrupted
    one-process run's within 1e-5."""
    extra = ["lora"] if lora else []
    state = str(tmp_path / "state")
    ref = str(tmp_path / "ref.json")
    subprocess.run([sys.executable, RESUME, tiny_model, ref, "1", "1", "1", "4", "0", state]
                   + extra, check=True, env=env(), capture_output=True)
    want = _losses(ref)["losses"][2:]
    mpirun(8, [sys.executable, RESUME, tiny_model, str(tmp_path / "a.json"), "2", "2", "2", "4",
               "2", state] + extra)
    for name, np_, mesh, more in (("one", 1, ["1", "1", "1"], {}),
                                  ("dp4", 4, ["4", "1", "1"], {}),
                                  ("tp2cp2", 4, ["1", "2", "1"], {"LOOM_EXAMPLE_CP": 2})):
        out = str(tmp_path / (name + ".json"))
        argv = [sys.executable, RESUME, tiny_model, out] + mesh + ["4", "0", state, "load"] + extra
        if np_ > 1:
            mpirun(np_, argv, **more)
        else:
            subprocess.run(argv, check=True, env=env(**more), capture_output=True)
        got = _losses(out)
        assert got["first"] == 2
        for g, w in zip(got["losses"], want):
            assert abs(g - w) < 1e-5 * max(1.0, abs(w)), (name, got, want)


@pytest.fixture(scope="module")
def qwen35_model(tmp_path_factory):
    """A random text-only Qwen3.5 (three Gated DeltaNet layers and one gated
    attention layer, the fixture's shape)."""
    d = str(tmp_path_factory.mktemp("models") / "tiny-qwen3.5")
    run([LOOM, "init", "--preset", "tiny-qwen3.5", "--out", d, "--log-level", "warn"])
    return d


@pytest.mark.skipif(not have_mpirun(), reason="no mpirun, or loom built without MPI")
@pytest.mark.parametrize("np_,mesh,cp,sp,lora", [(8, ["2", "2", "2"], 1, False, 0),
                                                 (4, ["1", "2", "1"], 2, True, 0),
                                                 (4, ["2", "2", "1"], 1, True, 8)],
                         ids=["dp2-tp2-pp2", "tp2-sp-cp2", "dp2-tp2-sp-lora"])
def test_qwen35_example_under_mpirun_matches_loom_train(qwen35_model, data, tmp_path, np_, mesh,
                                                         cp, sp, lora):
    """Twinkle's script on Qwen3.5 (the model its MegatronModel docs train):
    the Gated DeltaNet layers split over tp and cp like attention, against
    `loom train` in one process."""
    jl, tok = data
    out = str(tmp_path / "losses.json")
    mpirun(np_, [sys.executable, SCRIPT, qwen35_model, jl, out] + mesh +
           ([str(lora)] if lora else []), LOOM_EXAMPLE_CP=cp, LOOM_EXAMPLE_SP=int(sp))
    extra = ("--lora-r", str(lora), "--lora-alpha", str(2 * lora), "--lora-target", "all-linear",
             "--seed", "42") if lora else ()
    ref = train_reference(qwen35_model, tok, steps=4, seq_len=SEQ, gbs=8, extra=extra)
    got = _losses(out)["losses"]
    assert len(got) == len(ref) == 4
    for g, r in zip(got, ref):
        assert abs(g - r) < 1e-5, (got, ref)
