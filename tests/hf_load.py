"""A Hugging Face checkpoint as transformers' model in float64, for the
export checks (hf_check.py, peft_check.py)."""
import json
import os

import torch
from transformers import AutoModelForCausalLM


def model_class(path):
    """AutoModelForCausalLM, or for a vision-language checkpoint (a config
    with text_config: Qwen3.5's hub layout) the image-text-to-text class,
    which reads its tensors under model.language_model. as they are."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    if "text_config" in cfg:
        from transformers import AutoModelForImageTextToText
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_f64(path):
    """The model in float64. transformers 5 runs MoE experts through
    torch._grouped_mm, which takes no float64: its eager experts instead
    (older versions know no experts_implementation)."""
    cls = model_class(path)
    try:
        return cls.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    except TypeError:
        return cls.from_pretrained(path, torch_dtype=torch.float64)
