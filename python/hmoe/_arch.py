"""Reads arch/cpu.json and arch/gpu.json as shipped inside the package."""
from __future__ import annotations

import functools
import json
from pathlib import Path

_ARCH = Path(__file__).resolve().parent / "arch"


@functools.lru_cache(maxsize=None)
def load(name: str) -> dict:
    """name: 'cpu' or 'gpu'. A missing or corrupt file is a RuntimeError naming it and the fix."""
    path = _ARCH / f"{name}.json"
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as e:
        raise RuntimeError(f"hmoe's package data {path} is missing or corrupt ({type(e).__name__}: {e}): "
                           "reinstall hmoe (pip install --force-reinstall --no-deps hmoe)") from None


def gpu_ops() -> list:
    """Every op some CUDA kernel family of arch/gpu.json implements, sorted."""
    return sorted({op for fam in load("gpu").get("kernel_families", {}).values() for op in fam.get("ops", {})})
