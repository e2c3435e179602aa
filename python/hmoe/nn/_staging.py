"""CPU experts on a CUDA stream: pinned staging buffers and a host job that the stream runs.

For hidden states on a GPU, HybridMoE enqueues on one stream: a gather of x, topk_ids and
topk_weights into a pinned host buffer mapped into the GPU's address space, the hand-over to the CPU
experts (the experts module's native run_job over those buffers, entered with no Python and no GIL),
and then reads the result from a mapped pinned buffer on the main stream (zero-copy both ways).
Everything is stream-ordered, so the same sequence runs eagerly (overlapping the GPU work on other
streams) and inside a captured CUDA graph, where replay runs the experts on the CPU with the routing
of the current step.

Two hand-overs (HMOE_CPU_HANDOVER, read at each launch):
  doorbell (default): the stream writes a ready word in mapped pinned memory (cuStreamWriteValue32),
      the experts module's doorbell thread, polling it, runs the job and writes a done word, which
      the stream waits for (cuStreamWaitValue32) before the result is read (cpp/common/doorbell.h);
  host_func: a host function (cudaLaunchHostFunc) runs the job on the driver's callback thread, at
      the cost of two thread wake-ups per call.

The host buffers are registered with cudaHostRegister (not taken from torch's pinned-memory cache,
whose per-copy event bookkeeping has no place in a graph); the runtime calls come from the CUDA
runtime torch already loaded, the stream memory operations from the driver (libcuda).
"""
from __future__ import annotations

import ctypes
import threading

from .. import _env

_lock = threading.Lock()
_cudart = None
_driver = None
HANDOVERS = ("doorbell", "host_func")


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
            lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
            lib.cudaHostGetDevicePointer.restype = ctypes.c_int
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cudaHostUnregister.restype = ctypes.c_int
            lib.cudaGetErrorString.argtypes = [ctypes.c_int]
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            _cudart = lib
    return _cudart


def driver():
    """The stream memory operations of the CUDA driver (libcuda, which torch loaded), through ctypes:
    (write_value32, wait_value32), each (stream, device pointer, value, flags) -> CUresult."""
    global _driver
    if _driver is not None:
        return _driver
    with _lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise RuntimeError(f"hmoe: the doorbell hand-over needs the CUDA driver library (libcuda.so.1): {e}; "
                                   "HMOE_CPU_HANDOVER=host_func uses host functions instead") from None
            fns = []
            for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
                fn = getattr(lib, name + "_v2", None) or getattr(lib, name, None)
                if fn is None:
                    raise RuntimeError(f"hmoe: this CUDA driver has no {name}: HMOE_CPU_HANDOVER=host_func uses "
                                       "host functions instead")
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                fn.restype = ctypes.c_int
                fns.append(fn)
            _driver = tuple(fns)
    return _driver


def handover() -> str:
    """The hand-over the next launch uses: HMOE_CPU_HANDOVER, default "doorbell"."""
    mode = _env.get("HMOE_CPU_HANDOVER") or "doorbell"
    if mode not in HANDOVERS:
        raise ValueError(f"HMOE_CPU_HANDOVER must be one of {', '.join(HANDOVERS)}, got {mode!r}")
    return mode


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = cudart().cudaGetErrorString(rc).decode(errors="replace")
        raise RuntimeError(f"hmoe: {what} failed: CUDA error {rc} ({msg})")


def _check_driver(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"hmoe: {what} failed: CUresult {rc} (HMOE_CPU_HANDOVER=host_func uses host functions "
                           "instead of the doorbell)")


_PORTABLE, _MAPPED = 1, 2  # cudaHostRegisterPortable (pinned for every CUDA context), cudaHostRegisterMapped
_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ


class PinnedBuffer:
    """A CPU tensor registered as pinned memory for as long as this object lives; with mapped=True
    also mapped into the GPUs' address space (device_ptr), for the stream memory operations."""

    def __init__(self, torch, shape, dtype, mapped: bool = False):
        self.tensor = torch.zeros(shape, dtype=dtype) if mapped else torch.empty(shape, dtype=dtype)
        nbytes = self.tensor.numel() * self.tensor.element_size()
        self._ptr = self.tensor.data_ptr()
        self._registered = False
        self.device_ptr = None
        if nbytes:
            flags = _PORTABLE | (_MAPPED if mapped else 0)
            _check(cudart().cudaHostRegister(self._ptr, nbytes, flags), "cudaHostRegister")
            self._registered = True
            if mapped:
                dptr = ctypes.c_void_p()
                _check(cudart().cudaHostGetDevicePointer(ctypes.byref(dptr), ctypes.c_void_p(self._ptr), 0),
                       "cudaHostGetDevicePointer")
                self.device_ptr = dptr.value

    def __del__(self):
        if getattr(self, "_registered", False):
            cudart().cudaHostUnregister(self._ptr)
            self._registered = False


class _Mapped:
    """A mapped pinned buffer described by __cuda_array_interface__, for torch.as_tensor."""

    def __init__(self, device_ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (device_ptr, False),
                                         "strides": None, "version": 3}


def gpu_view(torch, buf: PinnedBuffer, dtype, shape):
    """buf's memory as a CUDA tensor of `dtype` and `shape` on the device current when buf was registered:
    no copy, the GPU's loads and stores go to host memory (zero-copy)."""
    nbytes = buf.tensor.numel() * buf.tensor.element_size()
    raw = torch.as_tensor(_Mapped(buf.device_ptr, nbytes))
    if raw.device.type != "cuda" or raw.data_ptr() != buf.device_ptr:
        raise RuntimeError(f"hmoe: torch did not view mapped pinned memory in place (got {raw.device}); "
                           "the CPU experts' staging needs it")
    return raw.view(dtype).view(shape)


