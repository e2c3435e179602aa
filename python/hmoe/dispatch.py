"""Variant selection: one function per device kind, used by the ops and by hmoe.compat alike."""
from __future__ import annotations

import dataclasses
import logging
import os

from . import _arch, _build_info, backends
from ._build_info import module_name
from ._native import NativeModuleError, load
from .hardware import cpu as _cpu

log = logging.getLogger("hmoe.dispatch")


@dataclasses.dataclass(frozen=True)
class Selection:
    op: str
    variant: str          # e.g. "avx512_bf16"
    module: str           # native module name under hmoe._native
    reason: str           # one line, as printed by hmoe.compat check
    device: str = "cpu"   # "cpu" or a label like "cuda:0 (NVIDIA H200, 9.0)"
    target: str = ""      # GPU: what runs, "sm_90", "sm_90a" or "compute_90" (PTX JIT)
    refused: tuple = ()   # higher-ranked variants refused at load, with why
    backend: bool = False  # an optional backend (hmoe.backends), not one of hmoe's modules


def _cpu_candidates(op: str):
    built = _build_info.cpu_modules_for(op)
    return [lv for lv in _cpu.levels() if lv["name"] in built], built


def select_cpu(op: str, isa: str | None = None, info=None,
               load_module: bool = True) -> Selection:
    """Pick the CPU variant of `op`: forced by `isa` or $HMOE_CPU_ISA, else the best level this
    CPU and OS can run whose module loads and passes its signature check."""
    forced, source = (isa, "isa=") if isa else (os.environ.get("HMOE_CPU_ISA") or None, "HMOE_CPU_ISA=")
    known = [lv["name"] for lv in _cpu.levels()]
    candidates, built = _cpu_candidates(op)
    if forced is not None:
        if not isinstance(forced, str) or forced not in known:
            raise ValueError(f"{source}{forced!r} is not an ISA level of this processor "
                             f"({_cpu.processor()}); known levels: {', '.join(known)}")
        if forced not in built:
            raise ValueError(f"{source}{forced!r}: this hmoe build has no {op} module for it "
                             f"(built: {', '.join(built) or 'none'})")
        level = next(lv for lv in candidates if lv["name"] == forced)
        if info is None:
            info = _cpu.cpu_info(request_amx=bool(level["requires"].get("permission")))
        missing = _cpu.missing_requirements(level, info)
        if missing:
            raise ValueError(f"{source}{forced!r}: this CPU/OS cannot run it (missing "
                             f"{', '.join(missing)}); levels it can run: "
                             f"{', '.join(lv['name'] for lv in candidates if not _cpu.missing_requirements(lv, info)) or 'none'}")
        module = module_name(built[forced])
        if load_module:
            load(module)  # NativeModuleError propagates: the user asked for this one
        return Selection(op, forced, module, f"forced by {source}{forced}")

    if info is None:
        wants_amx = any(lv["requires"].get("permission") for lv in candidates)
        info = _cpu.cpu_info(request_amx=wants_amx)
    skipped = []
    load_failed = False
    for level in reversed(candidates):
        name = level["name"]
        missing = _cpu.missing_requirements(level, info)
        if missing:
            skipped.append(f"{name}: missing {', '.join(missing)}")
            continue
        module = module_name(built[name])
        if load_module:
            try:
                load(module)
            except NativeModuleError as e:
                skipped.append(f"{name}: {e}")
                load_failed = True
                log.warning("hmoe: %s variant %s refused: %s", op, name, e)
                continue
        if not skipped:
            reason = f"native: {name}, the highest level built"
        elif load_failed:
            reason = f"fallback: {name} ({'; '.join(skipped)})"
        else:
            reason = f"native: {name}, the highest level this CPU runs ({'; '.join(skipped)})"
        return Selection(op, name, module, reason)
    raise RuntimeError(f"no CPU variant of {op} can run here: {'; '.join(skipped) or 'none built'}")


# --- GPU ------------------------------------------------------------------------------------
def family_rank() -> tuple:
    """Kernel families in the order they are tried (arch/gpu.json's family_rank); a family the
    list leaves out is tried after these, by name."""
    return tuple(_arch.load("gpu").get("family_rank", ()))

