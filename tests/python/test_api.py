"""MegatronModel's API in one process: results against the HF fixtures,
Twinkle's semantics, and a clear LoomError for every bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES, LOOM, ROOT, env, random_samples

import loom
from loom import DataLoader, DeviceMesh, LoraConfig, MegatronModel

QWEN3 = os.path.join(FIXTURES, "models", "tiny-qwen3")


def golden(name="tiny-qwen3"):
    from safetensors.numpy import load_file
    return load_file(os.path.join(FIXTURES, "golden", name + ".safetensors"))


def model(path=QWEN3, **kw):
    kw.setdefault("mixed_precision", "no")
    return MegatronModel(path, **kw)


@pytest.fixture(scope="module")
def m():
    x = model()
    yield x
    x.close()


def label_samples(ids, targets):
    """HF-style samples of the fixture's rows: labels[t] = targets[t - 1]."""
    out = []
    for i, t in zip(ids, targets):
        lab = np.full(len(i), -100)
        lab[1:] = t[:-1]
        out.append({"input_ids": i, "labels": lab})
    return out


def test_forward_only_matches_the_hf_fixture(m):
    g = golden()
    r = m.forward_only(inputs=label_samples(g["input_ids"], g["targets"]), return_logits=True)
    for i in range(2):
        want = g["token_logprobs"][i][:-1]
        got = r["logps"][i][1:]
        mask = g["targets"][i][:-1] != -100
        assert np.abs(got[mask] - want[mask]).max() < 1e-5
        assert np.abs(r["entropy"][i][1:] - g["entropy"][i][:-1]).max() < 1e-5
        assert np.abs(r["logits"][i] - g["logits"][i]).max() < 1e-4
    assert abs(r["loss"] - json.load(open(os.path.join(FIXTURES, "golden", "tiny-qwen3.json")))
               ["loss"]) < 1e-5


def test_model_info_reads_config_json(m):
    """ctypes' ModelInfo has loom_model_info's layout: every field, the last
    included, reads back config.json."""
    cfg = json.load(open(os.path.join(QWEN3, "config.json")))
    assert m.info.model_type.decode() == cfg["model_type"]
    assert m.info.hidden_size == cfg["hidden_size"]
    assert m.info.num_layers == cfg["num_hidden_layers"]
    assert m.info.max_position_embeddings == cfg["max_position_embeddings"]


def test_forward_only_packs_documents_like_the_hf_fixture(m):
    g = golden()
    ids, cu = g["packed.input_ids"][0], g["packed.cu_seqlens"]
    docs = [{"input_ids": ids[a:b]} for a, b in zip(cu[:-1], cu[1:])]
    r = m.forward_only(inputs=docs, seq_len=int(cu[-1]))
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        want = g["packed.token_logprobs"][0][a:b - 1]
        assert np.abs(r["logps"][d][1:] - want).max() < 1e-5


def test_lengths_and_dict_of_arrays_give_the_same_logps(m):
    s = random_samples(3, 12, seed=3)
    a = m.forward_only(inputs=s)
    arr = {"input_ids": np.array([x["input_ids"] for x in s])}
    b = m.forward_only(inputs=arr)
    for x, y in zip(a["logps"], b["logps"]):
        assert np.array_equal(x, y)
    # a shorter sample padded in a row of its own gives the same values
    c = m.forward_only(inputs=[{"input_ids": s[0]["input_ids"][:5]}] + s[1:])
    assert np.abs(c["logps"][1] - a["logps"][1]).max() < 1e-6
    assert np.abs(c["logps"][0] - a["logps"][0][:5]).max() < 1e-6


def test_gradient_accumulation_steps_as_twinkle():
    x = model()
    x.set_optimizer("default", lr=1e-3)
    data = random_samples(8, 16, seed=1)
    stepped = []
    for i in range(5):
        x.forward_backward(inputs=data[i:i + 1])
        stepped.append(x.clip_grad_and_step(gradient_accumulation_steps=2)["stepped"])
    assert stepped == [True, False, True, False, True]  # (calls - 1) % gas == 0
    x.close()


def test_accumulated_calls_equal_one_call_of_their_samples():
    data = random_samples(6, 16, seed=2)
    a, b = model(), model()
    for x in (a, b):
        x.set_optimizer("default", lr=1e-2)
        x.forward_backward(inputs=data[:2])
        x.clip_grad_and_step()
    a.forward_backward(inputs=data[2:4])
    assert not a.clip_grad_and_step(gradient_accumulation_steps=2)["stepped"]
    a.forward_backward(inputs=data[4:6])
    ra = a.clip_grad_and_step(gradient_accumulation_steps=2)
    b.forward_backward(inputs=data[2:6])
    rb = b.clip_grad_and_step()
    assert ra["stepped"] and rb["stepped"]
    assert abs(ra["grad_norm"] - rb["grad_norm"]) < 1e-5 * rb["grad_norm"]
    assert abs(ra["loss"] - rb["loss"]) < 1e-6
    sa, sb = a.get_state_dict(), b.get_state_dict()
    for k in sb:
        assert np.abs(sa[k] - sb[k]).max() < 1e-5, k  # AdamW at lr 1e-2: float sums
    a.close(), b.close()


def test_lora_save_and_reload_and_several_adapters(tmp_path):
    x = model()
    x.add_adapter_to_model("a", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    x.add_adapter_to_model("b", {"r": 2, "target_modules": ["q_proj", "v_proj"]})
    x.set_optimizer("default", adapter_name="a", lr=1e-2)
    x.set_optimizer("default", adapter_name="b", lr=1e-2)
    b0 = x.get_state_dict(adapter_name="b")
    data = random_samples(4, 16, seed=4)
    for _ in range(2):
        x.forward_backward(inputs=data, adapter_name="a")
        x.clip_grad_and_step(adapter_name="a")
    b1 = x.get_state_dict(adapter_name="b")
    assert all(np.array_equal(b0[k], b1[k]) for k in b0)  # b untouched by a's training
    sa = x.get_state_dict(adapter_name="a")
    assert any("lora_B" in k and np.abs(v).max() > 0 for k, v in sa.items())
    path = x.save("lora-a", output_dir=str(tmp_path), adapter_name="a")
    assert os.path.isfile(os.path.join(path, "adapter_config.json"))
    want = x.forward_only(inputs=data, adapter_name="a")
    y = model()
    y.add_adapter_to_model("a", path)
    got = y.forward_only(inputs=data)
    for p, q in zip(got["logps"], want["logps"]):
        assert np.abs(p - q).max() < 1e-5
    merged = x.save("merged", output_dir=str(tmp_path), adapter_name="a", merge_lora=True)
    z = model(merged)
    for p, q in zip(z.forward_only(inputs=data)["logps"], want["logps"]):
        assert np.abs(p - q).max() < 1e-4
    for o in (x, y, z):
        o.close()


def test_save_hf_and_state_dict(m, tmp_path):
    from safetensors.numpy import load_file
    sd = m.get_state_dict()
    path = m.save("full", output_dir=str(tmp_path))
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    w = {}
    for f in files:
        w.update(load_file(os.path.join(path, f)))
    assert set(w) == set(sd)
    for k in sd:
        assert np.array_equal(w[k].astype(np.float32), sd[k]), k
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))


