"""Helpers shared by the benchmarks: progress on stderr, the table header, argparse types that
reject bad option values at parse time (exit status 2, one line naming the option and the rule)."""
from __future__ import annotations

import argparse
import os
import sys


def progress(msg: str) -> None:
    print(f"[hmoe.bench] {msg}", file=sys.stderr, flush=True)


def table_header(columns) -> str:
    """Titles padded to their widths (each column: (title, width, ...)), then a rule."""
    head = "  ".join(f"{c[0]:<{c[1]}}" for c in columns).rstrip()
    return head + "\n" + "-" * len(head)


def int_range(low: int = 1, high: int | None = None, note: str = ""):
    """An argparse type: a whole number in low..high (no upper bound when high is None); anything
    else is an argparse error that states the rule, with `note` (why the rule) after it."""
    rule = (f"a whole number from {low} to {high}" if high is not None
            else "a positive whole number" if low == 1 else f"a whole number >= {low}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {rule}{note}, got {text!r}")
        return value

    return parse


positive_int = int_range(1)


def output_file(text: str) -> str:
    """An argparse type for a file written at the end of a run (--json PATH): checked when the
    options are parsed, so a path that cannot be written fails at once, not after the whole run."""
    parent = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        why = "it is a directory"
    elif not os.path.isdir(parent):
        why = f"the directory {parent} does not exist" if not os.path.exists(parent) else f"{parent} is not a directory"
    elif os.path.exists(text) and not os.access(text, os.W_OK):
        why = "the file is not writable"
    elif not os.path.exists(text) and not os.access(parent, os.W_OK | os.X_OK):
        why = f"the directory {parent} is not writable"
    else:
        return text
    raise argparse.ArgumentTypeError(f"cannot write {text!r}: {why}")