class NoGpuVariant(RuntimeError):
    """No GPU variant of an op can run on a device. `reason` is the one-line decision that
    hmoe.compat prints ("unsupported: 7.5 < 8.0", "driver too old: ..."), `fix` what to do."""

    def __init__(self, reason: str, fix: str = ""):
        super().__init__(reason if fix in reason else f"{reason} ({fix})")
        self.reason = reason
        self.fix = fix


def _version(v) -> tuple[int, int] | None:
    """'13.0.88', '12.4', (13, 0) -> (major, minor)."""
    if v is None:
        return None
    if isinstance(v, (tuple, list)):
        return int(v[0]), int(v[1])
    parts = str(v).split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def _min_driver(need: tuple[int, int]) -> str | None:
    """The oldest driver in arch/gpu.json that supports CUDA `need` (a later CUDA's minimum
    when `need` itself is not listed: enough, if not the least)."""
    table = _arch.load("gpu").get("min_driver_for_cuda", {})
    ok = sorted((_version(k), v) for k, v in table.items() if _version(k) >= need)
    return ok[0][1] if ok else None


def _driver_fix(need: tuple[int, int], driver_cuda) -> str:
    drv = _min_driver(need)
    fix = f"upgrade the driver to {drv} or newer" if drv else \
        f"upgrade the driver to one that supports CUDA {need[0]}.{need[1]}"
    if driver_cuda[0] >= 12 and driver_cuda[0] != need[0]:
        fix += f", or install the cu{driver_cuda[0]} wheel"
    return fix


def _sm(target: str) -> tuple[int, int, bool]:
    """'90a' -> (9, 0, True); '100' -> (10, 0, False)."""
    a = target.endswith("a")
    digits = target[:-1] if a else target
    return int(digits[:-1]), int(digits[-1]), a


def _force_ptx_jit() -> bool:
    """CUDA_FORCE_PTX_JIT=1: the driver ignores every SASS image and JIT-compiles the PTX; a
    kernel without PTX then fails to load ("no kernel image")."""
    return os.environ.get("CUDA_FORCE_PTX_JIT", "") == "1"


def _plan_family(entry: dict, cc, driver_cuda, build_cuda):
    """(ok, target, reason) for running one built family on compute capability `cc`. SASS
    runs on the same major with an equal or higher minor (not for 'a' targets, which run
    on their exact cc only), unless CUDA_FORCE_PTX_JIT=1 has the driver ignore it; PTX is
    JIT-compiled by the driver for any newer device, which needs a driver at least as new as
    the toolkit that wrote the PTX."""
    ccs = f"{cc[0]}.{cc[1]}"
    sass = [(_sm(t), t) for t in entry.get("sass", [])]
    forced_jit = _force_ptx_jit()
    if not forced_jit:
        for (ma, mi, _a), t in sass:
            if (ma, mi) == tuple(cc):
                return True, f"sm_{t}", f"native: sm_{t} SASS"
        same = [((ma, mi), t) for (ma, mi, a), t in sass if not a and ma == cc[0] and mi < cc[1]]
        if same:
            t = max(same)[1]
            return True, f"sm_{t}", f"fallback: sm_{t} SASS on {ccs} (same major)"
    ptx = [((ma, mi), t) for (ma, mi, a), t in ((_sm(t), t) for t in entry.get("ptx", []))
           if not a and (ma, mi) <= tuple(cc)]
    if ptx:
        t = max(ptx)[1]
        if driver_cuda is not None and build_cuda is not None and tuple(driver_cuda) < build_cuda:
            return False, f"compute_{t}", (
                f"driver too old: PTX JIT (compute_{t}) on {ccs} needs a driver for CUDA "
                f"{build_cuda[0]}.{build_cuda[1]}, this one supports {driver_cuda[0]}."
                f"{driver_cuda[1]}: {_driver_fix(build_cuda, driver_cuda)}")
        return True, f"compute_{t}", f"fallback: PTX JIT (compute_{t}) on {ccs}" + (
            " (CUDA_FORCE_PTX_JIT=1: the driver ignores SASS)" if forced_jit else "")
    built = ", ".join([f"sm_{t} SASS" for _, t in sass] +
                      [f"compute_{t} PTX" for t in entry.get("ptx", [])]) or "nothing"
    if forced_jit and sass:
        return False, "", f"CUDA_FORCE_PTX_JIT=1: the driver ignores SASS and no PTX of this family (built: {built}) " \
                          f"runs on {ccs}"
    return False, "", f"unsupported: built for {built}; none runs on {ccs}"