def test_set_template_tokenizes_as_the_chat_template(m):
    m.set_template("Template")
    with open(os.path.join(FIXTURES, "tokenizer", "chat_cases.jsonl")) as f:
        case = json.loads(f.readline())
    ids, labels = m._encoder.encode({"messages": case["messages"]})
    assert ids.tolist() == case["ids"]
    assert ((labels != -100).astype(int)).tolist() == case["assistant_mask"]
    r = m.forward_only(inputs=[{"messages": case["messages"]}, {"text": "hello world"}])
    assert len(r["logps"][0]) == len(case["ids"])
    r2 = m.forward_only(inputs=[{"input_ids": ids, "labels": labels}])
    assert np.abs(r["logps"][0] - r2["logps"][0]).max() < 1e-5  # another batch shape


def test_tools_reach_the_chat_template(m):
    """tools= (transformers' apply_chat_template keyword) and a sample's own
    "tools" (a list or the list JSON-encoded) give the ids of the text jinja2
    renders for the conversation with those tools (cases.jsonl)."""
    m.set_template("Template")
    path = os.path.join(ROOT, "tests", "fixtures_chat_templates", "cases.jsonl")
    with open(path, encoding="utf-8") as f:
        case = next(c for c in map(json.loads, f)
                    if c["name"] == "qwen3.jinja/tool_turn+tools")
    msgs, tools = case["vars"]["messages"], case["vars"]["tools"]
    ids, labels = m._encoder.encode({"messages": msgs}, tools=tools)
    assert m._encoder.decode(ids) == case["text"]
    plain, _ = m._encoder.encode({"messages": msgs})
    assert len(ids) > len(plain) + 100  # the tools block is in
    for sample in ({"messages": msgs, "tools": tools},
                   {"messages": msgs, "tools": json.dumps(tools)}):
        ids2, labels2 = m._encoder.encode(sample)
        assert ids2.tolist() == ids.tolist() and labels2.tolist() == labels.tolist()
    # the tools are prompt: the labels are those of the same turns without them
    assert (labels != -100).sum() == (m._encoder.encode({"messages": msgs})[1] != -100).sum()
    r = m.forward_only(inputs=[{"messages": msgs, "tools": tools}])
    assert len(r["logps"][0]) == len(ids)
    with pytest.raises(loom.LoomError, match=r"tools\[0\] must be an object"):
        m._encoder.encode({"messages": msgs}, tools=["get_weather"], where="inputs[3]")
    with pytest.raises(loom.LoomError, match="tools must be a JSON array.*got object"):
        m._encoder.encode({"messages": msgs}, tools={"name": "f"})
    with pytest.raises(loom.InvalidArgumentError, match="give one of them"):
        m._encoder.encode({"messages": msgs, "tools": tools}, tools=tools)


