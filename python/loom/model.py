"""MegatronModel: Twinkle's MegatronModel API over the loom library.

Every rank of a job (mpirun, torchrun, srun, or the Ray actors loom starts)
builds the same MegatronModel and makes the same calls; loom's C library
runs the mesh. With remote_group set (after loom.init(mode='ray')), the
constructor returns a handle in the driver that drives one actor per rank
(loom.ray_group).
"""
import ctypes as C
import difflib
import json
import os
import re
import warnings

import numpy as np

from . import _lib as L
from .batch import micro_batch_count, pack, rows_in_place, to_samples, unpack  # noqa: F401
from .errors import (ConfigError, FormatError, InvalidArgumentError, MeshError, NotFoundError,
                     UnsupportedError)
from .hub import resolve_model
from .lora import normalize as lora_normalize
from .mesh import DeviceMesh, launcher_world

_DEFAULT = ""  # Twinkle's name of the group without an adapter

# Megatron TransformerConfig-style options loom implements (and a few of
# Twinkle's own); anything else raises.
_KWARGS = {
    "recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers",
    "seed", "sequence_parallel", "device", "make_vocab_size_divisible_by",
    "microbatch_group_size_per_vp_stage", "ddp_bucket_size", "max_length", "seq_len",
    "use_distributed_optimizer", "variable_seq_lengths", "load_weights", "tokenizer_id",
    "comm_timeout", "log_level", "append_eos", "pre_wrap_hook", "post_wrap_hook",
    "moe_router_load_balancing_type", "moe_z_loss_coeff", "moe_expert_capacity_factor",
    "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
    "moe_router_force_load_balancing", "profile",
}
_OPT_KWARGS = {"lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
               "min_lr", "bf16", "fp16", "use_distributed_optimizer", "overlap_param_gather",
               "overlap_grad_reduce", "log_num_zeros_in_grad", "optimizer", "params_dtype",
               "main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"}
_SCHED_KWARGS = {"lr_decay_steps", "max_lr", "init_lr", "min_lr", "lr_warmup_steps",
                 "lr_decay_style", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style",
                 "wsd_decay_steps", "lr_wsd_decay_style", "lr_warmup_init",
                 "use_checkpoint_opt_param_scheduler", "override_opt_param_scheduler"}


_MESH_WORDS = re.compile(r"\bmesh:|tensor-parallel|pipeline|\b(tp|pp|cp|dp|vpp|ep|etp)=\d")


def _check_mesh(ctx, st, what):
    """ctx.check, with a configuration error about the mesh raised as MeshError."""
    try:
        ctx.check(st, what)
    except ConfigError as e:
        if not isinstance(e, MeshError) and _MESH_WORDS.search(str(e)):
            raise MeshError(str(e), status=e.status) from None
        raise


def _unknown(what, key, known):
    near = difflib.get_close_matches(key, sorted(known), 1, 0.6)
    return InvalidArgumentError("%s: unknown option %r%s; loom takes %s" % (
        what, key, " (did you mean %r?)" % near[0] if near else "", ", ".join(sorted(known))))


def _check_kwargs(what, kwargs, known):
    for k in kwargs:
        if k not in known:
            raise _unknown(what, k, known)


def _num(what, name, v, lo=None, hi=None, open_lo=False):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidArgumentError("%s: %s=%r must be a number" % (what, name, v))
    v = float(v)
    if not np.isfinite(v) or (lo is not None and (v < lo or (open_lo and v == lo))) or \
            (hi is not None and v >= hi):
        raise InvalidArgumentError("%s: %s=%r is out of range" % (what, name, v))
    return v


_PRECISION = {"bf16": L.BF16, "fp16": L.F16, "no": L.F32, "fp32": L.F32}
_STATE_DIR = "training_state"
_TRACKER = "latest_checkpointed_iteration.txt"


