"""ctypes bindings of include/loom.h: the library, its structs and a call helper.

The C library does the work; this module only declares its functions and
turns a failed status into a LoomError carrying the library's message.
"""
import ctypes as C
import os

from .errors import error_for

_HERE = os.path.dirname(os.path.abspath(__file__))


def _candidates():
    env = os.environ.get("LOOM_LIBRARY")
    if env:
        yield env
    yield os.path.join(_HERE, "lib", "libloom.so")  # pip install .
    root = os.path.dirname(os.path.dirname(_HERE))   # a source checkout
    for build in ("build-cuda", "build"):
        yield os.path.join(root, build, "libloom.so")


def library_path():
    tried = []
    for p in _candidates():
        if os.path.exists(p):
            return p
        tried.append(p)
    raise ImportError("loom: libloom.so not found (looked in %s); run `pip install .` at the "
                      "repository root, or `make` there, or set LOOM_LIBRARY" % ", ".join(tried))


# RTLD_GLOBAL: MPI's plugins look up libmpi's symbols in the global scope.
lib = C.CDLL(library_path(), mode=C.RTLD_GLOBAL)

i32, i64, u64, f64, vp, cp = C.c_int, C.c_int64, C.c_uint64, C.c_double, C.c_void_p, C.c_char_p
P = C.POINTER

# enum loom_dtype
F32, BF16, F16, F64, I64, I32, I16, I8, U8, BOOL, DTYPE_COUNT = range(11)
DEVICE_CPU, DEVICE_CUDA = 0, 1
RECOMPUTE_NONE, RECOMPUTE_MLP, RECOMPUTE_FULL = 0, 1, 2
LR_STYLES = {"constant": 0, "linear": 1, "cosine": 2, "inverse-square-root": 3,
             "inverse_square_root": 3, "WSD": 4, "wsd": 4}
WSD_STYLES = {"linear": 0, "cosine": 1, "exponential": 2, "minus_sqrt": 3}
WD_STYLES = {"constant": 0, "linear": 1, "cosine": 2}


class ModelOptions(C.Structure):
    _fields_ = [("config_overrides", cp), ("dtype", i32), ("device", i32),
                ("vocab_pad_multiple", i64),
                ("tp", i32), ("cp", i32), ("dp", i32), ("pp", i32), ("vpp", i32), ("ep", i32),
                ("etp", i32), ("sequence_parallel", i32), ("microbatch_group", i32),
                ("bucket_elems", i64), ("recompute", i32), ("moe_aux", i32),
                ("moe_z_loss_coeff", f64), ("moe_expert_capacity_factor", f64),
                ("moe_token_drop_policy", i32), ("moe_router_force_load_balancing", i32),
                ("profile", i32)]


class ModelInfo(C.Structure):
    _fields_ = [("model_type", cp), ("vocab_size", i64), ("padded_vocab_size", i64),
                ("hidden_size", i64), ("intermediate_size", i64), ("num_layers", i64),
                ("num_heads", i64), ("num_kv_heads", i64), ("head_dim", i64),
                ("num_params", i64), ("num_tensors", i64),
                ("max_position_embeddings", i64), ("num_experts", i64),
                ("num_experts_per_tok", i64)]


class MeshInfo(C.Structure):
    _fields_ = [(n, i32) for n in (
        "world_size", "rank", "tp", "cp", "dp", "pp", "vpp", "ep", "etp", "sequence_parallel",
        "microbatch_group", "tp_rank", "cp_rank", "dp_rank", "pp_rank", "is_output_rank",
        "edp", "etp_rank", "ep_rank", "edp_rank")]


class ParamInfo(C.Structure):
    _fields_ = [("name", cp), ("ndim", i32), ("shape", i64 * 2), ("local_shape", i64 * 2),
                ("layer", i32), ("pp_stage", i32), ("trainable", i32)]