_FROM_MANIFEST = "manifest"


def _gpu_kernels(op: str, kernels, build_cuda):
    if kernels is None:
        kernels = _build_info.cuda_kernels_for(op)
    if build_cuda == _FROM_MANIFEST:
        build_cuda = _build_info._manifest().get("cuda_version")
    return kernels, _version(build_cuda)


def select_gpu(op: str, *, cc, driver_cuda, device_label: str = "cuda",
               variant: str | None = None, load_module: bool = True, kernels: dict | None = None,
               build_cuda=_FROM_MANIFEST, use_env: bool = True) -> Selection:
    """Pick the GPU variant of `op` for a device of compute capability `cc` ((9, 0) or "9.0")
    whose driver supports CUDA `driver_cuda` ((13, 0); None: unknown, not checked).

    Families built for `op` (kernels: family -> {"sass", "ptx", "module"}; default: this
    installation's manifest; build_cuda: the CUDA version they were built with, default the
    manifest's, None for a build without CUDA) are ranked by arch/gpu.json (family_rank);
    one that the device cannot run, or whose module fails to load or its signature check,
    is skipped and the reason says so. `variant` or $HMOE_CUDA_VARIANT forces a family or a
    backend (hmoe.backends.BACKENDS): ValueError when it cannot run here; use_env=False
    ignores $HMOE_CUDA_VARIANT (hmoe's own choice among its families).
    NoGpuVariant (a RuntimeError) when nothing can: its .reason is the one-line decision.
    """
    from .hardware.gpu import parse_cc

    cc = parse_cc(cc)
    driver_cuda = _version(driver_cuda)
    ccs = f"{cc[0]}.{cc[1]}"
    forced, source = (variant, "variant=") if variant else \
        ((os.environ.get("HMOE_CUDA_VARIANT") if use_env else None) or None, "HMOE_CUDA_VARIANT=")
    note = ""

    def refuse(why: str, fix: str | None = None):
        """A forced variant that cannot run is the caller's error; otherwise no variant can."""
        if forced is not None:
            raise ValueError(f"{source}{forced!r} cannot run on {device_label}: {why}")
        raise NoGpuVariant(why, fix)

    if forced is not None and backends.serves(forced, op):
        ok, why = backends.selectable(forced, cc, driver_cuda)
        if not ok:
            refuse(why)
        return Selection(op, forced, "", f"forced by {source}{forced}: {why}", device=device_label, backend=True)
    kernels, build_cuda = _gpu_kernels(op, kernels, build_cuda)
    if forced is not None and forced not in kernels:
        known = set(_arch.load("gpu").get("kernel_families", {})) | set(backends.names())
        if source == "variant=" or forced not in known:
            raise ValueError(f"{source}{forced!r}: no such GPU variant of {op} in this build "
                             f"(built: {', '.join(sorted(kernels)) or 'none'}; "
                             f"backends for {op}: {', '.join(backends.names(op)) or 'none'})")
        # A global override naming a family this op lacks must not break every other op.
        note = f"; {source}{forced} ignored: {op} has no {forced} variant"
        forced = None
    if not kernels:
        if build_cuda is None:
            raise NoGpuVariant("no GPU kernels in this build (HMOE_CUDA=OFF)",
                               "install a wheel built with CUDA (cu12/cu13), or rebuild with HMOE_CUDA=ON")
        raise NoGpuVariant(f"no GPU kernels for {op} in this build",
                           "rebuild hmoe with HMOE_CUDA=ON from a complete source tree")
    need = tuple(_arch.load("gpu")["min_compute_capability"])
    if cc < need:
        why = f"unsupported: {ccs} < {need[0]}.{need[1]}"
        refuse(why, f"hmoe's CUDA kernels need compute capability {need[0]}.{need[1]} or newer; "
                    "run this op on the CPU")
    if driver_cuda is not None and build_cuda is not None and driver_cuda[0] < build_cuda[0]:
        floor = (build_cuda[0], 0)  # minor-version compatibility: any 13.x driver runs 13.y SASS
        fix = _driver_fix(floor, driver_cuda)
        refuse(f"driver too old: it supports CUDA {driver_cuda[0]}.{driver_cuda[1]}, this build "
               f"needs {floor[0]}.{floor[1]}: {fix}", fix)

    if forced is not None:
        ok, target, why = _plan_family(kernels[forced], cc, driver_cuda, build_cuda)
        if not ok:
            refuse(why)
        module = module_name(kernels[forced])
        if load_module:
            load(module)  # the user asked for this one
        return Selection(op, forced, module, f"forced by {source}{forced}: {why}",
                         device=device_label, target=target)

    rank = family_rank()
    ranked = [f for f in rank if f in kernels] + sorted(f for f in kernels if f not in rank)
    cannot, refused, elsewhere = [], [], []
    for family in ranked:
        ok, target, why = _plan_family(kernels[family], cc, driver_cuda, build_cuda)
        if not ok:
            # An arch-specific family (sm90a) not running on another GPU is no news.
            e = kernels[family]
            only_a = not e.get("ptx") and all(t.endswith("a") for t in e.get("sass", []))
            (elsewhere if only_a else cannot).append(f"{family}: {why}")
            continue
        module = module_name(kernels[family])
        if load_module:
            try:
                load(module)
            except NativeModuleError as e:
                refused.append(f"{family} refused: {e}")
                log.warning("hmoe: %s GPU variant %s refused on %s: %s", op, family, device_label, e)
                continue
        if refused:
            why = "fallback: " + why.split(": ", 1)[1] if why.startswith("native: ") else why
            why += f" ({'; '.join(refused)})"
        sel = Selection(op, family, module, why + note, device=device_label, target=target,
                        refused=tuple(refused))
        log.info("hmoe: %s on %s: %s (%s)", op, device_label, family, sel.reason)
        return sel
    if not cannot and not refused:
        cannot = elsewhere
    everything = cannot + refused
    if not refused and len(cannot) == 1:
        why = cannot[0].split(": ", 1)[1]
        raise NoGpuVariant(why, why.rsplit(": ", 1)[1] if why.startswith("driver too old") else
                           "rebuild hmoe with HMOE_CUDA_ARCHS including this GPU's target")
    raise NoGpuVariant(f"no GPU variant of {op} can run on {device_label}: {'; '.join(everything)}",
                       "reinstall hmoe (pip install --force-reinstall --no-deps hmoe)" if refused else
                       "rebuild hmoe with HMOE_CUDA_ARCHS including this GPU's target")


