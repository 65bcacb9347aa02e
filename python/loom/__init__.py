"""loom: distributed LLM training in C, with Twinkle's MegatronModel API.

    from loom import MegatronModel, DeviceMesh, DataLoader

The same script runs under mpirun / torchrun / srun (every rank runs it) or,
after loom.init(mode='ray'), from one driver process that drives a group of
Ray actors (MegatronModel(..., remote_group='actor')).
"""
from .errors import (LoomError, InvalidArgumentError, LoomIOError, FormatError, ConfigError,
                     UnsupportedError, ShapeError, NotFoundError, OutOfMemoryError, DeviceError,
                     CommError, MeshError, InternalError)
from .mesh import DeviceMesh
from .lora import LoraConfig
from .data import DataLoader, write_tokens
from .model import MegatronModel

__all__ = ["MegatronModel", "DeviceMesh", "DataLoader", "LoraConfig", "LoomError",
           "InvalidArgumentError", "LoomIOError", "FormatError", "ConfigError",
           "UnsupportedError", "ShapeError", "NotFoundError", "OutOfMemoryError", "DeviceError",
           "CommError", "MeshError", "InternalError", "init", "write_tokens", "__version__"]

__version__ = "0.1.0"


def init(mode="spmd", **kwargs):
    """mode='spmd' (default: every rank runs the script; nothing to do) or
    'ray': connect to (address=...) or start a Ray cluster for remote groups."""
    if mode in ("spmd", "local", None):
        return None
    if mode == "ray":
        from .ray_group import init_ray
        return init_ray(**kwargs)
    raise InvalidArgumentError("loom.init: mode=%r; use 'spmd' or 'ray'" % (mode,))