def test_model_id_resolution(tmp_path, monkeypatch):
    from loom.hub import resolve_model
    snap = tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--Org--Tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--Org--Tiny" / "refs" / "main").write_text("abc")
    ms = tmp_path / "ms" / "models" / "Org" / "Qwen3-0___6B"
    ms.mkdir(parents=True)
    (ms / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    assert resolve_model("hf://Org/Tiny") == str(snap)
    assert resolve_model("Org/Tiny") == str(snap)
    assert resolve_model("ms://Org/Qwen3-0.6B") == str(ms)
    with pytest.raises(loom.NotFoundError, match="looked in"):
        resolve_model("ms://Org/Missing")


def test_dataloader_slices_by_data_parallel_rank_and_resumes(monkeypatch):
    data = [{"input_ids": [i]} for i in range(12)]
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")  # tp=2: dp rank 1
    mesh = DeviceMesh.from_sizes(tp_size=2)
    assert mesh.dp_size == 2
    dl = DataLoader(data, batch_size=4, device_mesh=mesh)
    batches = [[s["input_ids"][0] for s in b] for b in dl]
    assert batches == [[2, 3], [6, 7], [10, 11]]
    dl2 = DataLoader(data, batch_size=4, device_mesh=mesh, shuffle=True, seed=5)
    it = iter(dl2)
    first = next(it)
    st = dl2.state_dict()
    rest = list(it)
    dl3 = DataLoader(data, batch_size=4, device_mesh=mesh, shuffle=True, seed=5)
    dl3.load_state_dict(st)
    assert list(dl3) == rest and first not in rest


def test_python_m_loom_runs_the_command():
    p = subprocess.run([sys.executable, "-m", "loom", "version"], capture_output=True, text=True,
                       env=env(), cwd=os.path.join(ROOT, "python"))
    assert p.returncode == 0 and p.stdout.startswith("loom "), p.stderr


def test_train_configs(m):
    s = m.get_train_configs()
    assert "DP size: 1" in s and "TP size: 1" in s


# ---- bad input: every one raises a LoomError that says what is wrong ----

BAD_CALLS = [
    ("forward_backward", dict(inputs="hello"), loom.InvalidArgumentError, "list of samples"),
    ("forward_backward", dict(inputs=[]), loom.InvalidArgumentError, "empty"),
    ("forward_backward", dict(inputs=[[1, 2, 3]]), loom.InvalidArgumentError, "must be a dict"),
    ("forward_backward", dict(inputs=[{"input_ids": [1, 2], "labels": [1]}]), loom.ShapeError,
     "one label per token"),
    ("forward_backward", dict(inputs=[{"input_ids": [1, 5000]}]), loom.InvalidArgumentError,
     "outside the vocabulary"),
    ("forward_backward", dict(inputs=[{"input_ids": [1.5, 2]}]), loom.InvalidArgumentError,
     "integers"),
    ("forward_backward", dict(inputs=[{"input_ids": [[1, 2]]}]), loom.ShapeError, "1-D"),
    ("forward_backward", dict(inputs=[{"input_ids": [1, 2], "labels": [1, -5]}]),
     loom.InvalidArgumentError, "negative"),
    ("forward_backward", dict(inputs=[{"foo": 1}]), loom.InvalidArgumentError, "none of"),
    ("forward_backward", dict(inputs=[{"input_ids": [1, 2]}], micro_batch_size=0),
     loom.InvalidArgumentError, "micro_batch_size"),
    ("forward_backward", dict(inputs=[{"input_ids": list(range(40))}], seq_len=8),
     loom.ShapeError, "more than seq_len"),
    ("forward_backward", dict(inputs=[{"input_ids": [1, 2]}], micro_batchsize=2),
     loom.InvalidArgumentError, "did you mean 'micro_batch_size'"),
    ("forward_only", dict(inputs=[{"input_ids": [1, 2]}], temperature=0.5),
     loom.UnsupportedError, "temperature"),
    ("forward_backward", dict(inputs=[{"input_ids": [1, 2]}], adapter_name="nope"),
     loom.NotFoundError, "does not exist"),
    ("set_optimizer", dict(optimizer_cls="SGD"), loom.UnsupportedError,
     "only support MegatronOptimizer"),
    ("set_optimizer", dict(lr="high"), loom.InvalidArgumentError, "must be a number"),
    ("set_optimizer", dict(lr=-1.0), loom.InvalidArgumentError, "out of range"),
    ("set_optimizer", dict(adam_beta1=1.0), loom.InvalidArgumentError, "out of range"),
    ("set_optimizer", dict(learning_rate=1e-3), loom.InvalidArgumentError, "unknown option"),
    ("set_lr_scheduler", dict(max_lr=1e-3), loom.InvalidArgumentError, "lr_decay_steps"),
    ("set_lr_scheduler", dict(scheduler_cls="StepLR"), loom.UnsupportedError,
     "OptimizerParamScheduler"),
    ("clip_grad_and_step", dict(gradient_accumulation_steps=0), loom.InvalidArgumentError,
     "gradient_accumulation_steps"),
    ("clip_grad_and_step", dict(norm_type=1), loom.UnsupportedError, "L2"),
    ("add_adapter_to_model", dict(adapter_name="", config_or_dir={"r": 4}),
     loom.InvalidArgumentError, "non-empty"),
    ("add_adapter_to_model", dict(adapter_name="x", config_or_dir={"r": 0}),
     loom.InvalidArgumentError, "r=0"),
    ("add_adapter_to_model", dict(adapter_name="x", config_or_dir={"r": 4, "target_modules":
                                                                     ["lm_head"]}),
     loom.ConfigError, "'lm_head' is not one loom knows"),
    ("add_adapter_to_model", dict(adapter_name="x", config_or_dir={"r": 4, "use_dora": True}),
     loom.UnsupportedError, "use_dora"),
    ("add_adapter_to_model", dict(adapter_name="x", config_or_dir={"rank": 4}),
     loom.InvalidArgumentError, "unknown field"),
    ("add_adapter_to_model", dict(adapter_name="x", config_or_dir="/nonexistent"),
     loom.InvalidArgumentError, "adapter_config.json"),
    ("save", dict(name="x", save_format="megatron"), loom.UnsupportedError, "save_format"),
]


@pytest.mark.parametrize("method,kw,err,text", BAD_CALLS,
                         ids=["%s-%d" % (c[0], i) for i, c in enumerate(BAD_CALLS)])
def test_bad_calls_raise_clear_errors(m, method, kw, err, text):
    with pytest.raises(err, match=text) as e:
        getattr(m, method)(**kw)
    assert isinstance(e.value, loom.LoomError)


def test_text_without_template_asks_for_set_template():
    x = model()
    with pytest.raises(loom.ConfigError, match="set_template"):
        x.forward_backward(inputs=[{"text": "hi"}])
    x.close()


@pytest.mark.parametrize("kw,err,text", [
    (dict(device_mesh=DeviceMesh(2, 1, 1)), loom.MeshError, "has 2 ranks"),
    (dict(mixed_precision="int8"), loom.InvalidArgumentError, "mixed_precision"),
    (dict(recompute_granularity="some"), loom.InvalidArgumentError, "recompute_granularity"),
    (dict(recompute_method="block"), loom.UnsupportedError, "uniform"),
    (dict(tensor_parallel=2), loom.InvalidArgumentError, "unknown option"),
    (dict(sequence_paralel=True), loom.InvalidArgumentError, "did you mean 'sequence_parallel'"),
    (dict(config=[1]), loom.InvalidArgumentError, "config must be a dict"),
    (dict(config={"num_hidden_layers": -1}), loom.LoomError, "num_hidden_layers"),
    (dict(device="tpu"), loom.InvalidArgumentError, "device"),
    (dict(load_weights=False), loom.UnsupportedError, "loom init"),
    (dict(device_mesh="tp=2"), loom.InvalidArgumentError, "DeviceMesh"),
])
def test_bad_constructions_raise_clear_errors(kw, err, text):
    with pytest.raises(err, match=text):
        model(**kw)


def test_missing_model_names_where_it_looked():
    with pytest.raises(loom.NotFoundError, match="looked in"):
        MegatronModel("ms://NoSuchOrg/NoSuchModel")
    with pytest.raises(loom.InvalidArgumentError):
        MegatronModel(42)


def test_bad_meshes():
    with pytest.raises(loom.MeshError, match="vpp_size=2 needs pp_size > 1"):
        DeviceMesh.from_sizes(vpp_size=2)
    with pytest.raises(loom.MeshError, match=">= 1"):
        DeviceMesh.from_sizes(tp_size=0)
    with pytest.raises(loom.InvalidArgumentError, match="must be an int"):
        DeviceMesh.from_sizes(tp_size="2")
    with pytest.raises(loom.MeshError, match="8 processes, but the world has 4"):
        DeviceMesh.from_sizes(dp_size=2, tp_size=2, pp_size=2, world_size=4)
    with pytest.raises(loom.MeshError, match="not divisible"):
        os.environ["WORLD_SIZE"] = "6"
        try:
            DeviceMesh.from_sizes(tp_size=4)
        finally:
            del os.environ["WORLD_SIZE"]


def test_dataloader_bad_input(tmp_path):
    with pytest.raises(loom.InvalidArgumentError, match="batch_size"):
        DataLoader([{"input_ids": [1]}], batch_size=0)
    with pytest.raises(loom.InvalidArgumentError, match="empty"):
        DataLoader([], batch_size=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(loom.FormatError, match="bad.jsonl:2"):
        DataLoader(str(bad), batch_size=1)
    with pytest.raises(loom.LoomIOError):
        DataLoader(str(tmp_path / "missing.jsonl"), batch_size=1)


def test_lr_scheduler_follows_megatron():
    x = model()
    x.set_optimizer("default", lr=1.0)
    x.set_lr_scheduler("default", max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_steps=6,
                       lr_decay_style="linear")
    data = random_samples(1, 8, seed=9)
    got = []
    for _ in range(8):
        x.forward_backward(inputs=data)
        got.append(x.clip_grad_and_step()["lr"])

    def lr(n):  # Megatron's OptimizerParamScheduler.get_lr after n steps
        if n <= 2:
            return 1e-3 * n / 2
        if n > 6:
            return 1e-4
        return 1e-4 + (1 - (n - 2) / 4) * (1e-3 - 1e-4)
    assert np.allclose(got, [lr(k) for k in range(8)], rtol=1e-9, atol=1e-12), got
    x.close()


def test_wrap_hooks_see_the_parameter_table_and_freeze():
    seen = []

    def freeze_layer0(table):
        seen.append([dict(p) for p in table])
        for p in table:
            if p["layer"] == 0 or p["name"] == "model.norm.weight":
                p["trainable"] = False

    x = model(pre_wrap_hook=freeze_layer0)
    before = x.get_state_dict()
    x.set_optimizer("default", lr=1e-2)
    names = [p["name"] for p in seen[0]]
    assert "model.embed_tokens.weight" in names and len(names) == x.info.num_tensors
    p = seen[0][names.index("model.layers.1.mlp.up_proj.weight")]
    assert p["layer"] == 1 and p["shape"] == (128, 64) and p["trainable"] and p["pp_stage"] == 0
    table = {p["name"]: p for p in x.parameters_table()}
    assert not table["model.layers.0.mlp.up_proj.weight"]["trainable"]
    assert table["model.layers.1.mlp.up_proj.weight"]["trainable"]
    for _ in range(2):
        x.forward_backward(inputs=random_samples(2, 16, seed=5))
        x.clip_grad_and_step()
    after = x.get_state_dict()
    for k in before:
        frozen = ".layers.0." in k or k == "model.norm.weight"
        assert np.array_equal(before[k], after[k]) == frozen, k
    with pytest.raises(loom.ConfigError, match="before the first set_optimizer"):
        x.register_pre_wrap_hook(lambda t: None)
    with pytest.raises(loom.ConfigError, match="before the first forward_backward"):
        x.set_trainable("model.norm.weight", True)
    with pytest.raises(loom.NotFoundError):
        model().set_trainable("no.such.weight", False)
    x.close()


def test_meta_model_without_weights(tmp_path, tiny_model):
    import shutil
    d = tmp_path / "config-only"
    d.mkdir()
    shutil.copy(os.path.join(tiny_model, "config.json"), d / "config.json")  # no weights at all
    one = MegatronModel.meta(str(d), seq_len=64)
    x = model(tiny_model)
    live = x.parameters_table()
    assert [p["name"] for p in one.parameters] == [p["name"] for p in live]
    for a, b in zip(one.parameters, live):
        assert a["shape"] == b["shape"] and a["local_shape"] == b["local_shape"], (a, b)
        assert a["layer"] == b["layer"] and a["pp_stage"] == b["pp_stage"]
    x.close()
    mesh = MegatronModel.meta(str(d), device_mesh=DeviceMesh(2, 2, 2), seq_len=64)
    q = {p["name"]: p for p in mesh.parameters}
    assert q["model.layers.0.self_attn.q_proj.weight"]["local_shape"] == (32, 64)   # rows / tp
    assert q["model.layers.0.self_attn.o_proj.weight"]["local_shape"] == (64, 32)   # cols / tp
    assert q["model.layers.3.mlp.up_proj.weight"]["pp_stage"] == 1
    assert len(mesh.memory) == 2 and all(m["total"] > 0 for m in mesh.memory)
    assert mesh.memory[0]["weights"] < one.memory[0]["weights"]  # sharded 4 ways
    lora = MegatronModel.meta(str(d), device_mesh=DeviceMesh(2, 2, 2), seq_len=64, lora_r=8)
    assert lora.memory[0]["grads"] < mesh.memory[0]["grads"]
    with pytest.raises(loom.MeshError, match="num_attention_heads=4 is not divisible by"):
        MegatronModel.meta(str(d), device_mesh=DeviceMesh(1, 3, 1))
    with pytest.raises(loom.MeshError, match="num_hidden_layers=4 cannot be split"):
        MegatronModel.meta(str(d), device_mesh=DeviceMesh(1, 1, 3))
    with pytest.raises(loom.InvalidArgumentError):
        MegatronModel.meta(str(d), seq_len=0)


MOE = os.path.join(FIXTURES, "models", "tiny-qwen3-moe")


def test_expert_parallel_sizes_reach_the_library():
    """DeviceMesh.from_sizes(ep_size=, etp_size=): a dense model refuses them
    before any compute; a MoE model takes them, and the meta model holds
    its experts as the fold puts them (E/ep experts of width I/etp)."""
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2, ep_size=2, etp_size=1,
                                 sequence_parallel=True, world_size=4)
    assert (mesh.ep_size, mesh.etp_world_size, mesh.edp_size) == (2, 1, 2)
    assert [mesh.expert_coords(r) for r in range(4)] == [(0, 0, 0, 0), (0, 1, 0, 0),
                                                         (0, 0, 1, 0), (0, 1, 1, 0)]
    assert "ep=2, etp=1" in repr(mesh)
    assert DeviceMesh.from_sizes(tp_size=2, world_size=2).etp_world_size == 2  # etp None: tp
    with pytest.raises(loom.MeshError, match="etp_size=0 must be >= 1"):
        DeviceMesh.from_sizes(etp_size=0)
    # dense: refused, whatever the launcher
    with pytest.raises(loom.MeshError, match="expert parallelism needs a mixture-of-experts"):
        MegatronModel.meta(QWEN3, device_mesh=DeviceMesh(2, ep_size=2), seq_len=16)
    with pytest.raises(loom.MeshError, match="expert parallelism needs a mixture-of-experts"):
        model(device_mesh=DeviceMesh.from_sizes(ep_size=2))
    # MoE: through to the layout and the memory
    one = MegatronModel.meta(MOE, seq_len=32)
    folded = MegatronModel.meta(MOE, device_mesh=mesh, seq_len=32)
    q = {p["name"]: p for p in folded.parameters}
    assert q["model.layers.0.mlp.experts.5.up_proj.weight"]["local_shape"] == (32, 64)
    assert q["model.layers.0.mlp.gate.weight"]["local_shape"] == (8, 64)
    tp_only = MegatronModel.meta(MOE, device_mesh=DeviceMesh(1, tp_size=2), seq_len=32)
    q = {p["name"]: p for p in tp_only.parameters}
    assert q["model.layers.0.mlp.experts.5.down_proj.weight"]["local_shape"] == (64, 16)  # etp = tp
    # 4 layers x 8 experts x 3 x 64 x 32 fp32 masters + bf16 copies, halved by ep
    experts = 4 * 8 * 3 * 64 * 32 * 6
    assert one.memory[0]["weights"] - folded.memory[0]["weights"] > experts // 2 - 1
    with pytest.raises(loom.MeshError, match="add --sequence-parallel"):
        MegatronModel.meta(MOE, device_mesh=DeviceMesh(2, tp_size=2, ep_size=2, etp_size=1),
                           seq_len=32)
    with pytest.raises(loom.MeshError, match="num_experts=8 is not divisible by expert-parallel "
                                             "size ep=3"):
        MegatronModel.meta(MOE, device_mesh=DeviceMesh(3, ep_size=3), seq_len=32)
    with pytest.raises(loom.MeshError, match="ep=4 does not divide tp\\*cp\\*dp/etp"):
        MegatronModel.meta(MOE, device_mesh=DeviceMesh(2, ep_size=4), seq_len=32)


def test_peft_lora_config_is_taken():
    peft = pytest.importorskip("peft", reason="peft is not installed (the GPU machine has it)")
    x = model()
    x.add_adapter_to_model("p", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj",
                                                                                   "v_proj"]))
    sd = x.get_state_dict(adapter_name="p")
    assert any(".q_proj.lora_A" in k for k in sd) and not any(".k_proj." in k for k in sd)
    with pytest.raises(loom.UnsupportedError, match="use_dora"):
        x.add_adapter_to_model("d", peft.LoraConfig(r=4, use_dora=True, target_modules=["q_proj"]))
    x.close()


