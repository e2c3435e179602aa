"""hmoe.build_info(): the manifest baked into the installation at build time."""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

_PKG = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def _manifest() -> dict:
    path = _PKG / "build_info.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeError(f"{path} is missing: hmoe is not built (install it with pip, not by "
                           "putting python/ on sys.path)") from None


def build_info() -> dict:
    """Version, git revision, CUDA version, CUDA kernels with SASS/PTX targets, CPU ISA modules,
    compiler and flags, as recorded when this installation was built."""
    info = copy.deepcopy(_manifest())
    info["package_dir"] = str(_PKG)
    return info


def module_name(entry: dict) -> str:
    """The native module of a manifest entry, without its package ("hmoe._native.x" -> "x")."""
    return entry["module"].rsplit(".", 1)[1]


def cpu_modules_for(op: str) -> dict[str, dict]:
    """ISA level -> manifest entry, for the CPU modules built for `op`."""
    return {e["isa"]: e for e in _manifest()["cpu_modules"].values() if e["op"] == op}


def cuda_kernels_for(op: str) -> dict[str, dict]:
    """family -> manifest entry, for the CUDA kernels built for `op`."""
    return {e["family"]: e for e in _manifest()["cuda_kernels"].values() if e["op"] == op}
