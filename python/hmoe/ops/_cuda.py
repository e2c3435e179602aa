"""Per-device lazy work of the CUDA module (load, shared-memory limits), done on the first eager
call or by hmoe.prewarm(), and refused inside CUDA-graph capture."""
from __future__ import annotations

import threading

from .. import _arch, validation as V
from .._native import load
from .._native.signatures import CUDA_OPS

_warm_lock = threading.Lock()
_warm_devices: set[int] = set()


def device_index(torch, device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def check_device(index: int, op: str) -> None:
    torch = V.torch_module()
    cc = torch.cuda.get_device_capability(index)
    need = tuple(_arch.load("gpu")["min_compute_capability"])
    if tuple(cc) < need:
        raise RuntimeError(f"{op}: cuda:{index} has compute capability {cc[0]}.{cc[1]}; hmoe's "
                           f"CUDA kernels need >= {need[0]}.{need[1]}")


def prewarm(index: int, op: str = "prewarm") -> None:
    """Load cuda_ops' kernels on cuda:<index> and set their shared-memory limits, so that later
    calls, including under CUDA-graph capture, do no lazy work."""
    with _warm_lock:
        if index in _warm_devices:
            return
        check_device(index, op)
        load("cuda_ops", CUDA_OPS).prewarm(index)
        _warm_devices.add(index)


def module(torch, index: int, op: str):
    """cuda_ops, prewarmed on cuda:<index>; a first use inside graph capture is an error."""
    if index not in _warm_devices:
        with torch.cuda.device(index):
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            raise RuntimeError(f"{op}: first use on cuda:{index} inside CUDA-graph capture; its "
                               "lazy setup (module load, shared-memory limits) would break the "
                               "capture. Call hmoe.prewarm() or run the op once eagerly first")
        prewarm(index, op)
    return load("cuda_ops", CUDA_OPS)