def test_save_with_optimizer_and_resume_from_checkpoint(tmp_path):
    """save(save_optimizer=True) mid-run; a fresh model and DataLoader resume
    from it and continue bitwise as the uninterrupted run (CPU fp32)."""
    data = random_samples(24, 16, seed=8)

    def run(stop=None, resume=None):
        x = model()
        x.set_optimizer("default", lr=1e-2)
        x.set_lr_scheduler("default", max_lr=1e-2, lr_warmup_steps=2, lr_decay_steps=6)
        dl = DataLoader(data, batch_size=4, shuffle=True, seed=3)
        if resume:
            p = x.resume_from_checkpoint(resume, dataloader=dl)
            assert p["step"] == 3 and p["consumed_samples"] == 12
        losses = []
        for batch in dl:
            losses.append(x.forward_backward(inputs=batch)["loss"])
            x.clip_grad_and_step()
            if stop and len(losses) == 3:
                x.save("ck", output_dir=str(tmp_path), save_optimizer=True, dataloader=dl)
        x.close()
        return losses

    full = run(stop=True)
    assert len(full) == 6
    again = run(resume=str(tmp_path / "ck"))
    assert again == full[3:], (again, full)
    assert os.path.isfile(tmp_path / "ck" / "model.safetensors")  # the HF files beside it
    with pytest.raises(loom.NotFoundError, match="no training state"):
        model().resume_from_checkpoint(str(tmp_path))


