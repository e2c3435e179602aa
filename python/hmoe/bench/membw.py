# Machine facts the benchmarks normalise against: CPU/GPU copy bandwidth, caches and flushing them, free memory, GPU matmul peak.
from __future__ import annotations

import os
import statistics
import time

from ..hardware.cpu import mem_available_bytes, mem_total_bytes  # noqa: F401 (the bench's machine facts)

GIB = 1 << 30


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


def llc_bytes() -> int:
    """Size of the largest (last-level) cache cpu0 sees; 32 MiB when sysfs does not say."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        for entry in os.listdir(base):
            if not entry.startswith("index"):
                continue
            try:
                with open(os.path.join(base, entry, "size")) as f:
                    best = max(best, _parse_size(f.read()))
            except (OSError, ValueError):
                continue
    except OSError:
        pass
    return best or 32 << 20


def cpu_model() -> str:
    from hmoe.hardware.cpu import cpu_info

    return cpu_info().model


def cpu_busy_fraction(interval: float = 0.5) -> float | None:
    """Share of all CPUs' time used by other processes over `interval` s while this one sleeps,
    before it starts working: other load on the machine makes every timing below unreliable."""
    load = OtherLoad()
    time.sleep(interval)
    return load.fraction(min_cpu_s=0.0)


class OtherLoad:
    """Share of all CPUs' time used by other processes (or stolen by the hypervisor) since
    construction: /proc/stat non-idle time minus this process's own CPU time. On a shared
    machine this is what turns a 5 ms call into 300 ms; None where it cannot be measured."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:9]]  # user .. steal; guest is inside user
        except (OSError, ValueError):
            return None
        own = os.times()
        return sum(vals), vals[3] + vals[4], own.user + own.system

    def fraction(self, min_cpu_s: float = 0.2) -> float | None:
        end = self._sample()
        if self._start is None or end is None:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        cpu_s = (end[0] - self._start[0]) / tick
        if cpu_s <= 0 or cpu_s < min_cpu_s:  # too few clock ticks to say anything
            return None
        busy = cpu_s - (end[1] - self._start[1]) / tick
        return min(1.0, max(0.0, (busy - (end[2] - self._start[2])) / cpu_s))


def copy_buffer_bytes(requested: int | None = None) -> int:
    """>= 1 GiB and >= 8x the last-level cache, so the copy measures DRAM and not cache;
    halved while two such buffers (plus 1 GiB slack) would not fit in MemAvailable."""
    if requested:
        return requested
    nbytes = max(GIB, 8 * llc_bytes())
    avail = mem_available_bytes()
    while avail and nbytes > (64 << 20) and 2 * nbytes + GIB > avail:
        nbytes //= 2
    return nbytes


def _copy_result(method: str, nbytes: int, times_s: list[float], **extra) -> dict:
    """A copy measurement: GB/s counts bytes read + bytes written (2x the buffer), GB = 1e9 B."""
    med = statistics.median(times_s)
    return {"method": method, **extra, "bytes_buffer": nbytes, "bytes_counted_per_copy": 2 * nbytes,
            "counts": "bytes read + bytes written", "repeats": len(times_s), "ms_median": med * 1e3,
            "gbps": 2 * nbytes / med / 1e9, "gbps_best": 2 * nbytes / min(times_s) / 1e9}


def measure_copy_bandwidth(nbytes: int | None = None, repeats: int = 5) -> dict:
    """Bandwidth of a large multi-threaded buffer copy (torch's copy_ is parallelised over its
    intra-op threads)."""
    import torch

    n = copy_buffer_bytes(nbytes) // 4
    src = torch.empty(n, dtype=torch.float32)
    src.uniform_(-1.0, 1.0)  # real data; untouched pages would be the shared zero page
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst pays page faults: keep that out of the timing
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    del src, dst
    return _copy_result("torch Tensor.copy_ of one contiguous fp32 buffer into another", n * 4, times,
                        threads=torch.get_num_threads())


def measure_read_bandwidth(nbytes: int | None = None, repeats: int = 5, threads: int | None = None) -> dict:
    """Read-only bandwidth of host memory: hmoe's native streaming probe (cpu_core.read_bandwidth:
    every thread reads its own slice of one buffer larger than the caches, as one sequential stream and
    as four interleaved ones with a software prefetch; the best of `repeats` passes of each). This is
    the ceiling of streaming expert weights; a copy also writes and understates it, and a torch
    reduction on few cores is bound by its arithmetic. GB/s counts bytes read."""
    from hmoe import _native, get_num_threads

    n = copy_buffer_bytes(nbytes)
    threads = threads or get_num_threads()
    bps = _native.bind("cpu_core").read_bandwidth(n, threads, repeats)
    return {"method": "native streaming read probe (cpu_core.read_bandwidth)", "bytes_buffer": n,
            "counts": "bytes read", "repeats": repeats, "gbps": bps / 1e9, "threads": threads}


