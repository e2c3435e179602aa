"""The CUDA side of the ops: variant selection per (op, device) through hmoe.dispatch, and the
per-device lazy work of the CUDA module (load, shared-memory limits), done on the first eager
call or by hmoe.prewarm(), and refused inside CUDA-graph capture. Everything an op consults on
every call is a dict lookup here (no locks, no environment copies, no stream objects)."""
from __future__ import annotations

import threading

from .. import _env, dispatch
from .._native import load
from .._native.signatures import CUDA_OPS

_lock = threading.Lock()
_warm_devices: set[int] = set()
_selections: dict = {}
_modules: dict = {}  # module name -> loaded module
_raw_stream = None


def device_index(torch, device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def stream_handle(torch, index: int) -> int:
    """cuda:<index>'s current stream as the integer the bindings take (a cudaStream_t)."""
    global _raw_stream
    if _raw_stream is None:
        # torch's own accessor of the raw handle (what its C++ extensions use) skips building a
        # Stream object: ~0.2 us instead of ~3 us a call.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)
    return _raw_stream(index)


def capturing(torch, index: int) -> bool:
    """Whether the current stream of cuda:<index> is capturing a CUDA graph."""
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()


def select(op: str, index: int, variant: str | None = None) -> dispatch.Selection:
    """The variant `op` runs on cuda:<index> (forced by `variant` or HMOE_CUDA_VARIANT); the
    same decision hmoe.compat reports. Raises when the device cannot run any."""
    key = (op, index, variant, _env.get("HMOE_CUDA_VARIANT"))
    sel = _selections.get(key)
    if sel is None:
        sel = dispatch.select_gpu_for_device(op, CUDA_OPS, index, variant=variant)
        with _lock:
            _selections[key] = sel
    return sel


def prewarm(index: int) -> None:
    """Load the CUDA module on cuda:<index> and set its kernels' shared-memory limits, so that
    later calls, including under CUDA-graph capture, do no lazy work."""
    with _lock:
        if index in _warm_devices:
            return
    sel = select("mla_decode", index)
    if not sel.module:  # a flashinfer variant serves mla_decode; hmoe's module still serves grouped_topk
        sel = select("grouped_topk", index)
    load(sel.module, CUDA_OPS).prewarm(index)
    with _lock:
        _warm_devices.add(index)


def module(torch, index: int, op: str, variant: str | None = None, sel: dispatch.Selection | None = None):
    """The module of op's selected variant (`sel` when the caller has it), prewarmed on
    cuda:<index>; a first use inside graph capture is an error."""
    sel = sel or select(op, index, variant)
    if index not in _warm_devices:
        if capturing(torch, index):
            raise RuntimeError(f"{op}: first use on cuda:{index} inside CUDA-graph capture; its "
                               "lazy setup (module load, shared-memory limits) would break the "
                               "capture. Call hmoe.prewarm() or run the op once eagerly first")
        prewarm(index)
    mod = _modules.get(sel.module)
    if mod is None:
        mod = _modules[sel.module] = load(sel.module, CUDA_OPS)
    return mod
