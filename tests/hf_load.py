"""A Hugging Face checkpoint as transformers' model in float64, for the
export checks (hf_check.py, peft_check.py)."""
import torch
from transformers import AutoModelForCausalLM


def load_f64(path):
    """The model in float64. transformers 5 runs MoE experts through
    torch._grouped_mm, which takes no float64: its eager experts instead
    (older versions know no experts_implementation)."""
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                    experts_implementation="eager")
    except TypeError:
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
