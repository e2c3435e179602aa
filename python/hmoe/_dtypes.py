"""torch dtype <-> native dtype code (must match cpp/common/dtype.h)."""
from __future__ import annotations

F32, F16, BF16, I32, I64 = 0, 1, 2, 3, 4

_CODES: dict = {}


def code(dtype) -> int:
    try:
        return _CODES[dtype]
    except KeyError:
        pass
    import torch

    _CODES.update({torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16,
                   torch.int32: I32, torch.int64: I64})
    try:
        return _CODES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no native code") from None