class HostJob:
    """The CPU experts over fixed pinned buffers, enqueued on a CUDA stream by launch().

    The buffers are mapped into the GPU's address space: the GPU gathers the inputs straight into host
    memory and reads the result from there (zero-copy: a few kilobytes a token, against a copy node
    and its scheduling on the stream each way)."""

    def __init__(self, experts, torch, tokens: int, top_k: int, dtype, device):
        from .._threads import get_num_threads

        self.tokens, self.top_k, self.dtype, self.device = tokens, top_k, dtype, device
        self._torch = torch  # for __del__, which may run while the interpreter shuts down
        H = experts.hidden_size
        # One input buffer (x, then ids, then weights: every part a multiple of 4 bytes), written by
        # one gather on the GPU.
        es = torch.empty(0, dtype=dtype).element_size()
        nx, nk = tokens * H * es, tokens * top_k * 4
        with torch.cuda.device(device):  # the views below live on this device
            self.inputs = PinnedBuffer(torch, (nx + 2 * nk,), torch.uint8, mapped=True)
            self.out = PinnedBuffer(torch, (tokens, H), dtype, mapped=True)
            self._inputs_gpu = gpu_view(torch, self.inputs, torch.uint8, (nx + 2 * nk,))
            self._out_gpu = gpu_view(torch, self.out, dtype, (tokens, H))
        raw = self.inputs.tensor
        self.x = raw[:nx].view(dtype).view(tokens, H)
        self.ids = raw[nx:nx + nk].view(torch.int32).view(tokens, top_k)
        self.weights = raw[nx + nk:].view(torch.float32).view(tokens, top_k)
        self._mod = experts._mod
        self._experts = experts  # keeps the packed weights alive
        self._fn, self._job = self._mod.host_job_create(
            self.x, self.ids, self.weights, experts._w13, experts._w2, *experts._dims, self.out.tensor,
            get_num_threads())
        self._flags = None  # the doorbell's words, made on the first doorbell launch
        self.captured = False  # a CUDA graph holds a launch of this job: it must live as long as the graph

    def _listen(self, torch):
        """The doorbell's words (ready = [0], done = [16]: a cache line apart), mapped pinned memory that
        this job's doorbell thread polls (cpp/common/doorbell.h)."""
        driver()  # the driver's stream memory operations exist, or a clear error before anything is set up
        flags = PinnedBuffer(torch, (32,), torch.int32, mapped=True)
        self._mod.host_job_listen(self._job, flags.tensor)
        self._flags = flags
        _listening.add(self._mod)

    def launch(self, x, ids, weights, stream):
        """On `stream`: gather x [T, H], ids [T, K] (int32) and weights [T, K] (fp32) from the GPU into the
        mapped input buffer, run the experts on the CPU; returns the result [T, H] as a CUDA view of the
        mapped output buffer, complete once `stream` has passed this point and valid until the next
        launch of this job: read it on a stream that waits for `stream`."""
        import torch

        mode = handover()
        capturing = _capturing()
        if mode == "doorbell" and self._flags is None:
            if capturing:
                raise RuntimeError("HybridMoE: the first doorbell launch of a batch size happens inside CUDA graph "
                                   "capture; run one eager step with the same hand-over before capturing")
            self._listen(torch)
        with stream_context(stream):
            torch.cat([x.reshape(-1).view(torch.uint8), ids.to(torch.int32).reshape(-1).view(torch.uint8),
                       weights.to(torch.float32).reshape(-1).view(torch.uint8)], out=self._inputs_gpu)
            s = stream.cuda_stream
            if mode == "doorbell":
                write, wait = driver()
                ready, done = self._flags.device_ptr, self._flags.device_ptr + 64
                if not capturing:
                    self._mod.host_job_wake()  # the doorbell thread polls busily from now
                # The write's default memory barrier orders it after the gather's stores to host memory.
                _check_driver(write(s, ready, 1, 0), "cuStreamWriteValue32")
                _check_driver(wait(s, done, 1, _WAIT_EQ), "cuStreamWaitValue32")
                _check_driver(write(s, done, 0, 0), "cuStreamWriteValue32")
            else:
                _check(cudart().cudaLaunchHostFunc(s, self._fn, self._job), "cudaLaunchHostFunc")
            if capturing:
                self.captured = True
            else:
                self._done = _event(stream)
        return self._out_gpu

    def error(self) -> str:
        """The error of the last failed run ('' if none), cleared by reading it."""
        return self._mod.host_job_error(self._job)

    def times(self) -> list[float]:
        """Wall times (us) of the runs since the last read, oldest first (at most the last 1024)."""
        return self._mod.host_job_times(self._job)

    def __del__(self):
        job = getattr(self, "_job", None)
        if job:
            if getattr(self, "_done", None) is not None:
                # An eager run still queued must not find the job freed, nor a kernel still reading its
                # result (on whatever stream) the buffer unregistered.
                self._torch.cuda.synchronize(self.device)
            self._mod.host_job_free(job)
            self._job = None


_listening: set = set()  # experts modules with a job on a doorbell


def wake() -> None:
    """Tells the doorbell threads that bells are about to ring (before replaying a CUDA graph whose steps
    run CPU experts): they poll busily from now instead of after their next idle sleep (up to 1 ms)."""
    for mod in tuple(_listening):
        mod.host_job_wake()


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
