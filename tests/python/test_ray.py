"""The single controller: MegatronModel(..., remote_group=...) driven from this
process over Ray actors (loom.ray_group), on CPU ranks bootstrapped with
loom's Gloo backend. One Ray instance (8 logical CPUs) serves every test."""
import os
import sys
import time

import numpy as np
import pytest

from conftest import features, have_mpirun, random_samples, train_reference

import loom
from loom import DataLoader, DeviceMesh, MegatronModel

SEQ = 32
MESH8 = dict(dp_size=2, tp_size=2, pp_size=2)


def need_gloo():
    if "gloo" not in features():
        pytest.skip("this loom has no Gloo backend (loom._lib.features() lacks 'gloo'): CPU "
                    "ranks over Ray need it; install libgloo-dev and rebuild")


@pytest.fixture(scope="module")
def ray_cluster():
    """Ray with 8 logical CPUs; the actors get LOOM_COMM_TIMEOUT=60 (the
    driver's LOOM_* settings travel to them)."""
    try:
        import ray
    except ImportError:
        pytest.fail("Ray is not installed: pip install 'loom-train[ray]' (or pip install ray)")
    old = os.environ.get("LOOM_COMM_TIMEOUT")
    os.environ["LOOM_COMM_TIMEOUT"] = "60"
    loom.init(mode="ray", num_cpus=8)
    yield ray
    ray.shutdown()
    if old is None:
        del os.environ["LOOM_COMM_TIMEOUT"]
    else:
        os.environ["LOOM_COMM_TIMEOUT"] = old


@pytest.fixture
def groups():
    """Groups made by a test; closed after it (their CPUs go back to Ray)."""
    made = []
    yield made
    for g in made:
        g.close()


def group(made, model, mesh, name="actor", **kw):
    g = MegatronModel(model, device_mesh=DeviceMesh.from_sizes(**mesh), remote_group=name,
                      mixed_precision="no", **kw)
    made.append(g)
    return g


def test_train_matches_loom_train(ray_cluster, groups, tiny_model, tmp_path):
    """The issue's usage example with 8 CPU actors (dp2 tp2 pp2): per-step losses
    equal to `loom train`'s on the same data and settings."""
    need_gloo()
    steps, gbs = 3, 8
    samples = random_samples(steps * gbs, SEQ, seed=3)
    tokens = str(tmp_path / "data.tokens")
    loom.write_tokens(tokens, samples, vocab_size=1024)
    if have_mpirun():
        ref = train_reference(tiny_model, tokens, steps, SEQ, gbs, mesh="dp=2,tp=2,pp=2", np_=8)
    else:  # the same numbers from one process (the mesh does not change them)
        ref = train_reference(tiny_model, tokens, steps, SEQ, gbs)
    model = group(groups, tiny_model, MESH8)
    model.set_optimizer("default", lr=1e-3)
    got = []
    for batch in DataLoader(samples, batch_size=gbs):
        r = model.forward_backward(batch, micro_batch_size=1)
        step = model.clip_grad_and_step(gradient_accumulation_steps=1)
        assert step["stepped"]
        got.append(r["loss"])
        assert r["num_tokens"] == gbs * (SEQ - 1)
    assert len(got) == steps
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


def test_forward_only_matches_one_process(ray_cluster, groups, tiny_model):
    need_gloo()
    samples = random_samples(4, SEQ, seed=5)
    samples[1]["input_ids"] = samples[1]["input_ids"][:20]  # unequal lengths stay in order
    rng = np.random.default_rng(5)
    weighted = [dict(s, loss_weights=rng.normal(size=len(s["input_ids"])).tolist())
                for s in samples]
    ids = np.array([s["input_ids"] for s in random_samples(4, SEQ, seed=6)])
    rows = {"input_ids": ids, "loss_weights": rng.normal(size=ids.shape)}
    local = MegatronModel(tiny_model, mixed_precision="no")
    want = local.forward_only(samples, return_logits=True)
    want_w, want_rows = local.forward_only(weighted), local.forward_only(rows)
    local.close()
    assert abs(want_w["loss"] - want["loss"]) > 1e-3
    model = group(groups, tiny_model, MESH8)
    got = model.forward_only(samples, return_logits=True)
    assert got["num_tokens"] == want["num_tokens"]
    assert abs(got["loss"] - want["loss"]) < 1e-5
    for k in ("logps", "entropy", "logits"):
        assert len(got[k]) == len(samples)
        for i, (g, w) in enumerate(zip(got[k], want[k])):
            assert g.shape == w.shape, (k, i)
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg="%s[%d]" % (k, i))
    # a dict of (rows, seq) arrays splits by rows
    d = model.forward_only({"input_ids": ids})
    assert [len(x) for x in d["logps"]] == [SEQ] * 4
    # loss_weights go with their samples, and with their rows (forward_only's loss weighs them)
    assert abs(model.forward_only(weighted)["loss"] - want_w["loss"]) < 1e-5
    assert abs(model.forward_only(rows)["loss"] - want_rows["loss"]) < 1e-5


