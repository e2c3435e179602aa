"""Variant selection: one function per device kind, used by the ops and by hmoe.compat alike."""
from __future__ import annotations

import dataclasses
import logging
import os

from . import _build_info
from ._native import NativeModuleError, load
from .hardware import cpu as _cpu

log = logging.getLogger("hmoe.dispatch")


@dataclasses.dataclass(frozen=True)
class Selection:
    op: str
    variant: str          # e.g. "avx512_bf16"
    module: str           # native module name under hmoe._native
    reason: str           # one line, as printed by hmoe.compat check


def _cpu_candidates(op: str):
    built = _build_info.cpu_modules_for(op)
    return [lv for lv in _cpu.levels() if lv["name"] in built], built


def select_cpu(op: str, signatures: dict, isa: str | None = None, info=None,
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
        module = built[forced]["module"].rsplit(".", 1)[1]
        if load_module:
            load(module, signatures)  # NativeModuleError propagates: the user asked for this one
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
        module = built[name]["module"].rsplit(".", 1)[1]
        if load_module:
            try:
                load(module, signatures)
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