def test_save_with_optimizer_twice_to_one_name(tmp_path):
    x = model()
    x.set_optimizer("default")
    x.forward_backward(inputs=random_samples(1, 8))
    x.clip_grad_and_step()
    for _ in range(2):  # the second replaces the first whole, its state included
        x.save("same", output_dir=str(tmp_path), save_optimizer=True)
    assert x.resume_from_checkpoint(str(tmp_path / "same"))["step"] == 1
    x.close()


def test_int32_rows_are_read_in_place(m):
    """A dict of int32 (rows, seq) arrays goes to the library without a copy
    of its input_ids, and gives what the general path gives."""
    rng = np.random.default_rng(12)
    ids = rng.integers(0, 1000, (3, 16)).astype(np.int32)
    labels = ids.astype(np.int64)
    labels[:, :4] = -100
    p = m._pack({"input_ids": ids, "labels": labels}, None, None)
    assert p.input_ids is ids and p.cu_seqlens is None
    fast = m.forward_only(inputs={"input_ids": ids, "labels": labels})
    slow = m.forward_only(inputs=[{"input_ids": ids[r].astype(np.int64), "labels": labels[r]}
                                  for r in range(3)])
    assert abs(fast["loss"] - slow["loss"]) < 1e-6 and fast["num_tokens"] == slow["num_tokens"]
    for a, b in zip(fast["logps"], slow["logps"]):
        assert np.abs(a - b).max() < 1e-6
    bad = ids.copy()
    bad[1, 5] = 5000
    with pytest.raises(loom.InvalidArgumentError, match=r"input_ids\[1, 5\] = 5000"):
        m.forward_only(inputs={"input_ids": bad})
    # another dtype or a non-contiguous array takes the general path, same result
    g = m.forward_only(inputs={"input_ids": ids[:, ::1].astype(np.int64), "labels": labels})
    assert abs(g["loss"] - fast["loss"]) < 1e-6


# ---- per-token loss weights ----

