"""Argument checks run before any pointer crosses into native code; errors name the argument."""
from __future__ import annotations


def torch_module():
    try:
        import torch
    except ImportError as e:  # torch is needed for tensor ops, not for import hmoe
        raise ImportError("hmoe's ops take torch tensors: install torch first "
                          "(pip install torch)") from e
    return torch


def tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device: str | None = None,
           contiguous: bool = True):
    """Checks that `t` is a torch.Tensor of the given rank, dtype set, device type and layout."""
    torch = torch_module()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device.type != device:
        raise ValueError(f"{name} must be on the {device.upper()}, got device {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it first)")
    return t


def dim(name: str, t, axis: int, expected: int, what: str) -> None:
    if t.shape[axis] != expected:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: dimension {axis} must be {what} = {expected}")


def index_range(name: str, ids, upper: int) -> None:
    """All of `ids` in [0, upper)."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds {bad}, outside [0, {upper})")


def float_dtypes():
    torch = torch_module()
    return (torch.float32, torch.float16, torch.bfloat16)