def _torch_capability(ordinal: int, *, may_init: bool):
    """Compute capability torch reports for cuda:<ordinal>; None when unknown. Without
    may_init only asks a torch that has already initialised CUDA (costs nothing then)."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is None and may_init:
            import torch
        if torch is None or not (torch.cuda.is_initialized() or may_init):
            return None
        if not torch.cuda.is_available() or ordinal >= torch.cuda.device_count():
            return None
        return tuple(torch.cuda.get_device_capability(ordinal))
    except Exception as e:  # a broken torch must not hide what NVML said
        log.debug("hmoe: torch could not report cuda:%d: %s", ordinal, e)
        return None


def select_gpu_for_device(op: str, device_ordinal: int, variant: str | None = None, use_env: bool = True,
                          *, load_module: bool = True) -> Selection:
    """select_gpu for CUDA device `device_ordinal`, with cc and driver from NVML (hmoe.hardware.
    gpu). Where NVML cannot tell (not installed, no such ordinal in its mapping), the compute
    capability comes from torch, which creates a CUDA context: fine at op time. When torch has
    already initialised CUDA its answer wins, since NVML's ordinal mapping can be approximate."""
    from .hardware import gpu as _gpu

    det = _gpu.detect()
    dev = det.by_ordinal(device_ordinal)
    label = dev.label if dev is not None else f"cuda:{device_ordinal}"
    cc = dev.compute_capability if dev is not None else None
    torch_cc = _torch_capability(device_ordinal, may_init=cc is None)
    if torch_cc is not None and cc is not None and torch_cc != cc:
        log.warning("hmoe: NVML maps %s to compute capability %s, torch says %s; using torch's "
                    "(set CUDA_DEVICE_ORDER=PCI_BUS_ID to make the mapping exact)", label, cc, torch_cc)
    cc = torch_cc or cc
    if cc is None:
        why = det.reason or "; ".join(det.notes) or \
            f"NVML lists {len(det.visible)} visible CUDA device(s)"
        raise NoGpuVariant(f"no CUDA device {device_ordinal}: {why}")
    return select_gpu(op, cc=cc, driver_cuda=det.driver_cuda, device_label=label, use_env=use_env,
                      variant=variant, load_module=load_module)
