"""Optional backends: another library's implementation of an hmoe op, forcible by name (variant=,
HMOE_CUDA_VARIANT) once it passes hmoe's checks. BACKENDS below is the one registration: the
dispatcher asks it which names exist and whether one can run on a device, hmoe.compat shows each
one's state, and an op hands a selected backend its call. Registering a backend = a row here and
a module (imported only when one of its functions is needed) that provides:

    selectable(name, cc, driver_cuda) -> (ok, why)   cheap pre-validation: no import of the library, no JIT
    compat_state(name) -> {"usable": bool, "detail": str}
    run_<op>(name, *args, **kwargs)             for each op it serves, with the op's arguments
    warm(name, device_index)                    every lazy step (imports, JIT builds, self-checks) now,
                                                before graph capture (hmoe.prewarm)
"""
from __future__ import annotations

import importlib

# name -> (module, ops served)
BACKENDS = {
    "flashinfer-fa2": ("hmoe.backends.flashinfer", ("mla_decode",)),
    "flashinfer-fa3": ("hmoe.backends.flashinfer", ("mla_decode",)),
}


def names(op: str | None = None) -> list[str]:
    """The backends serving `op` (all of them for None)."""
    return sorted(n for n, (_, ops) in BACKENDS.items() if op is None or op in ops)


def serves(name: str, op: str) -> bool:
    return name in BACKENDS and op in BACKENDS[name][1]


def module(name: str):
    return importlib.import_module(BACKENDS[name][0])


def selectable(name: str, cc, driver_cuda) -> tuple[bool, str]:
    """Whether backend `name` can run on a device of compute capability cc, and why (not)."""
    return module(name).selectable(name, cc, driver_cuda)


def run(name: str, op: str, *args, **kwargs):
    return getattr(module(name), f"run_{op}")(name, *args, **kwargs)


def warm(name: str, device_index: int) -> None:
    module(name).warm(name, device_index)


def states() -> dict:
    """name -> {"usable", "detail"} for every backend; one whose module fails reads as unusable."""
    out = {}
    for name in names():
        try:
            st = module(name).compat_state(name)
            st = dict(st) if isinstance(st, dict) else {"detail": str(st)}
            st.setdefault("usable", None)
            st["detail"] = str(st.get("detail", ""))
        except Exception as e:  # noqa: BLE001 - a broken backend is a line in the report
            st = {"usable": False, "detail": f"{BACKENDS[name][0]} failed: {type(e).__name__}: {e}"}
        out[name] = st
    return out
