"""Thread count for hmoe's CPU kernels: HMOE_NUM_THREADS or set_num_threads, default = usable cores."""
from __future__ import annotations

import os

from . import _env
from .validation import is_int

# kMaxThreads in cpp/common/thread_pool.h: more threads than this is refused, not clamped.
MAX_THREADS = 1024

_num_threads: int | None = None
_cores: int | None = None  # usable cores: asked once per process (a syscall), again in a forked child


def _forget_cores() -> None:
    global _cores
    _cores = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_cores)


def _usable_cores() -> int:
    global _cores
    if _cores is None:
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            n = os.cpu_count() or 1
        _cores = max(1, n)
    return _cores


def _checked(n, source: str) -> int:
    if not is_int(n) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"{source} must be a positive whole number of threads, at most {MAX_THREADS}, got {n!r} "
                         f"(this process may use {_usable_cores()} cores)")
    return int(n)


def set_num_threads(n: int) -> None:
    """Threads used by hmoe's CPU kernels (the calling thread included), 1 to MAX_THREADS (1024).
    More threads than cores only adds contention; the default is the cores this process may use."""
    global _num_threads
    _num_threads = _checked(n, "set_num_threads: n")


def get_num_threads() -> int:
    if _num_threads is not None:
        return _num_threads
    env = _env.get("HMOE_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = env
        return _checked(n, f"HMOE_NUM_THREADS={env!r}:")
    return _usable_cores()