def weighted_samples(seed=21):
    """Samples of unequal lengths, the prompt of one masked, random weights
    (some negative, some 0) on all but the last."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (14, 9, 16, 11):
        w = rng.normal(size=n).astype(np.float32)
        w[rng.random(n) < 0.25] = 0
        out.append({"input_ids": rng.integers(0, 1000, n), "loss_weights": w})
    out[1]["labels"] = np.where(np.arange(9) < 4, -100, out[1]["input_ids"])
    del out[3]["loss_weights"]
    return out


def weighted_loss_sum(samples, logps):
    """The sum over tokens with a label of -weight * logp (float64), from
    forward_only's label-aligned log-probs."""
    tot = 0.0
    for s, lp in zip(samples, logps):
        n = len(s["input_ids"])
        w = np.asarray(s.get("loss_weights", np.ones(n)), np.float64)
        has = np.asarray(s.get("labels", s["input_ids"])) != -100
        has[0] = False  # nothing predicts the first token
        tot -= (w[has] * lp[has].astype(np.float64)).sum()
    return tot


def test_loss_weights_weigh_each_tokens_log_prob(m):
    """forward_backward's loss_sum is the sum of -weight * logp over
    forward_only's log-probs, however the samples are packed; forward_only
    takes the weights for its loss and leaves the log-probs alone."""
    s = weighted_samples()
    plain = [{k: v for k, v in d.items() if k != "loss_weights"} for d in s]
    assert m._pack(plain, None, None).loss_weights is None  # no weights: NULL to the library
    fo = m.forward_only(inputs=plain)
    want = weighted_loss_sum(s, fo["logps"])
    x = model()
    r = x.forward_backward(inputs=s)
    assert r["num_tokens"] == fo["num_tokens"]  # the mean still divides by the labels' count
    assert abs(r["loss_sum"] - want) < 1e-5 * max(1.0, abs(want)), (r, want)
    assert abs(r["loss"] - r["loss_sum"] / r["num_tokens"]) < 1e-12
    packed = x.forward_backward(inputs=s, seq_len=32)  # several samples in a row
    assert abs(packed["loss_sum"] - want) < 1e-5 * max(1.0, abs(want))
    x.close()
    fw = m.forward_only(inputs=s)
    assert all(np.array_equal(a, b) for a, b in zip(fw["logps"], fo["logps"]))
    assert abs(fw["loss_sum"] - r["loss_sum"]) < 1e-5 * max(1.0, abs(want))
    # a dict of (rows, seq) arrays: the int32 rows in place, and the general path
    rng = np.random.default_rng(23)
    ids = rng.integers(0, 1000, (3, 16)).astype(np.int32)
    w = rng.normal(size=(3, 16)).astype(np.float32)
    w[0, 3:9] = 0
    p = m._pack({"input_ids": ids, "loss_weights": w}, None, None)
    assert p.input_ids is ids and np.array_equal(p.loss_weights[:, :-1], w[:, 1:])
    rows = [{"input_ids": ids[i], "loss_weights": w[i]} for i in range(3)]
    want = weighted_loss_sum(rows, m.forward_only(inputs={"input_ids": ids})["logps"])
    for inp in ({"input_ids": ids, "loss_weights": w},
                {"input_ids": ids.astype(np.int64), "loss_weights": w.tolist()}, rows):
        got = m.forward_only(inputs=inp)["loss_sum"]
        assert abs(got - want) < 1e-5 * max(1.0, abs(want)), (got, want)


def test_loss_weights_of_two_double_loss_and_gradients():
    """Weights of 1 change no bit; weights of 2 double the loss and every
    gradient exactly."""
    import loom._lib as L
    x = model()
    names = [(p["name"], p["shape"]) for p in x.parameters_table()]
    data = random_samples(3, 12, seed=22)
    res = {}
    for name, w in (("none", None), ("one", [1] * 12), ("two", np.full(12, 2.0))):
        inp = data if w is None else [dict(d, loss_weights=w) for d in data]
        r = x.forward_backward(inputs=inp)
        g = {}
        for n, shape in names:
            a = np.empty(shape, np.float32)
            x._ctx.check(L.lib.loom_model_get_grad(x._h, n.encode(), L.f32_ptr(a), a.size))
            g[n] = a
        x.zero_grad()
        res[name] = (r, g)
    (r0, g0), (r1, g1), (r2, g2) = res["none"], res["one"], res["two"]
    assert r1["loss_sum"] == r0["loss_sum"] and r2["loss_sum"] == 2 * r0["loss_sum"]
    assert r2["num_tokens"] == r0["num_tokens"] and r2["loss"] == 2 * r0["loss"]
    assert any(np.abs(a).max() > 0 for a in g0.values())
    for n in g0:
        assert np.array_equal(g1[n], g0[n]), n
        assert np.array_equal(g2[n], 2 * g0[n]), n
    x.close()


BAD_WEIGHTS = [
    ([{"input_ids": [1, 2, 3], "loss_weights": [1.0, 2.0]}], loom.ShapeError,
     r"inputs\[0\]: loss_weights has shape \(2,\), input_ids \(3,\)"),
    ([{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3], "loss_weights": [1, float("nan"), 0]}],
     loom.InvalidArgumentError, r"inputs\[1\]: loss_weights\[1\] = nan is not a finite number"),
    ([{"input_ids": [1, 2], "loss_weights": [1, float("-inf")]}], loom.InvalidArgumentError,
     r"loss_weights\[1\] = -inf"),
    ([{"input_ids": [1, 2], "loss_weights": [1e39, 1]}], loom.InvalidArgumentError,
     r"loss_weights\[0\] = 1e\+39 is not a finite number as float32"),
    ([{"input_ids": [1, 2], "loss_weights": ["a", "b"]}], loom.InvalidArgumentError,
     "real numbers"),
    ([{"input_ids": [1, 2], "loss_weights": [1, None]}], loom.InvalidArgumentError,
     "real numbers"),
    ([{"input_ids": [1, 2], "loss_weights": [1j, 1]}], loom.InvalidArgumentError,
     "real numbers"),
    ({"input_ids": np.ones((2, 4), np.int32), "loss_weights": np.ones((2, 3))}, loom.ShapeError,
     r"loss_weights has shape \(2, 3\), input_ids \(2, 4\)"),
    ({"input_ids": np.ones((2, 4), np.int32),
      "loss_weights": np.array([[1, 1, 1, 1], [1, 1, np.nan, 1]])}, loom.InvalidArgumentError,
     r"inputs: loss_weights\[1, 2\] = nan"),
    ({"input_ids": np.ones((2, 4), np.int64), "attention_mask": np.ones((2, 4)),
      "loss_weights": np.array([[1, 1, 1, 1], [1, np.inf, 1, 1]])}, loom.InvalidArgumentError,
     r"inputs: loss_weights\[1, 1\] = inf"),
]


