"""CPU experts on a CUDA stream: pinned staging buffers and a host job that the stream runs.

For hidden states on a GPU, HybridMoE enqueues on one stream: copies of x, topk_ids and
topk_weights into pinned host buffers, a host function that runs the CPU experts over those buffers
(the experts module's native run_job, entered with no Python and no GIL), and the copy of the result
back. Everything is stream-ordered, so the same sequence runs eagerly (overlapping the GPU work on
other streams) and inside a captured CUDA graph, where replay runs the experts on the CPU with the
routing of the current step.

The host buffers are registered with cudaHostRegister (not taken from torch's pinned-memory cache,
whose per-copy event bookkeeping has no place in a graph); cudaLaunchHostFunc and the registration
come from the CUDA runtime torch already loaded.
"""
from __future__ import annotations

import ctypes
import threading

_lock = threading.Lock()
_cudart = None


def cudart():
    """The CUDA runtime library torch loaded (found in /proc/self/maps), through ctypes."""
    global _cudart
    if _cudart is not None:
        return _cudart
    with _lock:
        if _cudart is None:
            lib = None
            try:
                with open("/proc/self/maps") as f:
                    paths = {line.split()[-1] for line in f if "libcudart.so" in line}
                for path in sorted(paths):
                    lib = ctypes.CDLL(path)
                    break
            except OSError:
                pass
            for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
                if lib is not None:
                    break
                try:
                    lib = ctypes.CDLL(name)
                except OSError:
                    continue
            if lib is None:
                raise RuntimeError("hmoe: CPU experts on a CUDA stream need the CUDA runtime library "
                                   "(libcudart), which torch did not load: is this a CUDA build of torch?")
            lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.cudaLaunchHostFunc.restype = ctypes.c_int
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostRegister.restype = ctypes.c_int
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cudaHostUnregister.restype = ctypes.c_int
            lib.cudaGetErrorString.argtypes = [ctypes.c_int]
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            _cudart = lib
    return _cudart


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = cudart().cudaGetErrorString(rc).decode(errors="replace")
        raise RuntimeError(f"hmoe: {what} failed: CUDA error {rc} ({msg})")


_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class PinnedBuffer:
    """A CPU tensor registered as pinned memory for as long as this object lives."""

    def __init__(self, torch, shape, dtype):
        self.tensor = torch.empty(shape, dtype=dtype)
        nbytes = self.tensor.numel() * self.tensor.element_size()
        self._ptr = self.tensor.data_ptr()
        self._registered = False
        if nbytes:
            _check(cudart().cudaHostRegister(self._ptr, nbytes, _PORTABLE), "cudaHostRegister")
            self._registered = True

    def __del__(self):
        if getattr(self, "_registered", False):
            cudart().cudaHostUnregister(self._ptr)
            self._registered = False


class HostJob:
    """The CPU experts over fixed pinned buffers, enqueued on a CUDA stream by launch()."""

    def __init__(self, experts, torch, tokens: int, top_k: int, dtype, device):
        from .._threads import get_num_threads

        self.tokens, self.top_k, self.dtype, self.device = tokens, top_k, dtype, device
        H = experts.hidden_size
        # One pinned input buffer (x, then ids, then weights: every part a multiple of 4 bytes), so
        # that a step copies its inputs in one transfer after one small gather on the GPU.
        es = torch.empty(0, dtype=dtype).element_size()
        nx, nk = tokens * H * es, tokens * top_k * 4
        self.inputs = PinnedBuffer(torch, (nx + 2 * nk,), torch.uint8)
        raw = self.inputs.tensor
        self.x = raw[:nx].view(dtype).view(tokens, H)
        self.ids = raw[nx:nx + nk].view(torch.int32).view(tokens, top_k)
        self.weights = raw[nx + nk:].view(torch.float32).view(tokens, top_k)
        self.out = PinnedBuffer(torch, (tokens, H), dtype)
        self._mod = experts._mod
        self._experts = experts  # keeps the packed weights alive
        self._fn, self._job = self._mod.host_job_create(
            self.x, self.ids, self.weights, experts._w13, experts._w2, *experts._dims, self.out.tensor,
            get_num_threads())

    def launch(self, x, ids, weights, out, stream) -> None:
        """On `stream`: copy x [T, H], ids [T, K] (int32) and weights [T, K] (fp32) from the GPU into
        the pinned buffers, run the experts on the CPU, copy the result into out [T, H] on the GPU."""
        import torch

        with stream_context(stream):
            packed = torch.cat([x.reshape(-1).view(torch.uint8), ids.to(torch.int32).reshape(-1).view(torch.uint8),
                                weights.to(torch.float32).reshape(-1).view(torch.uint8)])
            self.inputs.tensor.copy_(packed, non_blocking=True)
            _check(cudart().cudaLaunchHostFunc(stream.cuda_stream, self._fn, self._job), "cudaLaunchHostFunc")
            out.copy_(self.out.tensor, non_blocking=True)
            if not _capturing():
                self._done = _event(stream)

    def error(self) -> str:
        """The error of the last failed run ('' if none), cleared by reading it."""
        return self._mod.host_job_error(self._job)

    def times(self) -> list[float]:
        """Wall times (us) of the runs since the last read, oldest first (at most the last 1024)."""
        return self._mod.host_job_times(self._job)

    def __del__(self):
        job = getattr(self, "_job", None)
        if job:
            done = getattr(self, "_done", None)
            if done is not None:
                done.synchronize()  # an eager run still queued must not find the job freed
            self._mod.host_job_free(job)
            self._job = None


def stream_context(stream):
    import torch

    return torch.cuda.stream(stream)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


def _event(stream):
    import torch

    ev = torch.cuda.Event()
    ev.record(stream)
    return ev
