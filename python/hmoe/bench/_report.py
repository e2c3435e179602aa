"""Output helpers shared by the benchmarks: progress on stderr, the table header."""
from __future__ import annotations

import sys


def progress(msg: str) -> None:
    print(f"[hmoe.bench] {msg}", file=sys.stderr, flush=True)


def table_header(columns) -> str:
    """Titles padded to their widths (each column: (title, width, ...)), then a rule."""
    head = "  ".join(f"{c[0]:<{c[1]}}" for c in columns).rstrip()
    return head + "\n" + "-" * len(head)