@pytest.mark.parametrize("inputs,err,text", BAD_WEIGHTS,
                         ids=["weights-%d" % i for i in range(len(BAD_WEIGHTS))])
def test_bad_loss_weights_raise_clear_errors(m, inputs, err, text):
    for call in (m.forward_backward, m.forward_only):
        with pytest.raises(err, match=text):
            call(inputs=inputs)


def test_library_exports_only_its_api():
    """libloom.so's dynamic symbols are the functions include/loom.h
    declares, no more (the library is built hidden, with a version script)
    and no fewer."""
    import re
    lib = os.environ["LOOM_LIBRARY"]
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                         check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()}
    header = open(os.path.join(ROOT, "include", "loom.h")).read()
    header = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    declared = set(re.findall(r"\b(loom_[a-z0-9_]+)\s*\(", header))
    assert exported - declared == set(), "exported but not in loom.h: %s" % sorted(exported - declared)
    assert declared - exported == set(), "in loom.h but not exported: %s" % sorted(declared - exported)


def test_cli_includes_the_api_and_its_internal_header_only():
    """cli/ includes include/loom.h, src/loom_cli.h (the library's internal
    interface for its command), its own headers and system headers: no other
    header of src/, so what the CLI takes from the library is in one place."""
    import glob
    import re
    cli = os.path.join(ROOT, "cli")
    allowed = {"loom.h", "../src/loom_cli.h"}
    allowed |= {os.path.basename(p) for p in glob.glob(os.path.join(cli, "*.h"))}
    bad = []
    for path in sorted(glob.glob(os.path.join(cli, "*.[ch]"))):
        for n, line in enumerate(open(path), 1):
            inc = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if inc and inc.group(1) not in allowed:
                bad.append("%s:%d: %s" % (os.path.relpath(path, ROOT), n, inc.group(1)))
    assert not bad, "cli/ includes headers of src/ other than src/loom_cli.h: %s" % bad


def test_moe_reports_the_load_balancing_loss():
    """Qwen3-MoE: forward's aux_loss is transformers' load_balancing_loss_func
    over all layers (the fixture's), and the step reports tokens per expert."""
    g = golden("tiny-qwen3-moe")
    meta = json.load(open(os.path.join(FIXTURES, "golden", "tiny-qwen3-moe.json")))
    x = model(os.path.join(FIXTURES, "models", "tiny-qwen3-moe"))
    try:
        samples = label_samples(g["input_ids"], g["targets"])
        r = x.forward_only(inputs=samples)
        assert abs(r["aux_loss"] - meta["hf_aux_loss_unscaled"]) < 1e-5
        x.set_optimizer("default", lr=1e-3)
        r = x.forward_backward(inputs=samples)
        assert abs(r["aux_loss"] - meta["hf_aux_loss_unscaled"]) < 1e-5
        s = x.clip_grad_and_step()
        assert s["expert_tokens_mean"] == 48 * 2 / 8 and s["expert_imbalance"] >= 1.0
        # per layer: 48 tokens x top-2 in each of the 4 layers; the step's
        # statistics are those of these counts
        t = x.expert_tokens()
        assert t.shape == (4, 8) and (t.sum(axis=1) == 96).all()
        assert t.min() == s["expert_tokens_min"] and t.max() == s["expert_tokens_max"]
        imb = t.max(axis=1) / t.mean(axis=1)
        assert s["expert_imbalance_layer"] == int(np.argmax(imb))
        assert abs(imb.max() - s["expert_imbalance"]) < 1e-12
    finally:
        x.close()
    y = model(os.path.join(FIXTURES, "models", "tiny-qwen3"))
    try:
        with pytest.raises(loom.InvalidArgumentError, match="has no experts"):
            y.expert_tokens()
    finally:
        y.close()


def test_moe_per_layer_load_balancing_loss():
    """moe_router_load_balancing_type='aux_loss' is Megatron's per-layer form
    (another value than transformers' over all layers); others are refused."""
    g = golden("tiny-qwen3-moe")
    path = os.path.join(FIXTURES, "models", "tiny-qwen3-moe")
    samples = label_samples(g["input_ids"], g["targets"])
    x = model(path)
    y = model(path, moe_router_load_balancing_type="aux_loss")
    try:
        a, b = x.forward_only(inputs=samples), y.forward_only(inputs=samples)
        assert a["aux_loss"] > 0 and b["aux_loss"] > 0 and abs(a["aux_loss"] - b["aux_loss"]) > 1e-3
    finally:
        x.close()
        y.close()
    with pytest.raises(loom.UnsupportedError, match="sinkhorn"):
        model(path, moe_router_load_balancing_type="sinkhorn")


def test_moe_router_z_loss():
    """moe_z_loss_coeff (Megatron's): z_loss is each MoE layer's mean
    logsumexp(router logits)^2, summed over layers (from the fixture's
    logits), and the loss gains the coefficient times it; a negative one is
    refused with loom's reason."""
    g = golden("tiny-qwen3-moe")
    path = os.path.join(FIXTURES, "models", "tiny-qwen3-moe")
    samples = label_samples(g["input_ids"], g["targets"])
    want = 0.0
    for i in range(4):
        z = g["router_logits.%d" % i].astype(np.float64)
        mx = z.max(axis=1, keepdims=True)
        want += float(np.mean((mx[:, 0] + np.log(np.exp(z - mx).sum(axis=1))) ** 2))
    x = model(path)
    y = model(path, moe_z_loss_coeff=0.25)
    try:
        a, b = x.forward_only(inputs=samples), y.forward_only(inputs=samples)
        assert a["z_loss"] == 0.0 and abs(b["z_loss"] - want) < 1e-5 * want
        assert abs(b["loss"] - a["loss"] - 0.25 * b["z_loss"]) < 1e-6
        y.set_optimizer("default", lr=1e-3)
        y.forward_backward(inputs=samples)
        s = y.clip_grad_and_step()
        assert abs(s["z_loss"] - want) < 1e-5 * want
    finally:
        x.close()
        y.close()
    with pytest.raises(loom.InvalidArgumentError, match="moe_z_loss_coeff"):
        model(path, moe_z_loss_coeff=-0.1)


