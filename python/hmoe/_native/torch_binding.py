"""What each native module is bound to before an op uses it (cpp/bind/tensors.h, bind_torch): torch's
DLPack C exchange API (torch 2.10 and newer), the tensor types hmoe accepts as plain, and a fallback
for older torch that serves the same three needs through torch's Python API, more slowly."""
from __future__ import annotations

import functools

from . import spec


class Fallback:
    """Without torch.Tensor.__dlpack_c_exchange_api__: a tensor's DLPack description, new tensors,
    and the current CUDA stream, from Python (microseconds instead of nanoseconds per tensor)."""

    def __init__(self, torch):
        self.torch = torch
        c = spec.constants()
        self.dtypes = {c[f"dtype_{n}"]: getattr(torch, n) for n in ("float32", "float16", "bfloat16", "int32",
                                                                   "int64", "uint8")}

    def dlpack(self, t):
        return self.torch.utils.dlpack.to_dlpack(t)  # a "dltensor" capsule; no stream synchronisation

    def empty(self, shape, dtype_code: int, device: int):
        dev = "cpu" if device < 0 else self.torch.device("cuda", device)
        return self.torch.empty(shape, dtype=self.dtypes[dtype_code], device=dev)

    def stream(self, device: int) -> int:
        return self.torch.cuda.current_stream(device).cuda_stream


@functools.lru_cache(maxsize=1)
def args() -> tuple:
    """(exchange API capsule or None, plain tensor types, fallback) for bind_torch."""
    from .. import validation

    torch = validation.torch_module()
    api = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    return api, (torch.Tensor, torch.nn.Parameter), Fallback(torch)