def _find_state(d):
    """The directory holding a training state's meta.json, from a save()
    directory, a training_state, or a `loom train --save` root or iter_ dir."""
    if os.path.isfile(os.path.join(d, "meta.json")):
        return d
    if os.path.isfile(os.path.join(d, _STATE_DIR, "meta.json")):
        return os.path.join(d, _STATE_DIR)
    tracker = os.path.join(d, _TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        if not it.isdigit():
            raise FormatError("%s holds %r, not an iteration" % (tracker, it[:40]))
        cand = os.path.join(d, "iter_%07d" % int(it))
        if os.path.isfile(os.path.join(cand, "meta.json")):
            return cand
        raise NotFoundError("%s names iteration %s, but %s is missing" % (tracker, it, cand))
    raise NotFoundError("no training state in %s (looked for meta.json, %s/meta.json and %s); "
                        "save with save_optimizer=True or loom train --save" % (d, _STATE_DIR,
                                                                               _TRACKER))


def _mesh_options(o, device_mesh, kwargs, recompute):
    """The mesh and the TransformerConfig-style knobs into loom_model_options."""
    o.tp, o.cp, o.dp, o.pp = (device_mesh.tp_size, device_mesh.cp_size, device_mesh.dp_size,
                              device_mesh.pp_size)
    o.vpp = device_mesh.vpp_size or 1
    o.ep, o.etp = device_mesh.ep_size, device_mesh.etp_size or 0
    sp = kwargs.get("sequence_parallel")
    o.sequence_parallel = int(bool(device_mesh.sequence_parallel if sp is None else sp))
    o.microbatch_group = int(kwargs.get("microbatch_group_size_per_vp_stage") or 0)
    if kwargs.get("make_vocab_size_divisible_by"):
        o.vocab_pad_multiple = int(kwargs["make_vocab_size_divisible_by"])
    if kwargs.get("ddp_bucket_size"):
        o.bucket_elems = int(kwargs["ddp_bucket_size"])
    o.recompute = recompute(kwargs)
    # the load-balancing loss: transformers' over all layers unless Megatron's per layer
    lb = kwargs.get("moe_router_load_balancing_type")
    if lb not in (None, "aux_loss"):
        raise UnsupportedError("moe_router_load_balancing_type=%r: loom has 'aux_loss' "
                               "(Megatron's, per layer) and, left unset, transformers' loss over "
                               "all MoE layers" % (lb,))
    o.moe_aux = 1 if lb == "aux_loss" else 0
    # Megatron's router z-loss (None or 0: off; loom refuses a negative one)
    z = kwargs.get("moe_z_loss_coeff")
    o.moe_z_loss_coeff = 0.0 if z is None else _num("MegatronModel", "moe_z_loss_coeff", z)
    # Megatron's token dropping (None: dropless; loom refuses a negative factor)
    cf = kwargs.get("moe_expert_capacity_factor")
    o.moe_expert_capacity_factor = 0.0 if cf is None else _num(
        "MegatronModel", "moe_expert_capacity_factor", cf)
    policy = kwargs.get("moe_token_drop_policy", "probs")
    if policy not in ("probs", "position"):
        raise InvalidArgumentError("moe_token_drop_policy=%r: use 'probs' (drop the choices of "
                                   "the lowest routing weight) or 'position' (of the latest "
                                   "tokens)" % (policy,))
    o.moe_token_drop_policy = 1 if policy == "position" else 0
    # Megatron's benchmarking switch: random router logits, tokens spread evenly
    o.moe_router_force_load_balancing = 1 if kwargs.get("moe_router_force_load_balancing") else 0
    # loom's: time each part of every step (MegatronModel.profile())
    o.profile = 1 if kwargs.get("profile") else 0
    # padding each expert's rows to its capacity changes no result (the pad
    # rows weigh 0); loom runs the kept rows only
    if kwargs.get("moe_pad_expert_input_to_capacity") and not o.moe_expert_capacity_factor:
        raise InvalidArgumentError("moe_pad_expert_input_to_capacity needs "
                                   "moe_expert_capacity_factor (as Megatron's)")


def _precision(mixed_precision):
    mp = _PRECISION.get(mixed_precision)
    if mp is None:
        raise InvalidArgumentError("mixed_precision=%r: use 'bf16', 'fp16' or 'no'"
                                   % (mixed_precision,))
    return mp


class _Group:
    """Twinkle's optimizer group: one per adapter ('' = the whole model)."""

    def __init__(self, name, accum=1):
        self.name = name
        self.opt = None            # L.OptimizerConfig
        self.clip_grad = 1.0
        self.sched = None          # L.SchedConfig
        self.cur_step = 0          # forward_backward calls
        self.gradient_accumulation_steps = accum
        self.adapter_config = None
        self.optimizer_kwargs = {}

    def do_grad_sync(self, gas=None):
        gas = self.gradient_accumulation_steps if gas is None else gas
        return self.cur_step > 0 and (self.cur_step - 1) % gas == 0


class Result(dict):
    """forward_backward's result: a dict (loss, num_tokens, loss_sum, aux_loss: a
    mixture of experts' load-balancing loss before its coefficient, z_loss: its
    router z-loss before moe_z_loss_coeff, 0 when off) that also reads as its
    loss (float(result))."""

    def __float__(self):
        return float(self["loss"])

    @property
    def loss(self):
        return self["loss"]


class MetaModel:
    """MegatronModel.meta's answer: `parameters` (the parameter table, local
    shapes as a rank of each tensor's pipeline stage holds them), `memory`
    (per pipeline stage: bytes of weights, grads, optimizer, activations,
    workspace and total per rank), `num_params`, `model_type`, `device_mesh`."""

    def __init__(self, model_type, num_params, parameters, memory, device_mesh):
        self.model_type, self.num_params = model_type, num_params
        self.parameters, self.memory, self.device_mesh = parameters, memory, device_mesh

    @property
    def peak_bytes(self):
        """The largest per-rank total over the pipeline stages."""
        return max(m["total"] for m in self.memory)

    def __repr__(self):
        return "MetaModel(%s, %d params, %s, peak %.2f GiB per rank)" % (
            self.model_type, self.num_params, self.device_mesh, self.peak_bytes / 2 ** 30)


class MegatronModel:
    def __new__(cls, model_id=None, config=None, device_mesh=None, mixed_precision="bf16",
                remote_group=None, **kwargs):
        if remote_group is not None and cls is MegatronModel:
            from .ray_group import RemoteMegatronModel
            return RemoteMegatronModel(model_id, config=config, device_mesh=device_mesh,
                                       mixed_precision=mixed_precision,
                                       remote_group=remote_group, **kwargs)
        return super().__new__(cls)

    def __init__(self, model_id, config=None, device_mesh=None, mixed_precision="bf16",
                 remote_group=None, **kwargs):
        _check_kwargs("MegatronModel", kwargs, _KWARGS)
        self._h = None
        self._ctx = L.Context()
        self.model_id = model_id
        self._model_path = resolve_model(model_id)
        if device_mesh is None:
            device_mesh = DeviceMesh.from_sizes()
        if not isinstance(device_mesh, DeviceMesh):
            raise InvalidArgumentError("device_mesh must be a loom.DeviceMesh (DeviceMesh."
                                       "from_sizes(...)), not %s" % type(device_mesh).__name__)
        rank, world, var = launcher_world()
        if device_mesh.world_size != world:
            raise MeshError("device_mesh %r has %d ranks but %s; start %d processes (mpirun -np "
                            "%d, torchrun --nproc-per-node %d) or change the sizes" % (
                                device_mesh, device_mesh.world_size,
                                "this process runs alone (no launcher)" if var is None else
                                "the launcher started %d (%s)" % (world, var),
                                device_mesh.world_size, device_mesh.world_size,
                                device_mesh.world_size))
        self.device_mesh = device_mesh
        if kwargs.get("log_level") is not None:
            lv = {"error": 0, "warn": 1, "warning": 1, "info": 2, "debug": 3}.get(
                str(kwargs["log_level"]).lower())
            if lv is None:
                raise InvalidArgumentError("log_level=%r: use error, warn, info or debug"
                                           % kwargs["log_level"])
            L.lib.loom_ctx_set_log_level(self._ctx.h, lv)
        if kwargs.get("comm_timeout") is not None:
            os.environ["LOOM_COMM_TIMEOUT"] = str(_num("MegatronModel", "comm_timeout",
                                                       kwargs["comm_timeout"], 0))
        if kwargs.get("load_weights") is False:
            raise UnsupportedError("load_weights=False: loom loads the checkpoint's weights; "
                                   "make random ones with `loom init` (or loom.init_model) and "
                                   "load those")
        self._seed = int(kwargs.get("seed", os.environ.get("TWINKLE_SEED", 42)))
        self._seq_len = kwargs.get("max_length", kwargs.get("seq_len"))
        self._append_eos = bool(kwargs.get("append_eos", True))
        self._tokenizer_dir = resolve_model(kwargs["tokenizer_id"]) \
            if kwargs.get("tokenizer_id") else self._model_path

        o = L.ModelOptions()
        L.lib.loom_model_options_default(C.byref(o))
        self._overrides = self._config_overrides(config)
        if self._overrides:
            o.config_overrides = json.dumps(self._overrides).encode()
        dev = kwargs.get("device", "auto")
        if dev not in ("auto", "cpu", "cuda"):
            raise InvalidArgumentError("device=%r: use 'cpu', 'cuda' or 'auto'" % (dev,))
        if dev == "auto":
            dev = "cuda" if "cuda" in L.features() and L.lib.loom_gpu_count() > 0 else "cpu"
        if dev == "cuda" and "cuda" not in L.features():
            raise UnsupportedError("device='cuda': this loom was built without CUDA; reinstall "
                                   "with LOOM_CUDA=1 pip install . (nvcc on PATH)")
        self.device = dev
        o.device = L.DEVICE_CUDA if dev == "cuda" else L.DEVICE_CPU
        mp = _precision(mixed_precision)
        if dev == "cpu" and mp != L.F32:
            if rank == 0:
                warnings.warn("loom: the CPU computes in fp32; mixed_precision=%r applies on "
                              "GPUs only" % mixed_precision, stacklevel=2)
            mp = L.F32
        self.mixed_precision = mixed_precision
        o.dtype = mp
        _mesh_options(o, device_mesh, kwargs, self._recompute)
        self._options = o
        self._pre_hooks, self._post_hooks = [], []
        for k, lst in (("pre_wrap_hook", self._pre_hooks), ("post_wrap_hook", self._post_hooks)):
            if kwargs.get(k) is not None:
                lst.append(kwargs[k])
        h = C.c_void_p()
        _check_mesh(self._ctx, L.lib.loom_model_create(self._ctx.h, self._model_path.encode(),
                                                       C.byref(o), C.byref(h)), "MegatronModel")
        self._h = h
        info = L.ModelInfo()
        L.lib.loom_model_get_info(h, C.byref(info))
        self.info = info
        mi = L.MeshInfo()
        L.lib.loom_model_get_mesh(h, C.byref(mi))
        self.mesh_info = mi
        self._groups = {_DEFAULT: _Group(_DEFAULT)}
        self._adapters = []
        self._active = None
        self._encoder = None
        self._wrapped = False

    # ---- construction helpers ----
    @staticmethod
    def _config_overrides(config):
        if config is None:
            return {}
        if isinstance(config, dict):
            d = config
        elif hasattr(config, "to_diff_dict"):  # transformers.PretrainedConfig
            d = config.to_diff_dict()
        else:
            raise InvalidArgumentError("config must be a dict or a transformers.PretrainedConfig, "
                                       "not %s" % type(config).__name__)
        try:
            json.dumps(d)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError("config: not JSON-serialisable (%s)" % e)
        return {k: v for k, v in d.items() if k not in ("transformers_version", "_name_or_path")}

    @staticmethod
    def _recompute(kw):
        g = kw.get("recompute_granularity")
        mods = kw.get("recompute_modules")
        meth = kw.get("recompute_method")
        nl = kw.get("recompute_num_layers")
        if meth not in (None, "uniform"):
            raise UnsupportedError("recompute_method=%r: loom recomputes uniformly, one layer at "
                                   "a time ('uniform')" % (meth,))
        if nl not in (None, 1):
            raise UnsupportedError("recompute_num_layers=%r: loom recomputes one layer at a time "
                                   "(1)" % (nl,))
        if g is None:
            return L.RECOMPUTE_NONE
        if g == "full":
            return L.RECOMPUTE_FULL
        if g != "selective":
            raise InvalidArgumentError("recompute_granularity=%r: use None, 'selective' or 'full'"
                                       % (g,))
        mods = list(mods or ["core_attn"])
        for mname in mods:
            if mname not in ("core_attn", "mlp"):
                raise UnsupportedError("recompute_modules: %r is not implemented by loom "
                                       "(core_attn, mlp)" % mname)
        # core attention is fused (flash-style), keeping nothing to recompute
        return L.RECOMPUTE_MLP if "mlp" in mods else L.RECOMPUTE_NONE

    def _check_open(self):
        if self._h is None:
            raise ConfigError("this MegatronModel was closed")

    def close(self):
        """Frees the model (collective: every rank calls it)."""
        if getattr(self, "_h", None):
            L.lib.loom_model_free(self._h)
            self._h = None
        if getattr(self, "_encoder", None):
            self._encoder.close()
            self._encoder = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- the mesh ----
    @property
    def rank(self):
        return self.mesh_info.rank

    @property
    def is_output_rank(self):
        return bool(self.mesh_info.is_output_rank)

    def mesh_coords(self):
        m = self.mesh_info
        return {"rank": m.rank, "world_size": m.world_size, "tp_rank": m.tp_rank,
                "cp_rank": m.cp_rank, "dp_rank": m.dp_rank, "pp_rank": m.pp_rank,
                "is_output_rank": bool(m.is_output_rank), "etp_rank": m.etp_rank,
                "ep_rank": m.ep_rank, "edp_rank": m.edp_rank}

    # ---- the parameter table and hooks ----
    def parameters_table(self):
        """One dict per HF tensor: name, shape, local_shape, layer, pp_stage, trainable."""
        self._check_open()
        out = []
        for i in range(self.info.num_tensors):
            p = L.ParamInfo()
            self._ctx.check(L.lib.loom_model_param_info(self._h, i, C.byref(p)))
            out.append({"name": p.name.decode(), "shape": tuple(p.shape[:p.ndim]),
                        "local_shape": tuple(p.local_shape[:p.ndim]) if p.local_shape[0] else None,
                        "dtype": "float32", "layer": None if p.layer < 0 else p.layer,
                        "pp_stage": p.pp_stage, "trainable": bool(p.trainable)})
        return out

    def register_pre_wrap_hook(self, fn):
        """fn(table) runs before the optimizer is built (the first set_optimizer):
        it gets parameters_table() and may set an entry's 'trainable' to False
        (or True) to freeze (or unfreeze) that tensor; frozen tensors get no
        gradient, no optimizer state and no update."""
        self._hook(fn, self._pre_hooks)

    def register_post_wrap_hook(self, fn):
        """Like register_pre_wrap_hook, run after the pre-wrap hooks."""
        self._hook(fn, self._post_hooks)

    def _hook(self, fn, where):
        if not callable(fn):
            raise InvalidArgumentError("a wrap hook must be callable, not %s" % type(fn).__name__)
        if self._wrapped:
            raise ConfigError("wrap hooks run when the optimizer is built; register them before "
                              "the first set_optimizer")
        where.append(fn)

    def set_trainable(self, name, trainable=True):
        """Freezes (False) or unfreezes one tensor by HF name, before training
        starts (every rank, the same names)."""
        self._check_open()
        self._ctx.check(L.lib.loom_model_set_trainable(self._h, str(name).encode(),
                                                       int(bool(trainable))), "set_trainable")

    def _wrap(self):
        """Runs the hooks once, before the first optimizer is set, applying the
        'trainable' flags they change."""
        if self._wrapped:
            return
        self._wrapped = True
        for fn in self._pre_hooks + self._post_hooks:
            table = self.parameters_table()
            before = [p["trainable"] for p in table]
            fn(table)
            for p, was in zip(table, before):
                if bool(p["trainable"]) != was:
                    self.set_trainable(p["name"], p["trainable"])

    @classmethod
    def meta(cls, model_id, device_mesh=None, config=None, mixed_precision="bf16",
             micro_batch_size=1, seq_len=4096, num_micro_batches=None, lora_r=0,
             lora_target="all-linear", device="cuda", **kwargs):
        """Megatron-Bridge's meta_model: the parameter table and each pipeline
        stage's predicted memory per rank, from config.json alone (no weight is
        read or allocated; no launcher needed). Returns a MetaModel."""
        _check_kwargs("MegatronModel.meta", kwargs, {"recompute_granularity", "recompute_modules",
                                                    "recompute_method", "recompute_num_layers",
                                                    "sequence_parallel",
                                                    "make_vocab_size_divisible_by",
                                                    "microbatch_group_size_per_vp_stage"})
        if device_mesh is None:
            device_mesh = DeviceMesh(1)
        if not isinstance(device_mesh, DeviceMesh):
            raise InvalidArgumentError("device_mesh must be a loom.DeviceMesh")
        if device not in ("cpu", "cuda"):
            raise InvalidArgumentError("device=%r: use 'cpu' or 'cuda'" % (device,))
        ctx = L.Context()
        o = L.ModelOptions()
        L.lib.loom_model_options_default(C.byref(o))
        ov = cls._config_overrides(config)
        if ov:
            o.config_overrides = json.dumps(ov).encode()
        o.device = L.DEVICE_CUDA if device == "cuda" else L.DEVICE_CPU
        mp = _precision(mixed_precision)
        o.dtype = mp if device == "cuda" else L.F32
        _mesh_options(o, device_mesh, kwargs, cls._recompute)
        if num_micro_batches is None:
            num_micro_batches = micro_batch_count(o.pp, 1, o.pp, o.vpp, o.microbatch_group)
        for name, v in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len),
                        ("num_micro_batches", num_micro_batches), ("lora_r", lora_r)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "lora_r" else 1):
                raise InvalidArgumentError("MegatronModel.meta: %s=%r must be an int >= %d"
                                           % (name, v, 0 if name == "lora_r" else 1))
        q = L.MetaQuery(world_size=device_mesh.world_size, micro_batch_size=micro_batch_size,
                        seq_len=seq_len, num_micro_batches=num_micro_batches, lora_r=lora_r,
                        lora_target=str(lora_target).encode())
        h = C.c_void_p()
        _check_mesh(ctx, L.lib.loom_meta_create(ctx.h, resolve_model(model_id).encode(),
                                                C.byref(o), C.byref(q), C.byref(h)),
                    "MegatronModel.meta")
        try:
            info = L.ModelInfo()
            L.lib.loom_meta_get_info(h, C.byref(info))
            table = []
            for i in range(info.num_tensors):
                p = L.ParamInfo()
                ctx.check(L.lib.loom_meta_param_info(h, i, C.byref(p)))
                table.append({"name": p.name.decode(), "shape": tuple(p.shape[:p.ndim]),
                              "local_shape": tuple(p.local_shape[:p.ndim]), "dtype": "float32",
                              "layer": None if p.layer < 0 else p.layer,
                              "pp_stage": p.pp_stage, "trainable": not lora_r})
            mem = []
            for s in range(o.pp):
                e = L.MemoryEstimate()
                ctx.check(L.lib.loom_meta_memory(h, s, C.byref(e)))
                mem.append({k: getattr(e, k) for k, _ in L.MemoryEstimate._fields_})
        finally:
            L.lib.loom_meta_free(h)
        return MetaModel(info.model_type.decode(), int(info.num_params), table, mem, device_mesh)

    # ---- adapters ----
    def _group(self, adapter_name):
        """The group of an adapter; None: the last added adapter's, or the whole
        model's when there is none."""
        if adapter_name is None or adapter_name == _DEFAULT:
            name = self._adapters[-1] if self._adapters else _DEFAULT
        else:
            name = adapter_name
        if name not in self._groups:
            raise NotFoundError("adapter %r does not exist (adapters: %s); add it with "
                                "add_adapter_to_model" % (name, ", ".join(self._adapters) or
                                                          "none"))
        return self._groups[name]

    def _activate(self, g):
        """Makes the group's adapter the trained one, with its optimizer settings."""
        name = g.name or None
        if name != self._active:
            self._ctx.check(L.lib.loom_model_set_adapter(
                self._h, name.encode() if name else None), "set_adapter")
            self._active = name
        if g.opt is not None:
            self._ctx.check(L.lib.loom_model_set_optimizer(self._h, C.byref(g.opt)))
        if g.sched is not None:
            self._ctx.check(L.lib.loom_model_set_lr_scheduler(self._h, C.byref(g.sched)))
        elif g.opt is not None and any(x.sched is not None for x in self._groups.values()):
            s = L.lib.loom_sched_config_default()  # this group has none: a constant lr
            s.max_lr, s.init_lr, s.min_lr = g.opt.lr, g.opt.lr, g.opt.lr
            s.lr_decay_style = L.LR_STYLES["constant"]
            s.start_wd = s.end_wd = g.opt.weight_decay
            self._ctx.check(L.lib.loom_model_set_lr_scheduler(self._h, C.byref(s)))
        return g

    def add_adapter_to_model(self, adapter_name, config_or_dir, **kwargs):
        """A LoRA adapter: loom.LoraConfig, peft.LoraConfig, a dict, or a PEFT
        directory. kwargs: gradient_accumulation_steps (the group's default)."""
        self._check_open()
        _check_kwargs("add_adapter_to_model", kwargs, {"gradient_accumulation_steps",
                                                       "is_trainable"})
        if not isinstance(adapter_name, str) or not adapter_name:
            raise InvalidArgumentError("adapter_name must be a non-empty str, not %r"
                                       % (adapter_name,))
        if adapter_name in self._groups:
            raise InvalidArgumentError("adapter %r exists already" % adapter_name)
        cfg = lora_normalize(config_or_dir)
        if "dir" in cfg:
            self._ctx.check(L.lib.loom_model_load_adapter(self._h, adapter_name.encode(),
                                                          cfg["dir"].encode()),
                            "add_adapter_to_model")
        else:
            lc = L.LoraConfig_(r=cfg["r"], lora_alpha=cfg["lora_alpha"],
                               lora_dropout=cfg["lora_dropout"],
                               target_modules=cfg["target_modules"].encode(),
                               use_rslora=int(cfg["use_rslora"]),
                               seed=self._seed if cfg["seed"] is None else cfg["seed"])
            self._ctx.check(L.lib.loom_model_add_adapter(self._h, adapter_name.encode(),
                                                         C.byref(lc)), "add_adapter_to_model")
        gas = kwargs.get("gradient_accumulation_steps", 1)
        g = _Group(adapter_name, gas)
        g.adapter_config = cfg
        self._groups[adapter_name] = g
        self._adapters.append(adapter_name)
        self._active = adapter_name

    # ---- optimizer and schedule ----
    def set_optimizer(self, optimizer_cls="default", adapter_name=None, **kwargs):
        """Megatron's distributed AdamW ('default' or 'MegatronDistributedOptimizer'):
        lr (1e-4), weight_decay (0.01), adam_beta1 (0.9), adam_beta2 (0.999),
        adam_eps (1e-8), clip_grad (1.0)."""
        self._check_open()
        if optimizer_cls not in (None, "", "default", "MegatronDistributedOptimizer",
                                 "MegatronDistributed"):
            raise UnsupportedError("Unsupported optimizer: %r, only support MegatronOptimizer "
                                   "currently ('default' or 'MegatronDistributedOptimizer': "
                                   "AdamW with the distributed optimizer)" % (optimizer_cls,))
        _check_kwargs("set_optimizer", kwargs, _OPT_KWARGS)
        if kwargs.get("optimizer", "adam") != "adam":
            raise UnsupportedError("set_optimizer: optimizer=%r; loom implements 'adam' (AdamW)"
                                   % kwargs["optimizer"])
        self._wrap()
        g = self._group(adapter_name)
        o = L.lib.loom_optimizer_config_default()
        o.lr = _num("set_optimizer", "lr", kwargs.get("lr", 1e-4), 0)
        o.weight_decay = _num("set_optimizer", "weight_decay", kwargs.get("weight_decay", 0.01), 0)
        o.beta1 = _num("set_optimizer", "adam_beta1", kwargs.get("adam_beta1", 0.9), 0, 1)
        o.beta2 = _num("set_optimizer", "adam_beta2", kwargs.get("adam_beta2", 0.999), 0, 1)
        o.eps = _num("set_optimizer", "adam_eps", kwargs.get("adam_eps", 1e-8), 0, open_lo=True)
        g.clip_grad = _num("set_optimizer", "clip_grad", kwargs.get("clip_grad", 1.0), 0)
        self._ctx.check(L.lib.loom_model_set_optimizer(self._h, C.byref(o)), "set_optimizer")
        g.opt = o
        g.optimizer_kwargs = dict(kwargs)

    def set_lr_scheduler(self, scheduler_cls="default", adapter_name=None, **kwargs):
        """Megatron's OptimizerParamScheduler: lr_decay_steps (required), max_lr
        (1e-4), init_lr (0), min_lr (0), lr_warmup_steps (0), lr_decay_style
        ('cosine'), start_wd / end_wd (0.01), wd_incr_steps (lr_decay_steps),
        wd_incr_style ('constant'), wsd_decay_steps, lr_wsd_decay_style."""
        self._check_open()
        if scheduler_cls not in (None, "", "default", "OptimizerParamScheduler"):
            raise UnsupportedError("Unsupported scheduler: %r, only support "
                                   "OptimizerParamScheduler currently" % (scheduler_cls,))
        _check_kwargs("set_lr_scheduler", kwargs, _SCHED_KWARGS)
        if "lr_decay_steps" not in kwargs:
            raise InvalidArgumentError("set_lr_scheduler: lr_decay_steps is required (the steps "
                                       "over which the lr decays)")
        g = self._group(adapter_name)
        if g.opt is None:
            raise ConfigError("set_lr_scheduler: call set_optimizer first (Twinkle's order)")
        s = L.lib.loom_sched_config_default()
        w = "set_lr_scheduler"
        s.max_lr = _num(w, "max_lr", kwargs.get("max_lr", 1e-4), 0)
        s.init_lr = _num(w, "init_lr", kwargs.get("init_lr", kwargs.get("lr_warmup_init", 0.0)), 0)
        s.min_lr = _num(w, "min_lr", kwargs.get("min_lr", 0.0), 0)

        def steps(name, v):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise InvalidArgumentError("%s: %s=%r must be an int >= 0" % (w, name, v))
            return int(v)
        s.lr_warmup_steps = steps("lr_warmup_steps", kwargs.get("lr_warmup_steps", 0))
        s.lr_decay_steps = steps("lr_decay_steps", kwargs["lr_decay_steps"])
        style = kwargs.get("lr_decay_style", "cosine")
        if style not in L.LR_STYLES:
            raise InvalidArgumentError("%s: lr_decay_style=%r: use %s" % (
                w, style, ", ".join(sorted(L.LR_STYLES))))
        s.lr_decay_style = L.LR_STYLES[style]
        if kwargs.get("wsd_decay_steps") is not None:
            s.wsd_decay_steps = steps("wsd_decay_steps", kwargs["wsd_decay_steps"])
        if kwargs.get("lr_wsd_decay_style") is not None:
            ws = kwargs["lr_wsd_decay_style"]
            if ws not in L.WSD_STYLES:
                raise InvalidArgumentError("%s: lr_wsd_decay_style=%r: use %s" % (
                    w, ws, ", ".join(L.WSD_STYLES)))
            s.lr_wsd_decay_style = L.WSD_STYLES[ws]
        s.start_wd = _num(w, "start_wd", kwargs.get("start_wd", 0.01), 0)
        s.end_wd = _num(w, "end_wd", kwargs.get("end_wd", 0.01), 0)
        s.wd_incr_steps = steps("wd_incr_steps", kwargs.get("wd_incr_steps", s.lr_decay_steps))
        wis = kwargs.get("wd_incr_style", "constant")
        if wis not in L.WD_STYLES:
            raise InvalidArgumentError("%s: wd_incr_style=%r: use %s" % (
                w, wis, ", ".join(L.WD_STYLES)))
        s.wd_incr_style = L.WD_STYLES[wis]
        self._ctx.check(L.lib.loom_model_set_lr_scheduler(self._h, C.byref(s)), w)
        g.sched = s

    # ---- data ----
    def set_template(self, template_cls="Template", adapter_name=None, **kwargs):
        """Tokenize text / messages samples with the model's tokenizer and chat
        template (or those of model_id=...)."""
        self._check_open()
        _check_kwargs("set_template", kwargs, {"model_id", "max_length", "append_eos",
                                               "truncation_strategy"})
        if not isinstance(template_cls, str) and not hasattr(template_cls, "__name__"):
            raise InvalidArgumentError("set_template: template_cls must be a name, not %s"
                                       % type(template_cls).__name__)
        from .encoder import Encoder
        d = resolve_model(kwargs["model_id"]) if kwargs.get("model_id") else self._tokenizer_dir
        if self._encoder:
            self._encoder.close()
        self._encoder = Encoder(self._ctx, d)
        if kwargs.get("max_length") is not None:
            self._seq_len = kwargs["max_length"]
        if kwargs.get("append_eos") is not None:
            self._append_eos = bool(kwargs["append_eos"])

    def _divisor(self):
        m = self.mesh_info
        d = 2 * m.cp if m.cp > 1 else 1
        if m.sequence_parallel and m.tp > 1:
            d = d * m.tp // np.gcd(d, m.tp)
        return d

    def _pack(self, inputs, micro_batch_size, seq_len):
        m = self.mesh_info
        if seq_len is None and self._seq_len is None:
            p = rows_in_place(inputs, self.info.vocab_size, self._divisor(), micro_batch_size,
                              m.pp, m.vpp, m.microbatch_group)
            if p is not None:  # the caller's input_ids, read where they lie
                return p
        samples = to_samples(inputs, self._encoder, self._append_eos, self.info.vocab_size)
        return pack(samples, seq_len if seq_len is not None else self._seq_len, self._divisor(),
                    micro_batch_size, m.pp, m.vpp, m.microbatch_group)

    def _pack_agreed(self, inputs, micro_batch_size, seq_len, backward):
        """Packs this rank's inputs; when they are refused here, the other ranks
        hear of it through the library (an empty batch), so none waits."""
        from .errors import LoomError
        try:
            return self._pack(inputs, micro_batch_size, seq_len)
        except LoomError:
            if self.mesh_info.world_size > 1:
                b, r = L.Batch(local=1), L.FBResult()
                f = L.lib.loom_model_forward_backward if backward else None
                if f:
                    f(self._h, C.byref(b), 1, C.byref(r))
                else:
                    L.lib.loom_model_forward_only(self._h, C.byref(b), 1, None, None, None,
                                                  C.byref(r))
                L.lib.loom_clear_error(self._ctx.h)
            raise

    def _batch(self, p):
        b = L.Batch(rows=p.rows, seq_len=p.seq_len, input_ids=L.i32_ptr(p.input_ids),
                    targets=L.i32_ptr(p.targets), cu_seqlens=L.i32_ptr(p.cu_seqlens),
                    n_docs=0 if p.cu_seqlens is None else len(p.cu_seqlens) - 1,
                    position_ids=L.i32_ptr(p.position_ids),
                    local=1, loss_weights=L.f32_ptr(p.loss_weights))
        return b

    # ---- training ----
    def forward_backward(self, inputs=None, micro_batch_size=None, adapter_name=None,
                         seq_len=None, **kwargs):
        """Runs this rank's samples (its data-parallel slice) through the pipeline
        and accumulates gradients. Returns a Result: loss (of every rank's
        tokens of this call), num_tokens, loss_sum.

        A sample may carry loss_weights (in a dict of arrays: an array shaped
        as input_ids): one finite number per token, aligned as labels, that
        scales the loss of label t and its gradient (advantages, soft masks;
        negative and 0 allowed). The loss still divides by the count of
        tokens with a label, not by the weights' sum. A sample without
        weights weighs 1 per token."""
        self._check_open()
        _check_kwargs("forward_backward", kwargs, {"inputs", "micro_batch_size", "adapter_name",
                                                   "seq_len"})
        if inputs is None:
            raise InvalidArgumentError("forward_backward: inputs is required")
        g = self._group(adapter_name)
        self._activate(g)
        p = self._pack_agreed(inputs, micro_batch_size, seq_len, True)
        b = self._batch(p)
        r = L.FBResult()
        self._ctx.check(L.lib.loom_model_forward_backward(self._h, C.byref(b), p.n_micro,
                                                          C.byref(r)), "forward_backward")
        g.cur_step += 1
        return Result(loss=r.loss, num_tokens=int(r.n_tokens), loss_sum=r.loss_sum,
                      aux_loss=r.aux_loss, z_loss=r.z_loss)

    def forward_only(self, inputs=None, micro_batch_size=None, adapter_name=None, seq_len=None,
                     temperature=1.0, return_logits=False, **kwargs):
        """Per-token log-probs and entropy of each sample (numpy, label-aligned:
        logps[i][t] = log p(token t | tokens < t), 0 at t = 0), and the loss.
        return_logits: logits[i] (len, vocab), row t predicting token t + 1.
        Samples may carry loss_weights (as forward_backward's, so one batch
        serves both calls): log-probs, entropy and logits are the model's,
        never weighted; loss and loss_sum are weighted as forward_backward's."""
        self._check_open()
        _check_kwargs("forward_only", kwargs, {"inputs", "micro_batch_size", "adapter_name",
                                               "seq_len", "temperature", "return_logits"})
        if inputs is None:
            raise InvalidArgumentError("forward_only: inputs is required")
        if temperature != 1.0:
            raise UnsupportedError("forward_only: temperature=%r; loom computes log-probs at "
                                   "temperature 1.0" % (temperature,))
        g = self._group(adapter_name)
        self._activate(g)
        p = self._pack_agreed(inputs, micro_batch_size, seq_len, False)
        b = self._batch(p)
        T = p.rows * p.seq_len
        lp = np.empty(T, np.float32)
        ent = np.empty(T, np.float32)
        lg = np.empty((T, self.info.vocab_size), np.float32) if return_logits else None
        r = L.FBResult()
        self._ctx.check(L.lib.loom_model_forward_only(self._h, C.byref(b), p.n_micro, L.f32_ptr(lp),
                                                      L.f32_ptr(ent), L.f32_ptr(lg), C.byref(r)),
                        "forward_only")
        out = Result(loss=r.loss, num_tokens=int(r.n_tokens), loss_sum=r.loss_sum,
                     aux_loss=r.aux_loss, z_loss=r.z_loss, logps=unpack(lp, p),
                     entropy=unpack(ent, p))
        if return_logits:
            out["logits"] = [lg[rw * p.seq_len + off: rw * p.seq_len + off + n]
                             for (rw, off, n) in p.places]
        return out

    def clip_grad_and_step(self, max_grad_norm=None, norm_type=2, adapter_name=None, **kwargs):
        """Steps optimizer and schedule when Twinkle would: after the 1st
        forward_backward call, then every gradient_accumulation_steps calls
        ((calls - 1) % gas == 0). Clips to max_grad_norm when given, else to
        set_optimizer's clip_grad. Returns {stepped, grad_norm, lr, loss, ...}."""
        self._check_open()
        _check_kwargs("clip_grad_and_step", kwargs, {"gradient_accumulation_steps"})
        if norm_type != 2:
            raise UnsupportedError("clip_grad_and_step: norm_type=%r; loom clips the L2 norm"
                                   % (norm_type,))
        gas = kwargs.get("gradient_accumulation_steps")
        if gas is not None and (isinstance(gas, bool) or not isinstance(gas, int) or gas < 1):
            raise InvalidArgumentError("gradient_accumulation_steps=%r must be an int >= 1"
                                       % (gas,))
        g = self._group(adapter_name)
        if not g.do_grad_sync(gas):
            return {"stepped": False, "grad_norm": None}
        self._activate(g)
        clip = g.clip_grad if max_grad_norm is None else _num("clip_grad_and_step",
                                                               "max_grad_norm", max_grad_norm, 0)
        r = L.StepResult()
        self._ctx.check(L.lib.loom_model_clip_grad_and_step(self._h, clip, 1, C.byref(r)),
                        "clip_grad_and_step")
        return {"stepped": bool(r.stepped), "grad_norm": r.grad_norm, "lr": r.lr,
                "weight_decay": r.weight_decay, "step": int(r.step), "loss": r.loss,
                "num_tokens": int(r.n_tokens), "skipped": bool(r.skipped),
                "loss_scale": r.loss_scale, "aux_loss": r.aux_loss,
                "expert_tokens_min": r.expert_tokens_min,
                "expert_tokens_mean": r.expert_tokens_mean,
                "expert_tokens_max": r.expert_tokens_max,
                "expert_imbalance": r.expert_imbalance,
                "expert_imbalance_layer": int(r.expert_imbalance_layer), "z_loss": r.z_loss}

    def expert_tokens(self):
        """Mixture of experts: the tokens each expert of each layer was sent
        over the last optimizer step, summed over the mesh (each of a token's
        top-k choices counted), as a (num_layers, num_experts) float64 array;
        dense layers' rows are 0. A loom extension (Megatron logs these
        per layer)."""
        self._check_open()
        info = self.info
        a = np.zeros((info.num_layers, max(info.num_experts, 1)), np.float64)
        self._ctx.check(L.lib.loom_model_expert_tokens(
            self._h, a.ctypes.data_as(C.POINTER(C.c_double)), a.size), "expert_tokens")
        return a

    def profile(self):
        """Where this rank's training steps spent their time, as text (the
        model made with profile=True): each part of a step (forward
        attention, backward moe.a2a, step optimizer, ...) with its time on
        the device per step, over the steps after the first. A loom
        extension (loom train --profile prints the same)."""
        self._check_open()
        buf = C.create_string_buffer(1 << 16)
        L.lib.loom_model_profile(self._h, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def profile_breakdown(self):
        """This rank's step time by kind, ms per step over the steps since
        the last call (the model made with profile=True): a dict of steps,
        compute_ms, comm_ms (the collectives waited on), bubble_ms (the
        pipeline's exchanges) and idle_ms (host waits, and the host's time
        between steps); steps 0 when none ended since. A loom extension."""
        self._check_open()
        b = L.StepBreakdown()
        L.lib.loom_model_profile_interval(self._h, C.byref(b))
        return {k: getattr(b, k) for k, _ in L.StepBreakdown._fields_}

    def zero_grad(self, adapter_name=None, **kwargs):
        self._check_open()
        L.lib.loom_model_zero_grad(self._h)

    # ---- outputs ----
    def get_state_dict(self, adapter_name=None, **kwargs):
        """The trainable tensors as numpy fp32, whole (collective: every rank
        calls it; every rank gets them). With adapters: the adapter's, by PEFT name."""
        self._check_open()
        name = self._group(adapter_name).name
        out = {}
        if name:
            buf = C.create_string_buffer(1024)
            shape = (C.c_int64 * 2)()
            i = 0
            while True:
                n = L.lib.loom_model_adapter_tensor(self._h, name.encode(), i, buf, 1024, shape)
                if not n:
                    break
                a = np.empty((shape[0], shape[1]), np.float32)
                key = n.decode()
                for part in (".lora_A.", ".lora_B."):  # this adapter's, by name
                    key = key.replace(part, part + name + ".")
                self._ctx.check(L.lib.loom_model_get_param(self._h, key.encode(), L.f32_ptr(a),
                                                           a.size), "get_state_dict")
                out[n.decode()] = a
                i += 1
            return out
        for p in self.parameters_table():
            a = np.empty(p["shape"], np.float32)
            self._ctx.check(L.lib.loom_model_get_param(self._h, p["name"].encode(),
                                                       L.f32_ptr(a), a.size), "get_state_dict")
            out[p["name"]] = a
        return out

    def save(self, name=None, output_dir=None, merge_lora=False, adapter_name=None,
             save_dtype=None, save_optimizer=False, dataloader=None, **kwargs):
        """Writes output_dir/name (collective): a PEFT adapter directory when
        training an adapter (merge_lora: an HF directory with it merged in),
        else an HF model directory. save_optimizer: also the training state
        (fp32 master, AdamW moments, step, the dataloader's position) in
        output_dir/name/training_state, which load / resume_from_checkpoint
        read back on any mesh. Returns the path."""
        self._check_open()
        _check_kwargs("save", kwargs, {"interval", "save_format", "max_shard_size"})
        if dataloader is not None and not hasattr(dataloader, "state_dict"):
            raise InvalidArgumentError("save: dataloader must be a loom.DataLoader")
        fmt = kwargs.get("save_format", "hf")
        if fmt != "hf":
            raise UnsupportedError("save_format=%r: loom writes 'hf' (HF / PEFT files); training "
                                   "checkpoints come with loom's checkpoint support" % (fmt,))
        g = self._group(adapter_name)
        interval = kwargs.get("interval", 1)
        if interval and g.cur_step % interval:
            return None
        if name is None:
            name = "checkpoint-step-%d" % g.cur_step
        path = os.path.join(output_dir if output_dir is not None else "output", name)
        dt = {None: L.DTYPE_COUNT, "float32": L.F32, "bfloat16": L.BF16,
              "float16": L.F16}.get(save_dtype)
        if dt is None:
            raise InvalidArgumentError("save_dtype=%r: use None (as read), float32, bfloat16 or "
                                       "float16" % (save_dtype,))
        shard = int(kwargs.get("max_shard_size", 0))
        old_state = os.path.join(path, _STATE_DIR)
        if self.rank == 0 and os.path.isfile(os.path.join(old_state, "meta.json")):
            import shutil  # a re-save of the same name replaces our own state too
            shutil.rmtree(old_state)
        aname = g.name
        if aname and not merge_lora:
            self._ctx.check(L.lib.loom_model_save_adapter(
                self._h, aname.encode(), path.encode(), L.F32 if dt == L.DTYPE_COUNT else dt),
                "save")
        elif aname:
            self._ctx.check(L.lib.loom_model_merge_adapter(self._h, aname.encode()), "save")
            try:
                self._ctx.check(L.lib.loom_model_save_hf(self._h, path.encode(), dt, shard), "save")
            finally:
                self._ctx.check(L.lib.loom_model_unmerge_adapter(self._h, aname.encode()), "save")
        else:
            self._ctx.check(L.lib.loom_model_save_hf(self._h, path.encode(), dt, shard), "save")
        if save_optimizer:
            progress = {}
            if dataloader is not None:
                d = dataloader.state_dict()
                progress = {"data_epoch": d["epoch"], "data_index": d["index"],
                            "consumed_samples": d["epoch"] * len(dataloader.dataset) + d["index"]}
            self.save_state(os.path.join(path, _STATE_DIR), progress=progress)
        return path

    def load(self, name, output_dir=None, load_optimizer=True, dataloader=None, **kwargs):
        """Reads what save(name, output_dir, save_optimizer=True) wrote, before
        training (a model made as the saved one: same config, adapter added):
        the trained tensors, and with load_optimizer the optimizer state, the
        step and the dataloader's position. Returns the progress."""
        _check_kwargs("load", kwargs, {"adapter_name"})
        path = os.path.join(output_dir if output_dir is not None else "output", name)
        return self.resume_from_checkpoint(path, load_optimizer=load_optimizer,
                                           dataloader=dataloader)

    def resume_from_checkpoint(self, checkpoint_dir, load_optimizer=True, dataloader=None):
        """The training state of a save(..., save_optimizer=True) directory, of
        its training_state, or of a `loom train --save` root (its newest
        complete checkpoint) or iter_ directory: weights, optimizer, step,
        and (given a DataLoader) the data position, so the loop continues
        where it stopped. Returns {step, consumed_samples, consumed_tokens,
        data_epoch, data_index}. Collective."""
        d = _find_state(os.fspath(checkpoint_dir))
        progress = self.load_state(d, load_optimizer=load_optimizer)
        if dataloader is not None and load_optimizer:
            dataloader.load_state_dict({"epoch": progress["data_epoch"],
                                        "index": progress["data_index"]})
        return progress

    def save_state(self, directory, save_optimizer=True, progress=None):
        """The training state (fp32 master of the trained tensors, AdamW
        moments, step, loss scale, dropout stream, and `progress`: a dict of
        consumed_samples, consumed_tokens, data_epoch, data_index) into an
        existing directory; any mesh can load it (load_state). Collective."""
        self._check_open()
        p = L.TrainProgress(**{k: int(v) for k, v in (progress or {}).items()
                               if k in ("consumed_samples", "consumed_tokens", "data_epoch",
                                        "data_index", "data_offset")})
        os.makedirs(directory, exist_ok=True)
        self._ctx.check(L.lib.loom_model_save_state(self._h, os.fspath(directory).encode(),
                                                    C.byref(p), int(bool(save_optimizer))),
                        "save_state")

    def load_state(self, directory, load_optimizer=True):
        """Loads save_state's directory (saved on any mesh) before training;
        returns the progress (step, consumed_samples, ...). Collective."""
        self._check_open()
        p = L.TrainProgress()
        self._ctx.check(L.lib.loom_model_load_state(self._h, os.fspath(directory).encode(),
                                                    int(bool(load_optimizer)), C.byref(p)),
                        "load_state")
        g = self._group(None)
        g.cur_step = int(p.step) if load_optimizer else 0
        return {k: int(getattr(p, k)) for k, _ in L.TrainProgress._fields_}

    def get_train_configs(self, adapter_name=None, **kwargs):
        g = self._group(adapter_name)
        m = self.mesh_info
        s = "Backend: loom %s (%s)\n" % (L.version(), self.device)
        s += "DP size: %d\nTP size: %d\n  - VPP size: %d\nPP size: %d\nCP size: %d\n" % (
            m.dp, m.tp, m.vpp, m.pp, m.cp)
        s += "EP size: %d\nETP size: %d\nEDP size: %d\nSequence Parallel: %s\n" % (
            m.ep, m.etp, m.edp, bool(m.sequence_parallel))
        s += "Mixed precision: %s\n" % self.mixed_precision
        if g.adapter_config is not None:
            s += "Adapter config:\n%s\n" % json.dumps({k: str(v) for k, v in
                                                      g.adapter_config.items()}, indent=2)
        if g.opt is not None:
            s += "Optimizer: MegatronDistributedOptimizer (AdamW)\nLearning rate: %g\n" % g.opt.lr
        if g.sched is not None:
            s += "LR scheduler: OptimizerParamScheduler\n"
        s += "Gradient accumulation steps: %d\n" % g.gradient_accumulation_steps
        return s
