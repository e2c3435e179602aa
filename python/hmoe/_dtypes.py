"""torch dtype -> native dtype code (the codes of include/hmoe/constants.h), and its name as messages give it."""
from __future__ import annotations

_CODES: dict = {}


def code(dtype) -> int:
    try:
        return _CODES[dtype]
    except KeyError:
        pass
    import torch

    from ._native import spec

    c = spec.constants()
    _CODES.update({getattr(torch, n): c[f"dtype_{n}"] for n in ("float32", "float16", "bfloat16", "int32", "int64",
                                                                "uint8")})
    try:
        return _CODES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no native code") from None


def name(dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).replace("torch.", "")