class MemoryEstimate(C.Structure):
    _fields_ = [("pp_rank", i32), ("in_flight", i32), ("weights", u64), ("grads", u64),
                ("optimizer", u64), ("activations", u64), ("workspace", u64), ("total", u64)]


class MetaQuery(C.Structure):
    _fields_ = [("world_size", i32), ("micro_batch_size", i64), ("seq_len", i64),
                ("num_micro_batches", i64), ("lora_r", i32), ("lora_target", cp)]


class TrainProgress(C.Structure):
    _fields_ = [("step", i64), ("consumed_samples", i64), ("consumed_tokens", i64),
                ("data_epoch", i64), ("data_index", i64), ("data_offset", i64)]


class StepBreakdown(C.Structure):
    _fields_ = [("steps", i64), ("compute_ms", f64), ("comm_ms", f64), ("bubble_ms", f64),
                ("idle_ms", f64)]


class OptimizerConfig(C.Structure):
    _fields_ = [("lr", f64), ("beta1", f64), ("beta2", f64), ("eps", f64),
                ("weight_decay", f64)]


class SchedConfig(C.Structure):
    _fields_ = [("init_lr", f64), ("max_lr", f64), ("min_lr", f64), ("lr_warmup_steps", i64),
                ("lr_decay_steps", i64), ("lr_decay_style", i32), ("wsd_decay_steps", i64),
                ("lr_wsd_decay_style", i32), ("start_wd", f64), ("end_wd", f64),
                ("wd_incr_steps", i64), ("wd_incr_style", i32)]


class Batch(C.Structure):
    _fields_ = [("rows", i64), ("seq_len", i64), ("input_ids", P(C.c_int32)),
                ("targets", P(C.c_int32)), ("cu_seqlens", P(C.c_int32)), ("n_docs", i64),
                ("position_ids", P(C.c_int32)), ("local", i32),
                ("loss_weights", P(C.c_float))]


class FBResult(C.Structure):
    _fields_ = [("loss", f64), ("loss_sum", f64), ("n_tokens", i64), ("aux_loss", f64),
                ("z_loss", f64)]


class StepResult(C.Structure):
    _fields_ = [("stepped", i32), ("grad_norm", f64), ("lr", f64), ("weight_decay", f64),
                ("step", i64), ("loss", f64), ("n_tokens", i64), ("skipped", i32),
                ("loss_scale", f64), ("aux_loss", f64), ("expert_tokens_min", f64),
                ("expert_tokens_mean", f64), ("expert_tokens_max", f64),
                ("expert_imbalance", f64), ("z_loss", f64), ("expert_imbalance_layer", i64)]


class LoraConfig_(C.Structure):
    _fields_ = [("r", i32), ("lora_alpha", f64), ("lora_dropout", f64), ("target_modules", cp),
                ("use_rslora", i32), ("seed", u64)]


def _decl(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)


ctx_p, model_p, enc_p = vp, vp, vp
_decl("loom_ctx_create", i32, P(vp))
_decl("loom_ctx_free", None, vp)
_decl("loom_last_error", cp, vp)
_decl("loom_clear_error", None, vp)
_decl("loom_ctx_set_log_level", None, vp, i32)
_decl("loom_version", cp)
_decl("loom_features", cp)
_decl("loom_gpu_count", i32)
_decl("loom_status_str", cp, i32)
_decl("loom_model_options_default", None, P(ModelOptions))
_decl("loom_model_create", i32, vp, cp, P(ModelOptions), P(vp))
_decl("loom_model_free", None, vp)
_decl("loom_model_get_info", None, vp, P(ModelInfo))
_decl("loom_model_get_mesh", None, vp, P(MeshInfo))
_decl("loom_model_param_info", i32, vp, i64, P(ParamInfo))
_decl("loom_model_set_trainable", i32, vp, cp, i32)
_decl("loom_model_save_state", i32, vp, cp, P(TrainProgress), i32)
_decl("loom_model_load_state", i32, vp, cp, i32, P(TrainProgress))
_decl("loom_meta_create", i32, vp, cp, P(ModelOptions), P(MetaQuery), P(vp))
_decl("loom_meta_free", None, vp)
_decl("loom_meta_get_info", None, vp, P(ModelInfo))
_decl("loom_meta_param_info", i32, vp, i64, P(ParamInfo))
_decl("loom_meta_memory", i32, vp, i32, P(MemoryEstimate))
_decl("loom_optimizer_config_default", OptimizerConfig)
_decl("loom_model_set_optimizer", i32, vp, P(OptimizerConfig))
_decl("loom_sched_config_default", SchedConfig)
_decl("loom_model_set_lr_scheduler", i32, vp, P(SchedConfig))
_decl("loom_model_forward_backward", i32, vp, P(Batch), i64, P(FBResult))
_decl("loom_model_forward_only", i32, vp, P(Batch), i64, P(C.c_float), P(C.c_float),
      P(C.c_float), P(FBResult))
