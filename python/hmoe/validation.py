"""Python's side of argument checking. The ops' tensors are checked by the native entry points
(cpp/bind/tensors.h: a plain strided tensor with storage, no lazy negation, the expected rank,
dtype, device and layout); tensor() here runs that same native checker for the few tensors Python
itself must vet, so the rules exist once."""
from __future__ import annotations

import numbers

_torch = None
_PLAIN: tuple = ()
_WHERE = {None: 0, "cpu": 1, "cuda": 2, ("cpu", "cuda"): 3}


def is_int(x) -> bool:
    """A whole number as hmoe's int arguments take it: an int or a numpy integer, never a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def torch_module():
    global _torch, _PLAIN
    if _torch is None:
        try:
            import torch
        except ImportError as e:  # torch is needed for tensor ops, not for import hmoe
            raise ImportError("hmoe's ops take torch tensors: install torch first "
                              "(pip install torch)") from e
        _PLAIN = (torch.Tensor, torch.nn.Parameter)
        _torch = torch
    return _torch


def plain_types() -> tuple:
    """The tensor types hmoe's kernels accept (no subclass: its memory may not hold its values)."""
    if not _PLAIN:
        torch_module()
    return _PLAIN


def tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None, contiguous: bool = True):
    """Checks `t` as the native entry points check their tensors: plain, with storage, `ndim`
    dimensions, a dtype in `dtypes`, on `device` ("cpu", "cuda" or both as a tuple), contiguous
    unless told otherwise. TypeError or ValueError naming `name`; returns t."""
    from . import _dtypes, _native

    mask = sum(1 << _dtypes.code(d) for d in dtypes) if dtypes is not None else (1 << 32) - 1
    where = _WHERE[tuple(device) if isinstance(device, (tuple, list)) else device]
    _native.bind("cpu_core").check_tensor(t, name, mask, -1 if ndim is None else ndim, where, contiguous)
    return t


_DTYPE_SETS: dict = {}


def _dtype_set(name: str, names) -> tuple:
    got = _DTYPE_SETS.get(name)
    if got is None:
        torch = torch_module()
        got = _DTYPE_SETS[name] = tuple(getattr(torch, n) for n in names)
    return got


def float_dtypes() -> tuple:
    return _dtype_set("float", ("float32", "float16", "bfloat16"))


def half_dtypes() -> tuple:
    return _dtype_set("half", ("bfloat16", "float16"))