def test_moe_router_force_load_balancing():
    """moe_router_force_load_balancing (Megatron's benchmarking switch): the
    routing is drawn, not the router's, so the counts change, every layer
    still routes all 48 tokens x top-2, and the loss moves."""
    g = golden("tiny-qwen3-moe")
    path = os.path.join(FIXTURES, "models", "tiny-qwen3-moe")
    samples = label_samples(g["input_ids"], g["targets"])
    xs = [model(path), model(path, moe_router_force_load_balancing=True)]
    try:
        t = []
        for x in xs:
            x.set_optimizer("default", lr=1e-3)
            x.forward_backward(inputs=samples)
            x.clip_grad_and_step()
            t.append(x.expert_tokens())
        assert (t[1].sum(axis=1) == 96).all() and (t[0] != t[1]).any()
    finally:
        for x in xs:
            x.close()


def test_profile():
    """profile=True (loom's): the report names the parts each step ran (the
    MoE block's among them) with their time; off, it says so."""
    g = golden("tiny-qwen3-moe")
    path = os.path.join(FIXTURES, "models", "tiny-qwen3-moe")
    samples = label_samples(g["input_ids"], g["targets"])
    xs = [model(path, profile=True), model(path)]
    try:
        for x in xs:
            x.set_optimizer("default", lr=1e-3)
            for _ in range(3):
                x.forward_backward(inputs=samples)
                x.clip_grad_and_step()
        p = xs[0].profile()
        assert p.startswith("steps 2-3"), p
        lines = p.splitlines()
        assert lines[-1].lstrip().startswith("breakdown, ms a step: compute "), p
        rows = [r.split() for r in lines[2:-1]]
        parts = {(r[0], r[1]) for r in rows}
        for want in [("forward", "attention"), ("forward", "moe.experts"),
                     ("backward", "moe.router"), ("step", "optimizer")]:
            assert want in parts, p
        total = float(p.split("the parts on the device, ")[1].split()[0])
        assert abs(sum(float(r[-3]) for r in rows) - total) < 0.001 * len(rows) + 0.01, p
        assert "profiling is off" in xs[1].profile()
        b = xs[0].profile_breakdown()  # the 3 steps by kind, then none since
        assert b["steps"] == 3 and b["compute_ms"] > 0 and b["bubble_ms"] == 0, b
        assert xs[0].profile_breakdown()["steps"] == 0
        assert xs[1].profile_breakdown() == {"steps": 0, "compute_ms": 0.0, "comm_ms": 0.0,
                                             "bubble_ms": 0.0, "idle_ms": 0.0}
    finally:
        for x in xs:
            x.close()


def test_moe_expert_capacity():
    """moe_expert_capacity_factor and moe_token_drop_policy (Megatron's): a
    capacity that keeps every choice changes nothing, a small one drops
    choices (the loss moves, each expert gets at most its capacity: 6 of
    48 x 2 / 8 at 0.5), each policy its own; bad values are refused."""
    g = golden("tiny-qwen3-moe")
    path = os.path.join(FIXTURES, "models", "tiny-qwen3-moe")
    samples = label_samples(g["input_ids"], g["targets"])
    ms = [model(path), model(path, moe_expert_capacity_factor=4.0),
          model(path, moe_expert_capacity_factor=0.5),
          model(path, moe_expert_capacity_factor=0.5, moe_token_drop_policy="position",
                moe_pad_expert_input_to_capacity=True)]
    try:
        r = [x.forward_only(inputs=samples)["loss"] for x in ms]
        assert r[1] == r[0] and abs(r[2] - r[0]) > 1e-4 and abs(r[3] - r[2]) > 1e-6
        ms[2].set_optimizer("default", lr=1e-3)
        ms[2].forward_backward(inputs=samples)
        s = ms[2].clip_grad_and_step()
        assert s["expert_tokens_max"] == 6
    finally:
        for x in ms:
            x.close()
    with pytest.raises(loom.InvalidArgumentError, match="moe_expert_capacity_factor"):
        model(path, moe_expert_capacity_factor=-1.0)
    with pytest.raises(loom.InvalidArgumentError, match="moe_token_drop_policy='last'"):
        model(path, moe_expert_capacity_factor=1.0, moe_token_drop_policy="last")
    with pytest.raises(loom.InvalidArgumentError, match="needs moe_expert_capacity_factor"):
        model(path, moe_pad_expert_input_to_capacity=True)


def test_moe_router_lora_only_when_named(tmp_path):
    """LoRA on the router ('gate', PEFT's mlp.gate) only when the list names
    it: 'all-linear' leaves it out; named, its A and B train, save under
    PEFT's names and read back to the same log-probs."""
    g = golden("tiny-qwen3-moe")
    samples = label_samples(g["input_ids"], g["targets"])
    x = model(MOE)
    y = model(MOE)
    try:
        x.add_adapter_to_model("all", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        assert not any(".mlp.gate." in k for k in x.get_state_dict(adapter_name="all"))
        mods = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"]
        x.add_adapter_to_model("r", LoraConfig(r=4, lora_alpha=8, target_modules=mods))
        x.set_optimizer("default", adapter_name="r", lr=2e-2)
        for _ in range(2):
            x.forward_backward(inputs=samples, adapter_name="r")
            x.clip_grad_and_step(adapter_name="r")
        sd = x.get_state_dict(adapter_name="r")
        router = [k for k in sd if ".mlp.gate.lora_" in k]
        assert len(router) == 2 * 4  # A and B of each of the 4 layers
        assert all(np.abs(sd[k]).max() > 0 for k in router if "lora_B" in k)
        path = x.save("router", output_dir=str(tmp_path), adapter_name="r")
        want = x.forward_only(inputs=samples, adapter_name="r")
        y.add_adapter_to_model("r", path)
        got = y.forward_only(inputs=samples)
        for p, q in zip(got["logps"], want["logps"]):
            assert np.abs(p - q).max() < 1e-5
    finally:
        x.close()
        y.close()