_decl("loom_model_clip_grad_and_step", i32, vp, f64, i64, P(StepResult))
_decl("loom_model_zero_grad", None, vp)
_decl("loom_model_expert_tokens", i32, vp, P(C.c_double), i64)
_decl("loom_model_profile", None, vp, cp, C.c_size_t)
_decl("loom_model_profile_interval", None, vp, P(StepBreakdown))
_decl("loom_model_tensor_name", cp, vp, i64, P(i32), P(i64))
_decl("loom_model_get_param", i32, vp, cp, P(C.c_float), i64)
_decl("loom_model_get_grad", i32, vp, cp, P(C.c_float), i64)
_decl("loom_model_add_adapter", i32, vp, cp, P(LoraConfig_))
_decl("loom_model_load_adapter", i32, vp, cp, cp)
_decl("loom_model_save_adapter", i32, vp, cp, cp, i32)
_decl("loom_model_set_adapter", i32, vp, cp)
_decl("loom_model_merge_adapter", i32, vp, cp)
_decl("loom_model_unmerge_adapter", i32, vp, cp)
_decl("loom_model_adapter_tensor", cp, vp, cp, i64, C.c_char_p, C.c_size_t, P(i64))
_decl("loom_model_save_hf", i32, vp, cp, i32, u64)
_decl("loom_encoder_create", i32, vp, cp, P(vp))
_decl("loom_encoder_free", None, vp)
_decl("loom_encoder_encode", i32, vp, vp, cp, C.c_size_t, i32, P(P(C.c_int32)),
      P(P(C.c_uint8)), P(i64))
_decl("loom_encoder_decode", i32, vp, vp, P(C.c_int32), i64, P(vp))
_decl("loom_encoder_vocab_size", i64, vp)
_decl("loom_encoder_eos_id", C.c_int32, vp)
_decl("loom_encoder_chat_error", cp, vp)
_decl("loom_free", None, vp)


def features():
    return lib.loom_features().decode().split()


def version():
    return lib.loom_version().decode()


class Context:
    """A loom_ctx: where the library's last error text lives."""

    def __init__(self):
        h = vp()
        st = lib.loom_ctx_create(C.byref(h))
        if st:
            raise MemoryError("loom: cannot create a context")
        self.h = h

    def check(self, st, what=None):
        """Raises the LoomError subclass of a failed status with loom's message."""
        if st:
            msg = lib.loom_last_error(self.h)
            msg = msg.decode(errors="replace") if msg else lib.loom_status_str(st).decode()
            lib.loom_clear_error(self.h)
            raise error_for(st)(("%s: %s" % (what, msg)) if what else msg, status=st)

    def close(self):
        if self.h:
            lib.loom_ctx_free(self.h)
            self.h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def i32_ptr(a):
    return a.ctypes.data_as(P(C.c_int32)) if a is not None else None


def f32_ptr(a):
    return a.ctypes.data_as(P(C.c_float)) if a is not None else None
