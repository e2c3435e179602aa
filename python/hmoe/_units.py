"""Byte counts as people read them (torch-free: hmoe.compat's report renders with it too)."""
from __future__ import annotations


def size_text(nbytes: int) -> str:
    """nbytes in the largest of GiB, MiB, KiB it reaches (two decimals), else in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
