"""Argument checks run before any pointer crosses into native code; errors name the argument.

Every tensor an op hands to native code goes through tensor(): a plain strided tensor (torch.Tensor
or nn.Parameter, no subclass such as FakeTensor or a wrapper subclass), with storage, no pending
negation/conjugation, on the expected device, dtype, rank and layout. Every scalar that becomes a
fixed-width native argument goes through int_arg() or f32_arg(). Checks are ordered cheapest first
and cost about a microsecond per tensor: ops run them on every call."""
from __future__ import annotations

import math
import numbers

_torch = None
_PLAIN: tuple = ()
_F32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
INT32_MAX = 2 ** 31 - 1


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


def _not_plain(name: str, t, torch) -> TypeError:
    cls = type(t)
    if not isinstance(t, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor, got {cls.__name__}")
    what = f"{name} is a {cls.__module__}.{cls.__qualname__}, a torch.Tensor subclass"
    if "fake" in cls.__name__.lower() or "functional" in cls.__name__.lower():
        hint = ("it has no real data (tracing under torch.compile or FakeTensorMode?): call the op "
                "through torch.ops.hmoe, whose fake implementations handle tracing")
    else:
        hint = "pass a plain tensor with its own storage (e.g. t.as_subclass(torch.Tensor) where that is valid)"
    return TypeError(f"{what}: hmoe's kernels read tensor memory directly and take only plain "
                     f"strided tensors (torch.Tensor or nn.Parameter); {hint}")


def tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None,
           contiguous: bool = True):
    """Checks that `t` is a plain torch.Tensor (or nn.Parameter) with storage, of rank `ndim`, a
    dtype in `dtypes`, on a device of type `device` (a string or a tuple of them), strided,
    without a pending neg/conj bit, and contiguous unless told otherwise. Returns t."""
    torch = _torch or torch_module()
    if type(t) not in _PLAIN:
        raise _not_plain(name, t, torch)
    if t.layout is not torch.strided:
        raise TypeError(f"{name} has layout {t.layout}; hmoe's ops take dense (strided) tensors "
                        "(call .to_dense() first)")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if device is not None and not (t.is_cuda if device == "cuda" else t.is_cpu if device == "cpu"
                                   else t.device.type in device):
        kinds = (device,) if isinstance(device, str) else device
        where = " or ".join(k.upper() for k in kinds)
        raise ValueError(f"{name} must be on the {where}, got device {t.device}")
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{name} is a lazily negated/conjugated view; its memory does not hold its "
                         "values (call .resolve_neg() / .resolve_conj() first)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it first)")
    if not t.data_ptr() and t.numel():
        raise ValueError(f"{name} has no storage (data_ptr() is 0) although it holds {t.numel()} "
                         "elements")
    return t


def dim(name: str, t, axis: int, expected: int, what: str) -> None:
    if t.shape[axis] != expected:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: dimension {axis} must be {what} = {expected}")


def int_arg(name: str, value, lo: int = 0, hi: int = INT32_MAX) -> int:
    """An integer argument (not a bool) in [lo, hi]; the native side stores it in a fixed width."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value} is outside the supported range [{lo}, {hi}]")
    return value


def f32_arg(name: str, value) -> float:
    """A real, finite argument that the native side receives as fp32 (so it must not overflow it)."""
    if type(value) is float and -_F32_MAX <= value <= _F32_MAX:  # the usual case, NaN excluded
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or abs(value) > _F32_MAX:
        raise ValueError(f"{name} must be finite in float32 (|x| <= 3.4e38), got {value!r}")
    return value


def disjoint(out_name: str, out, inputs: dict) -> None:
    """`out` (contiguous) shares no byte with any of `inputs` (name -> contiguous tensor or None):
    a kernel writing it while reading them would read its own results."""
    if out.numel() == 0:
        return
    o0 = out.data_ptr()
    o1 = o0 + out.numel() * out.element_size()
    for name, t in inputs.items():
        if t is None or t.numel() == 0 or t.device != out.device:
            continue
        t0 = t.data_ptr()
        if t0 < o1 and o0 < t0 + t.numel() * t.element_size():
            raise ValueError(f"{out_name} overlaps {name} in memory; the kernel would overwrite its "
                             "own input: pass a separate output tensor")


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


def int_dtypes() -> tuple:
    return _dtype_set("int", ("int32", "int64"))


def f32_dtype() -> tuple:
    return _dtype_set("f32", ("float32",))


def i32_dtype() -> tuple:
    return _dtype_set("i32", ("int32",))