def test_dead_actor_raises_and_nothing_hangs(ray_cluster, groups, tiny_model):
    need_gloo()
    model = group(groups, tiny_model, dict(dp_size=2, pp_size=2))
    model.set_optimizer("default", lr=1e-3)
    samples = random_samples(4, SEQ, seed=7)
    model.forward_backward(samples)
    ray_cluster.kill(model._actors[3])
    t = time.monotonic()
    with pytest.raises(loom.CommError, match=r"rank 3 \(dp 1, tp 0, pp 1\) died"):
        model.forward_backward(samples)  # the other ranks wait for rank 3 in collectives
    assert time.monotonic() - t < 15
    with pytest.raises(loom.ConfigError, match="actors were stopped"):
        model.clip_grad_and_step()
    # killed in the middle of a call (both ranks sleep in a pre-wrap hook)
    import threading
    model = group(groups, tiny_model, dict(dp_size=2), name="mid")
    model.register_pre_wrap_hook(lambda table: time.sleep(60))
    threading.Timer(1.0, ray_cluster.kill, (model._actors[1],)).start()
    t = time.monotonic()
    with pytest.raises(loom.CommError, match=r"rank 1 \(dp 1, tp 0, pp 0\) died during "
                                             r"set_optimizer"):
        model.set_optimizer("default")
    assert time.monotonic() - t < 15


def test_error_on_one_rank_reaches_the_driver(ray_cluster, groups, tiny_model):
    need_gloo()
    model = group(groups, tiny_model, dict(dp_size=2, pp_size=2))
    samples = random_samples(4, SEQ, seed=8)
    bad = [dict(s) for s in samples]
    bad[3] = {"input_ids": [1, 2, 5000, 3]}  # only data-parallel rank 1 gets it
    t = time.monotonic()
    with pytest.raises(loom.InvalidArgumentError,
                       match=r"rank [13] \(dp 1.*call's inputs\[2\.\.3\].*input_ids\[2\] = 5000 "
                             r"is outside the vocabulary"):
        model.forward_backward(bad)
    assert time.monotonic() - t < 15
    with pytest.raises(loom.ShapeError, match="3 samples cannot be split over dp=2"):
        model.forward_only(samples[:3])
    # every rank finished with the error: the group goes on
    r = model.forward_backward(samples)
    assert np.isfinite(r["loss"]) and r["num_tokens"] == 4 * (SEQ - 1)
    with pytest.raises(loom.InvalidArgumentError, match="unknown option 'lrr'"):
        model.set_optimizer("default", lrr=1.0)


def test_error_while_other_ranks_are_stuck(ray_cluster, groups, tiny_model, monkeypatch):
    """Rank 1 fails while rank 0 stays busy (a hook, as a rank waiting in a
    collective would): after the grace the group is stopped, nothing hangs."""
    need_gloo()
    import loom.ray_group
    monkeypatch.setattr(loom.ray_group, "_GRACE_S", 1.0)

    def _fail_on_rank_1(table):  # nested: cloudpickle sends it by value
        if os.environ["RANK"] == "1":
            raise ValueError("rank 1's hook refuses")
        time.sleep(60)
    model = group(groups, tiny_model, dict(dp_size=2), pre_wrap_hook=_fail_on_rank_1)
    t = time.monotonic()
    with pytest.raises(ValueError, match=r"rank 1 \(dp 1.*rank 1's hook refuses \(ranks 0 were "
                                         r"still busy 1 s later.*stopped"):
        model.set_optimizer("default")
    assert time.monotonic() - t < 15
    with pytest.raises(loom.ConfigError, match="actors were stopped"):
        model.set_optimizer("default")


def test_two_groups_in_one_driver(ray_cluster, groups, tiny_model):
    need_gloo()
    actor = group(groups, tiny_model, dict(dp_size=2), name="actor")
    ref = group(groups, tiny_model, dict(dp_size=1, tp_size=2), name="ref")
    assert actor.master != ref.master
    samples = random_samples(2, SEQ, seed=9)
    before = ref.forward_only(samples)
    np.testing.assert_allclose(np.concatenate(actor.forward_only(samples)["logps"]),
                               np.concatenate(before["logps"]), atol=1e-5)
    actor.set_optimizer("default", lr=1e-2)
    actor.forward_backward(samples)
    assert actor.clip_grad_and_step()["stepped"]
    after = actor.forward_only(samples)
    assert after["loss"] < before["loss"]  # the actor trained, the reference did not
    assert ref.forward_only(samples)["loss"] == before["loss"]


def test_checks_before_any_actor_starts(ray_cluster, tiny_model, monkeypatch):
    with pytest.raises(loom.InvalidArgumentError, match="unknown option 'tp_sise'"):
        MegatronModel(tiny_model, remote_group="actor", tp_sise=2)
    with pytest.raises(loom.ConfigError, match="need 16 CPU.*the Ray cluster has 8"):
        MegatronModel(tiny_model, device_mesh=DeviceMesh.from_sizes(dp_size=16),
                      remote_group="actor", num_cpus_per_actor=1)
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(loom.UnsupportedError, match="pip install 'loom-train\\[ray\\]'"):
        loom.init(mode="ray")


def test_ctrl_c_stops_the_group(ray_cluster, groups, tiny_model):
    """A pre-wrap hook (pickled to the actor) that sleeps in set_optimizer; Ctrl-C
    in the driver meanwhile kills the group and re-raises KeyboardInterrupt."""
    import signal
    import threading
    model = group(groups, tiny_model, dict(dp_size=1))
    model.register_pre_wrap_hook(lambda table: time.sleep(60))
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        model.set_optimizer("default", lr=1e-3)
    assert time.monotonic() - t < 15
    with pytest.raises(loom.ConfigError, match=r"interrupted \(Ctrl-C\) during set_optimizer"):
        model.forward_backward(random_samples(1, SEQ))
