"""The CUDA side of the ops: variant selection per (op, device) through hmoe.dispatch, and the
per-device lazy work of a family module (load, bind to torch, shared-memory limits), done on the
first eager call or by hmoe.prewarm(), and refused inside CUDA-graph capture. What an op consults
on every call is a dict lookup here (no locks, no environment copies, no stream objects)."""
from __future__ import annotations

import threading

from .. import _env, _native, dispatch, validation as V

_lock = threading.Lock()
_warm: set = set()        # (device index, module name) prewarmed
_selections: dict = {}
_modules: dict = {}       # module name -> bound module
_sms: dict = {}           # device index -> SM count


def cuda_index(t) -> int:
    """The CUDA ordinal of a plain CUDA tensor, -1 for anything else (CPU tensors, subclasses,
    non-tensors: the op's checks then say what is wrong)."""
    return t.get_device() if type(t) in V.plain_types() and t.is_cuda else -1


def device_index(torch, device) -> int:
    """The ordinal of a CUDA torch.device; "cuda" without one is torch's current device, or 0 when this
    torch has no CUDA (torch.cuda.current_device() would fail with a bare AssertionError: the selection
    for device 0 then says what is missing)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def ordinal(device) -> int:
    """A CUDA device given as an int ordinal, "cuda", "cuda:N" or a torch.device, as its ordinal (the
    public functions that take a device: mla.route, mla.plan, prefill.plan)."""
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    torch = V.torch_module()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type != "cuda":
        raise ValueError(f"expected a CUDA device (an int ordinal, 'cuda:N' or a torch.device), got {device!r}")
    return device_index(torch, dev)


def sm_count(index: int) -> int:
    """The SMs of cuda:<index> (of its MIG slice under MIG), as torch sees them; cached."""
    n = _sms.get(index)
    if n is None:
        n = _sms[index] = V.torch_module().cuda.get_device_properties(index).multi_processor_count
    return n


def capturing(torch, index: int) -> bool:
    """Whether the current stream of cuda:<index> is capturing a CUDA graph."""
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()


def select(op: str, index: int, variant: str | None = None, *, own: bool = False) -> dispatch.Selection:
    """The variant `op` runs on cuda:<index> (forced by `variant` or HMOE_CUDA_VARIANT); the
    same decision hmoe.compat reports. own=True: hmoe's own family, whatever HMOE_CUDA_VARIANT
    says (the module that checks the arguments of a call a flashinfer backend runs). Raises when
    the device cannot run any."""
    key = (op, index, variant, None if own else _env.get("HMOE_CUDA_VARIANT"))
    sel = _selections.get(key)
    if sel is None:
        sel = dispatch.select_gpu_for_device(op, index, variant=variant, use_env=not own)
        with _lock:
            _selections[key] = sel
    return sel


def prewarm(index: int, module_name: str) -> None:
    """Load and bind `module_name` and set its kernels' shared-memory limits on cuda:<index>, so
    that later calls, including under CUDA-graph capture, do no lazy work."""
    if (index, module_name) in _warm:
        return
    _native.bind(module_name).prewarm(index)
    with _lock:
        _warm.add((index, module_name))


def module(index: int, op: str, variant: str | None = None, sel: dispatch.Selection | None = None):
    """The module of op's selected variant (`sel` when the caller has it), prewarmed on
    cuda:<index>; a first use inside graph capture is an error."""
    sel = sel or select(op, index, variant)
    if (index, sel.module) not in _warm:
        torch = V.torch_module()
        if capturing(torch, index):
            raise RuntimeError(f"{op}: first use on cuda:{index} inside CUDA-graph capture; its "
                               "lazy setup (module load, shared-memory limits) would break the "
                               "capture. Call hmoe.prewarm() or run the op once eagerly first")
        prewarm(index, sel.module)
    mod = _modules.get(sel.module)
    if mod is None:
        mod = _modules[sel.module] = _native.bind(sel.module)
    return mod
