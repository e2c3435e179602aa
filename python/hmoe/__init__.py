"""hmoe: hybrid MoE kernels (CUDA attention per SM target, CPU experts per ISA) with
hardware-aware dispatch. Importing hmoe loads no native module and creates no CUDA context."""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "build_info": ("hmoe._build_info", "build_info"),
    "CPUExperts": ("hmoe.nn.experts", "CPUExperts"),
    "nn": ("hmoe.nn", None),
    "load_experts": ("hmoe.checkpoint", "load_experts"),
    "set_num_threads": ("hmoe._threads", "set_num_threads"),
    "get_num_threads": ("hmoe._threads", "get_num_threads"),
    "ops": ("hmoe.ops", None),
    "quant": ("hmoe.quant", None),
    "prewarm": ("hmoe._prewarm", "prewarm"),
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'hmoe' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(target[0])
    value = mod if target[1] is None else getattr(mod, target[1])
    globals()[name] = value
    return value


def __dir__():
    return __all__
