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


def reader(*names: str):
    """A function that returns the current values of `names` as one tuple (bytes or None on POSIX,
    str or None elsewhere), at a dict lookup each: the key of a cache of what those variables
    decide, for an op that consults several of them on every call."""
    if _DATA is None:
        return lambda: tuple(os.environ.get(n) for n in names)
    keys = tuple(os.fsencode(n) for n in names)
    get = _DATA.get
    return lambda: tuple(map(get, keys))
