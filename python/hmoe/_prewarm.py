"""hmoe.prewarm(): do every lazy step (module loads, CUDA shared-memory limits) ahead of time,
e.g. before CUDA-graph capture."""
from __future__ import annotations


def prewarm(device=None) -> None:
    """Loads the CPU experts module this machine selects and, for a CUDA device (default: the
    current one when CUDA is available), loads hmoe's CUDA modules on it (for mla_decode the
    selected family's and the portable one, which runs the shapes the other declines) and sets
    their kernels' shared-memory limits. Safe to call many times; a call inside graph capture is
    refused by the ops themselves, so call this before capturing. `device`: None, an int ordinal,
    a string like "cuda:1" or "cpu", or a torch.device."""
    from . import _arch, _native
    from .ops import experts as _experts

    _experts.module(_experts.select())
    _native.bind("cpu_core")
    from . import validation as V

    torch = V.torch_module()
    if device is None:
        if not torch.cuda.is_available():
            return
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"prewarm: unsupported device {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"prewarm: {device} asked for, but this torch sees no CUDA device (torch "
                           f"{torch.__version__}, CUDA {torch.version.cuda or 'not compiled in'})")
    from .ops import _cuda, mla

    index = _cuda.device_index(torch, device)
    for op in _arch.gpu_ops():
        _cuda.prewarm(index, _cuda.select(op, index, own=True).module)
    # mla_decode runs the shapes its selected family declines on the fallback family (mla.route)
    for module in mla.family_modules(index):
        _cuda.prewarm(index, module)
    sel = _cuda.select("mla_decode", index)
    if sel.backend:  # e.g. flashinfer: its JIT build and self-check, outside any graph capture
        from . import backends

        backends.warm(sel.variant, index)
