"""LoRA configurations: loom.LoraConfig, or a peft.LoraConfig, a dict or a
PEFT adapter directory, turned into what loom_model_add_adapter takes."""
import os
from dataclasses import dataclass, field

from .errors import InvalidArgumentError, UnsupportedError

# Target modules are the linears of loom's layer kinds (q_proj, ..., down_proj
# for attention and the dense MLP): the library checks the names against the
# model's layers (ConfigError naming the ones it knows).
# PEFT's default targets for the decoder families loom loads (target_modules=None)
_PEFT_DEFAULT = "q_proj,v_proj"


@dataclass
class LoraConfig:
    """PEFT's LoraConfig fields that loom implements (PEFT's defaults)."""
    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: object = None  # None: PEFT's default (q_proj, v_proj); 'all-linear'; a list
    use_rslora: bool = False
    seed: object = None  # None: the model's seed (MegatronModel's seed=, default 42)
    extra: dict = field(default_factory=dict, repr=False)


_ACCEPTED = {"r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "seed"}
# PEFT fields that are fine at these values (their defaults), refused otherwise
_NEUTRAL = {"bias": "none", "modules_to_save": None, "use_dora": False, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False,
            "init_lora_weights": True, "exclude_modules": None, "target_parameters": None,
            "trainable_token_indices": None, "layer_replication": None, "loftq_config": {},
            "megatron_config": None, "use_qalora": False, "lora_bias": False}
_IGNORED = {"task_type", "peft_type", "inference_mode", "base_model_name_or_path", "revision",
            "auto_mapping", "megatron_core", "runtime_config", "qalora_group_size",
            "eva_config", "corda_config", "alora_invocation_tokens", "arrow_config",
            "ensure_weight_tying", "lora_ga_config", "peft_version"}


def _targets(t):
    if t is None:
        return _PEFT_DEFAULT
    if isinstance(t, str):
        if t == "all-linear":
            return t
        t = [t]
    try:
        t = list(t)
    except TypeError:
        raise InvalidArgumentError("LoRA target_modules=%r: give 'all-linear' or a list of module "
                                   "names such as q_proj, v_proj" % (t,))
    for m in t:
        if not isinstance(m, str) or not m or "," in m or m == "all-linear":
            raise InvalidArgumentError("LoRA target_modules: %r is not a module name (give "
                                       "'all-linear' or a list such as ['q_proj', 'v_proj'])"
                                       % (m,))
    return ",".join(t)


def normalize(config):
    """A dict {r, lora_alpha, lora_dropout, target_modules (str), use_rslora,
    seed}, or {'dir': path} for a PEFT adapter directory."""
    if isinstance(config, (str, os.PathLike)):
        d = os.fspath(config)
        if not os.path.isfile(os.path.join(d, "adapter_config.json")):
            raise InvalidArgumentError("LoRA adapter %r: no adapter_config.json there; give a "
                                       "PEFT adapter directory or a LoraConfig" % d)
        return {"dir": d}
    peft_config = False
    if isinstance(config, LoraConfig):
        fields = {k: getattr(config, k) for k in _ACCEPTED}
        fields.update(config.extra)
    elif isinstance(config, dict):
        fields = dict(config)
    elif hasattr(config, "to_dict") and hasattr(config, "r"):  # peft.LoraConfig
        fields = config.to_dict()
        peft_config = True
    else:
        raise InvalidArgumentError("add_adapter_to_model: config must be a loom.LoraConfig, a "
                                   "peft.LoraConfig, a dict or a PEFT directory, not %s"
                                   % type(config).__name__)
    out = {"r": 8, "lora_alpha": None, "lora_dropout": 0.0, "target_modules": None,
           "use_rslora": False, "seed": None}
    for k, v in fields.items():
        if k in _ACCEPTED:
            out[k] = v
        elif k in _IGNORED:
            continue
        elif k in _NEUTRAL:
            if v not in (_NEUTRAL[k], None) and not (isinstance(v, (dict, list)) and not v) \
                    and not (k == "init_lora_weights" and v is True):
                raise UnsupportedError("LoRA %s=%r is not implemented by loom (only %r)"
                                       % (k, v, _NEUTRAL[k]))
        elif peft_config:
            # a field of a newer PEFT: harmless at its default, refused otherwise
            if v not in (None, False, "none", "", 0) and not (isinstance(v, (dict, list, set))
                                                             and not v):
                raise UnsupportedError("LoRA %s=%r (a peft.LoraConfig field) is not implemented "
                                       "by loom" % (k, v))
        else:
            import difflib
            near = difflib.get_close_matches(k, sorted(_ACCEPTED), 1)
            raise InvalidArgumentError("LoRA config: unknown field %r%s; loom takes %s"
                                       % (k, " (did you mean %r?)" % near[0] if near else "",
                                          ", ".join(sorted(_ACCEPTED))))
    r = out["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InvalidArgumentError("LoRA r=%r must be an int >= 1" % (r,))
    alpha = out["lora_alpha"]
    alpha = float(r if alpha is None else alpha)
    drop = float(out["lora_dropout"] or 0.0)
    if not 0.0 <= drop < 1.0:
        raise InvalidArgumentError("LoRA lora_dropout=%r must lie in [0, 1)" % drop)
    return {"r": r, "lora_alpha": alpha, "lora_dropout": drop,
            "target_modules": _targets(out["target_modules"]),
            "use_rslora": bool(out["use_rslora"]),
            "seed": None if out["seed"] is None else int(out["seed"])}
