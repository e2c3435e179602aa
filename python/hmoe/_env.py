"""hmoe's environment variables, read on every call at the cost of a dict lookup: ops consult
them per call (HMOE_CPU_ISA, HMOE_CUDA_VARIANT, ...) and os.environ.get costs ~1 us each."""
from __future__ import annotations

import os

# On POSIX, os.environ keeps its contents in the bytes-keyed dict `_data` (CPython since 3.2) and
# updates it on every assignment and deletion made through os.environ (what users and tests do).
_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_KEYS: dict[str, bytes] = {}


def get(name: str) -> str | None:
    """os.environ.get(name), without the encoding round trip."""
    if _DATA is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.fsencode(name)
    value = _DATA.get(key)
    return None if value is None else os.fsdecode(value)
