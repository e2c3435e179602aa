"""Thread count for hmoe's CPU kernels: HMOE_NUM_THREADS or set_num_threads, default = usable cores."""
from __future__ import annotations

import os

_num_threads: int | None = None


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def set_num_threads(n: int) -> None:
    """Threads used by hmoe's CPU kernels (the calling thread included)."""
    global _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"set_num_threads: n must be a positive int, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    if _num_threads is not None:
        return _num_threads
    env = os.environ.get("HMOE_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"HMOE_NUM_THREADS={env!r} is not a positive integer") from None
        if n < 1:
            raise ValueError(f"HMOE_NUM_THREADS={env!r} is not a positive integer")
        return n
    return _usable_cores()
