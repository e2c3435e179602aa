"""Reads arch/cpu.json and arch/gpu.json as shipped inside the package."""
from __future__ import annotations

import functools
import json
from pathlib import Path

_ARCH = Path(__file__).resolve().parent / "arch"


@functools.lru_cache(maxsize=None)
def load(name: str) -> dict:
    """name: 'cpu' or 'gpu'."""
    return json.loads((_ARCH / f"{name}.json").read_text())