class CacheFlusher:
    """Reads a buffer of 2x the last-level cache between timed calls, so a call does not find
    the previous call's expert weights still cached (a real model runs other layers between).
    It reads rather than copies: a copy leaves the cache full of dirty lines whose write-backs
    then eat into the next timed call's bandwidth, which penalises the faster call the most.
    Then it idles `idle_s` (default 10 ms): torch's OpenMP workers spin after the read (GNU
    OpenMP's default wait policy) and would take the cores from whichever implementation runs
    next; both the torch loop and hmoe start from a quiet machine this way. Pass a longer idle
    where other thread pools spin longer (kt-kernel's workers: about 50 ms). Disabled, it only
    idles."""

    def __init__(self, enabled: bool = True, idle_s: float = 0.01):
        self.enabled, self.idle_s = enabled, idle_s
        if enabled:
            import torch

            n = max(64 << 20, 2 * llc_bytes()) // 4
            self._src = torch.ones(n, dtype=torch.float32)

    def __call__(self) -> None:
        if self.enabled:
            self._src.sum()
        if self.idle_s > 0:
            time.sleep(self.idle_s)


def cuda_event_ms(fn, repeats: int, before=None, after=None) -> list[float]:
    """Milliseconds of each of `repeats` calls of fn on the current stream, timed with CUDA events
    (before(), e.g. a cache flush, runs ahead of each call and after(), e.g. a clock probe, behind
    it, both outside its timing)."""
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(1, repeats))]
    for start, end in events:
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        if after is not None:
            after()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def gpu_copy_bandwidth(device, nbytes: int | None = None, repeats: int = 10) -> dict:
    """Device-memory bandwidth of a torch copy_ between two buffers on a CUDA `device`, timed with
    CUDA events (median over repeats). The buffer is >= 2 GiB by default, far past any L2, and is
    halved while two of them (plus 1 GiB slack) would not fit in free device memory. GB/s counts
    bytes read + bytes written, GB = 1e9 B; the buffers are freed before returning."""
    import torch

    device = torch.device(device)
    nbytes = nbytes or 2 * GIB
    free, _ = torch.cuda.mem_get_info(device)
    while nbytes > (256 << 20) and 2 * nbytes + GIB > free:
        nbytes //= 2
    n = nbytes // 4
    with torch.cuda.device(device):
        src = torch.empty(n, dtype=torch.float32, device=device).uniform_(-1.0, 1.0)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first launch of the copy kernel and clocks ramping up stay out of the timing
        times = [ms / 1e3 for ms in cuda_event_ms(lambda dst=dst, src=src: dst.copy_(src), repeats)]
        del src, dst
        torch.cuda.empty_cache()
    return _copy_result("torch Tensor.copy_ of one contiguous fp32 device buffer into another, CUDA events",
                        n * 4, times, device=torch.cuda.get_device_name(device))


def gpu_matmul_tflops(device, n: int = 8192, repeats: int = 10) -> dict:
    """Median TFLOP/s of a bf16 torch matmul n x n x n on random data (2 n^3 FLOPs), CUDA events:
    the compute roof GPU kernels are compared with, measured on this GPU at its current clocks."""
    import torch

    with torch.cuda.device(device):
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        for _ in range(3):  # cuBLAS heuristics and clocks settle
            torch.matmul(a, b, out=c)
        ms = statistics.median(cuda_event_ms(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), repeats))
        del a, b, c
        torch.cuda.empty_cache()
    return {"method": f"bf16 torch.matmul {n}x{n}x{n}, random data, CUDA events", "n": n,
            "ms_median": ms, "tflops": 2 * n**3 / (ms * 1e9)}


class GpuL2Flusher:
    """Reads max(256 MiB, 4x L2) on the current stream between timed GPU calls (outside the timed
    region), so a call does not find the previous call's data in L2: a model runs other layers in
    between. It reads rather than writes, as CacheFlusher does: a write leaves L2 full of dirty
    lines whose write-backs then land in the next timed call (measured on an H200: ~10 us added
    to every MLA decode call, whatever its size). The GPU counterpart of CacheFlusher."""

    def __init__(self, device):
        import torch

        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        self._buf = torch.ones(max(256 << 20, 4 * l2) // 8, dtype=torch.int64, device=device)

    def __call__(self) -> None:
        self._buf.sum()
