"""GPU detection through NVML (nvidia-ml-py): no CUDA context, no torch; CUDA ordinals mapped
with CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER the way the CUDA driver applies them.

Every failure (no nvidia-ml-py, no libnvidia-ml, driver not loaded, one query raising
NVMLError) becomes a reason string in the result, never an exception to the caller.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re

# Tests (and tools) may set this to a fake pynvml module; detect() then uses it.
_NVML_HOOK = None


@dataclasses.dataclass(frozen=True)
class MigDevice:
    uuid: str | None                 # "MIG-..."
    name: str | None
    memory_total: int | None         # bytes
    gpu_instance_id: int | None
    compute_instance_id: int | None


@dataclasses.dataclass(frozen=True)
class Gpu:
    nvml_index: int | None           # None for simulated GPUs
    uuid: str | None                 # "GPU-..."
    name: str | None
    compute_capability: tuple[int, int] | None
    memory_total: int | None         # bytes
    pci_bus_id: str | None
    gpu_cores: int | None            # only used to approximate FASTEST_FIRST
    mig_mode: bool | None            # None: unknown
    mig_devices: tuple[MigDevice, ...] = ()
    problems: tuple[str, ...] = ()   # NVML queries that failed, one line each
    simulated: bool = False

    @property
    def cc(self) -> str | None:
        c = self.compute_capability
        return None if c is None else f"{c[0]}.{c[1]}"


@dataclasses.dataclass(frozen=True)
class CudaDevice:
    """One device as CUDA numbers it: a whole GPU, or a MIG device of a GPU in MIG mode."""
    ordinal: int
    gpu: Gpu
    mig: MigDevice | None = None

    @property
    def compute_capability(self):
        return self.gpu.compute_capability

    @property
    def label(self) -> str:
        name = (self.mig.name if self.mig and self.mig.name else self.gpu.name) or "unknown GPU"
        cc = self.gpu.cc or "cc unknown"
        return f"cuda:{self.ordinal} ({name}, {cc})"


@dataclasses.dataclass(frozen=True)
class GpuDetection:
    ok: bool                         # NVML answered (even with zero GPUs)
    reason: str | None               # why there is no GPU information, when not ok
    driver_version: str | None       # e.g. "580.65.06"
    driver_cuda: tuple[int, int] | None  # highest CUDA version the driver supports
    gpus: tuple[Gpu, ...]            # NVML order
    visible: tuple[CudaDevice, ...]  # by CUDA ordinal
    cuda_visible_devices: str | None
    device_order: str                # "FASTEST_FIRST" or "PCI_BUS_ID"
    notes: tuple[str, ...] = ()      # how CUDA_VISIBLE_DEVICES/ordering/MIG were applied
    problems: tuple[str, ...] = ()   # system-level queries that failed
    simulated: bool = False
    nvml_missing: bool = False       # no nvidia-ml-py or no libnvidia-ml: usual without GPUs

    def by_ordinal(self, ordinal: int) -> CudaDevice | None:
        return next((d for d in self.visible if d.ordinal == ordinal), None)

    def ordinal_of(self, gpu: Gpu) -> list[int]:
        return [d.ordinal for d in self.visible if d.gpu is gpu]


def _s(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def _err(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _init_reason(nvml, e: BaseException) -> str:
    """One line on why nvmlInit failed, with what to do about it."""
    def is_(name):
        cls = getattr(nvml, name, None)
        return isinstance(cls, type) and isinstance(e, cls)
    if is_("NVMLError_LibraryNotFound"):
        return ("libnvidia-ml.so.1 not found: no NVIDIA driver on this machine, or it is not "
                "on the library path / not mounted into this container")
    if is_("NVMLError_DriverNotLoaded"):
        return "the NVIDIA kernel driver is not loaded (nvidia-smi fails too): load or reinstall it"
    if is_("NVMLError_LibRmVersionMismatch"):
        return ("the NVIDIA kernel module and libnvidia-ml are different versions (a driver "
                "upgrade without a reboot?): reboot or reload the nvidia module")
    if is_("NVMLError_NoPermission"):
        return "no permission to open the NVIDIA devices (/dev/nvidia*): check their mode/group"
    return f"NVML could not start: {_err(e)}"


def _cuda_from_int(v: int) -> tuple[int, int]:
    return (v // 1000, (v % 1000) // 10)


class _Probe:
    """Runs NVML queries, turning each failure into a line in `problems`."""

    def __init__(self, nvml):
        self.nvml = nvml
        self.problems: list[str] = []

    def __call__(self, what: str, fn_name: str, *args, quiet=(), default=None):
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            self.problems.append(f"{what}: this nvidia-ml-py has no {fn_name}")
            return default
        try:
            return fn(*args)
        except Exception as e:  # NVMLError or anything a broken binding raises
            if not any(isinstance(e, c) for c in quiet):
                self.problems.append(f"{what}: {_err(e)}")
            return default


def _errs(nvml, *names):
    return tuple(c for c in (getattr(nvml, n, None) for n in names) if isinstance(c, type))


def _query_gpu(nvml, i: int) -> Gpu:
    p = _Probe(nvml)
    h = p(f"GPU {i}: handle", "nvmlDeviceGetHandleByIndex", i)
    if h is None:
        return Gpu(i, None, None, None, None, None, None, None, problems=tuple(p.problems))
    not_supported = _errs(nvml, "NVMLError_NotSupported", "NVMLError_FunctionNotFound")
    name = p(f"GPU {i}: name", "nvmlDeviceGetName", h)
    uuid = p(f"GPU {i}: UUID", "nvmlDeviceGetUUID", h)
    cc = p(f"GPU {i}: compute capability", "nvmlDeviceGetCudaComputeCapability", h)
    mem = p(f"GPU {i}: memory", "nvmlDeviceGetMemoryInfo", h)
    pci = p(f"GPU {i}: PCI info", "nvmlDeviceGetPciInfo", h)
    # Core count only refines the FASTEST_FIRST guess; its absence is not worth a line.
    cores = None
    if hasattr(nvml, "nvmlDeviceGetNumGpuCores"):
        cores = p("cores", "nvmlDeviceGetNumGpuCores", h, quiet=(Exception,))
    before = len(p.problems)
    mode = p(f"GPU {i}: MIG mode", "nvmlDeviceGetMigMode", h, quiet=not_supported)
    # NotSupported (no line added) means a GPU without MIG; another failure means unknown.
    mig_on = bool(mode[0]) if mode is not None else (False if len(p.problems) == before else None)
    migs = []
    if mig_on:
        # Best effort: an empty slot raises NotFound, which only means "no device here".
        n = p(f"GPU {i}: MIG device count", "nvmlDeviceGetMaxMigDeviceCount", h, default=0)
        for j in range(n or 0):
            mh = p(f"GPU {i}: MIG {j}", "nvmlDeviceGetMigDeviceHandleByIndex", h, j,
                   quiet=_errs(nvml, "NVMLError_NotFound", "NVMLError_InvalidArgument"))
            if mh is None:
                continue
            mmem = p(f"GPU {i}: MIG {j} memory", "nvmlDeviceGetMemoryInfo", mh)
            muuid = p(f"GPU {i}: MIG {j} UUID", "nvmlDeviceGetUUID", mh)
            mname = p(f"GPU {i}: MIG {j} name", "nvmlDeviceGetName", mh)
            migs.append(MigDevice(
                None if muuid is None else _s(muuid), None if mname is None else _s(mname),
                None if mmem is None else int(mmem.total),
                p(f"GPU {i}: MIG {j} GPU instance", "nvmlDeviceGetGpuInstanceId", mh),
                p(f"GPU {i}: MIG {j} compute instance", "nvmlDeviceGetComputeInstanceId", mh)))
    bus = getattr(pci, "busId", None) if pci is not None else None
    return Gpu(i, None if uuid is None else _s(uuid), None if name is None else _s(name),
               None if cc is None else (int(cc[0]), int(cc[1])),
               None if mem is None else int(mem.total),
               None if bus is None else _s(bus).upper(),
               cores if isinstance(cores, int) else None, mig_on, tuple(migs),
               tuple(p.problems))


def _query_gpu_safely(nvml, i: int) -> Gpu:
    try:
        return _query_gpu(nvml, i)
    except Exception as e:  # a binding returning something malformed: still only a line
        return Gpu(i, None, None, None, None, None, None, None, problems=(f"GPU {i}: {_err(e)}",))


def _query_nvml(nvml) -> tuple:
    """(ok, reason, driver_version, driver_cuda, gpus, problems[, nvml_missing]) from NVML."""
    try:
        nvml.nvmlInit()
    except Exception as e:
        lib = getattr(nvml, "NVMLError_LibraryNotFound", None)
        missing = isinstance(lib, type) and isinstance(e, lib)
        return False, _init_reason(nvml, e), None, None, (), (), missing
    p = _Probe(nvml)
    try:
        drv = p("driver version", "nvmlSystemGetDriverVersion")
        fn = ("nvmlSystemGetCudaDriverVersion_v2" if hasattr(nvml, "nvmlSystemGetCudaDriverVersion_v2")
              else "nvmlSystemGetCudaDriverVersion")
        cuda = p("CUDA version of the driver", fn)
        count = p("GPU count", "nvmlDeviceGetCount", default=0) or 0
        gpus = tuple(_query_gpu_safely(nvml, i) for i in range(int(count)))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # nothing useful to do about a failed shutdown
            pass
    return (True, None, None if drv is None else _s(drv),
            None if cuda is None else _cuda_from_int(int(cuda)), gpus, tuple(p.problems))


def _load_nvml():
    if _NVML_HOOK is not None:
        return _NVML_HOOK, None
    try:
        import pynvml
    except Exception as e:
        return None, f"nvidia-ml-py is not installed or broken ({_err(e)}): pip install nvidia-ml-py"
    return pynvml, None


@functools.lru_cache(maxsize=1)
def _cached_query():
    nvml, why = _load_nvml()
    if nvml is None:
        return False, why, None, None, (), (), True
    return _query_nvml(nvml)


def refresh() -> None:
    """Forget the cached NVML answer (tests, or after a driver change)."""
    global _cached_query_primed
    _cached_query.cache_clear()
    _cached_query_primed = None


def query_json() -> dict:
    """This process's NVML answer as JSON data (what hmoe.compat's NVML child process prints)."""
    ok, reason, drv, cuda, gpus, problems, *missing = _cached_query()
    return {"ok": ok, "reason": reason, "driver_version": drv, "driver_cuda": cuda,
            "gpus": [dataclasses.asdict(g) for g in gpus], "problems": list(problems),
            "nvml_missing": bool(missing and missing[0])}


def prime(answer: dict) -> None:
    """Take `answer` (query_json() of another process, or a failure: ok False and a reason) as this
    process's NVML answer, so that detect() never loads NVML here: hmoe.compat asks NVML in a child
    process that may crash or hang instead of itself."""
    global _cached_query_primed

    def gpu(d):
        migs = tuple(MigDevice(**m) for m in d.get("mig_devices", ()))
        cc = d.get("compute_capability")
        return Gpu(**dict(d, compute_capability=None if cc is None else tuple(cc), mig_devices=migs,
                          problems=tuple(d.get("problems", ()))))
    cuda = answer.get("driver_cuda")
    raw = (bool(answer.get("ok")), answer.get("reason"), answer.get("driver_version"),
           None if cuda is None else tuple(cuda), tuple(gpu(g) for g in answer.get("gpus", ())),
           tuple(answer.get("problems", ())), bool(answer.get("nvml_missing")))
    _cached_query.cache_clear()
    _cached_query_primed = raw


_cached_query_primed = None


def _order(gpus, order: str) -> list[Gpu]:
    """GPUs in the order CUDA enumerates them before CUDA_VISIBLE_DEVICES is applied.

    NVML enumerates in PCI bus order. PCI_BUS_ID sorts by bus id. FASTEST_FIRST, CUDA's
    default, uses an undocumented heuristic; we APPROXIMATE it by compute capability, then
    CUDA core count, both descending, ties kept in PCI order. On machines with identical GPUs
    (the usual case) both orders agree; on mixed machines set CUDA_DEVICE_ORDER=PCI_BUS_ID
    to make ordinals certain.
    """
    by_bus = list(gpus)
    if all(g.pci_bus_id for g in gpus):
        by_bus.sort(key=lambda g: g.pci_bus_id)
    if order == "PCI_BUS_ID":
        return by_bus
    return sorted(by_bus, key=lambda g: (-(g.compute_capability or (0, 0))[0],
                                         -(g.compute_capability or (0, 0))[1], -(g.gpu_cores or 0)))


def _match_entry(entry: str, ordered: list[Gpu]):
    """(gpu, mig_or_None, None) for one CUDA_VISIBLE_DEVICES entry, or (None, None, why)."""
    low = entry.lower()
    if low.startswith("gpu-"):
        # CUDA accepts any prefix of a GPU UUID (from "GPU-") that names exactly one GPU.
        hits = [g for g in ordered if g.uuid and g.uuid.lower().startswith(low)]
        if len(hits) != 1:
            return None, None, "matches no GPU UUID" if not hits else "matches several GPU UUIDs"
        return hits[0], None, None
    if low.startswith("mig-gpu-"):
        # Pre-R470 form: MIG-GPU-<gpu uuid>/<gpu instance id>/<compute instance id>.
        m = re.fullmatch(r"mig-(gpu-[0-9a-f-]+)/(\d+)/(\d+)", low)
        for g in ordered if m else ():
            if g.uuid and g.uuid.lower() == m.group(1):
                for d in g.mig_devices:
                    if (d.gpu_instance_id, d.compute_instance_id) == (int(m.group(2)), int(m.group(3))):
                        return g, d, None
        return None, None, "matches no MIG device"
    if low.startswith("mig-"):
        for g in ordered:
            for d in g.mig_devices:
                if d.uuid and d.uuid.lower() == low:
                    return g, d, None
        return None, None, "matches no MIG device UUID"
    m = re.match(r"\d+", entry)  # CUDA reads indices like strtoul: "1abc" is 1
    if m is None:
        return None, None, "is not an index or a GPU-/MIG- UUID"
    idx = int(m.group())
    if idx >= len(ordered):
        return None, None, f"is not a device index (there are {len(ordered)} GPUs)"
    return ordered[idx], None, None


def resolve_visible(gpus, spec: str | None, order: str = "FASTEST_FIRST"):
    """(devices by CUDA ordinal, notes) for NVML's `gpus` under CUDA_VISIBLE_DEVICES=`spec`.

    As the CUDA driver does: entries are indices (into the CUDA_DEVICE_ORDER order), GPU UUIDs
    or unique prefixes of them ("GPU-8932f937"), MIG UUIDs ("MIG-..." or the older
    "MIG-GPU-<uuid>/<gi>/<ci>"); an empty value shows no device; the first entry that names
    no device ends the list (the entries before it stay visible); a device listed twice
    shows no device at all. A GPU in MIG mode is not itself a CUDA device: naming it (or
    leaving CUDA_VISIBLE_DEVICES unset) means its MIG devices, and CUDA 11/12 drivers
    enumerate only one MIG device per process, so only the first keeps an ordinal.
    """
    notes = []
    if order not in ("FASTEST_FIRST", "PCI_BUS_ID"):
        notes.append(f"CUDA_DEVICE_ORDER={order!r} is not FASTEST_FIRST or PCI_BUS_ID; "
                     "using FASTEST_FIRST, CUDA's default")
        order = "FASTEST_FIRST"
    ordered = _order(gpus, order)
    if spec is None:
        chosen = [(g, None) for g in ordered]
    elif not spec.strip():
        return (), ("CUDA_VISIBLE_DEVICES is set and empty: CUDA sees no device",)
    else:
        chosen = []
        for raw in spec.split(","):
            entry = raw.strip()
            g, mig, why = _match_entry(entry, ordered)
            if g is None:
                notes.append(f"CUDA_VISIBLE_DEVICES entry {entry!r} {why}: CUDA ignores it and "
                             "every entry after it")
                break
            if any(c[0] is g and c[1] is mig for c in chosen):
                return (), tuple(notes + [f"CUDA_VISIBLE_DEVICES names {entry!r} twice: CUDA "
                                          "then shows no device at all"])
            chosen.append((g, mig))
    expanded = []
    for g, mig in chosen:
        if mig is None and g.mig_mode:
            if not g.mig_devices:
                notes.append(f"GPU {g.nvml_index} is in MIG mode without MIG devices: CUDA "
                             "cannot use it (create MIG instances or disable MIG)")
            expanded += [(g, d) for d in g.mig_devices]
        elif not any(e[0] is g and e[1] is mig for e in expanded):
            expanded.append((g, mig))
    mig_seen, devices = False, []
    for g, mig in expanded:
        if mig is not None:
            if mig_seen:
                notes.append(f"MIG device {mig.uuid} gets no ordinal: CUDA enumerates only one "
                             "MIG device per process")
                continue
            mig_seen = True
        devices.append(CudaDevice(len(devices), g, mig))
    return tuple(devices), tuple(notes)


def _assemble(raw, spec, order) -> GpuDetection:
    ok, reason, drv, cuda, gpus, problems = raw[:6]
    visible, notes = resolve_visible(gpus, spec, order) if ok else ((), ())
    return GpuDetection(ok, reason, drv, cuda, gpus, visible, spec,
                        order if order == "PCI_BUS_ID" else "FASTEST_FIRST", notes, problems,
                        nvml_missing=bool(raw[6:] and raw[6]))


def detect(*, refresh: bool = False, _nvml=None) -> GpuDetection:
    """GPUs, driver and CUDA ordinals of this machine. NVML is asked once and cached
    (refresh=True asks again); CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER are read on each call.
    `_nvml` queries that (fake) module instead, uncached."""
    global _cached_query_primed
    if refresh:
        _cached_query.cache_clear()
        _cached_query_primed = None
    if _nvml is not None:
        raw = _query_nvml(_nvml)
    else:
        raw = _cached_query_primed if _cached_query_primed is not None else _cached_query()
    return _assemble(raw, os.environ.get("CUDA_VISIBLE_DEVICES"),
                     os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST"))


def parse_cc(text) -> tuple[int, int]:
    """'8.6', '86', 'sm_86', '10.0', '100', '9.0a' or (8, 6) -> (major, minor)."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        return int(text[0]), int(text[1])
    t = str(text).strip().lower()
    t = t[3:] if t.startswith("sm_") else t
    t = t[:-1] if t.endswith("a") else t
    m = re.fullmatch(r"(\d+)\.(\d)", t) or re.fullmatch(r"(\d+)(\d)", t)
    if m is None:
        raise ValueError(f"not a compute capability: {text!r} (write it like 8.6 or 10.0)")
    return int(m.group(1)), int(m.group(2))


def simulated(cc, *more, driver_cuda=(13, 0)) -> GpuDetection:
    """A detection with one GPU per compute capability given (for compat --simulate-gpu),
    ordinals 0, 1, ... in the order given, driver supporting CUDA `driver_cuda`."""
    gpus = tuple(Gpu(None, None, "simulated GPU", (a, b), None, None, None, False,
                     simulated=True) for a, b in (parse_cc(c) for c in (cc, *more)))
    visible = tuple(CudaDevice(i, g) for i, g in enumerate(gpus))
    return GpuDetection(True, None, None, None if driver_cuda is None else tuple(driver_cuda),
                        gpus, visible, None, "PCI_BUS_ID", simulated=True)
