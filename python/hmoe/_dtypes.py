"""torch dtype -> native dtype code (the codes of include/hmoe/constants.h)."""
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
