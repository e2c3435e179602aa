#!/usr/bin/env python3
"""Prints one of the README's two commands (the bash blocks under '## The two commands'), so that
.ci/run executes exactly what a new user copies, never a second copy of it.

    usage: python3 ci/readme_commands.py N [README]     (N = 1: install and main job, 2: tests)
"""
from __future__ import annotations

import sys
from pathlib import Path

HEADING = "## The two commands"


def commands(text: str) -> list[str]:
    """The bash code blocks of the section under HEADING, in order."""
    lines = text.splitlines()
    try:
        start = lines.index(HEADING) + 1
    except ValueError:
        raise SystemExit(f"readme_commands: README has no '{HEADING}' section") from None
    blocks, current = [], None
    for line in lines[start:]:
        if line.startswith("## "):
            break
        if current is None and line.strip() == "```bash":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current).strip())
            current = None
        elif current is not None:
            current.append(line)
    if current is not None:
        raise SystemExit("readme_commands: an unterminated code block in the two-commands section")
    return blocks


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("1", "2"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    readme = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "README.md"
    blocks = commands(readme.read_text())
    if len(blocks) != 2 or not all(blocks):
        print(f"readme_commands: expected two non-empty bash blocks under '{HEADING}', found "
              f"{len(blocks)}", file=sys.stderr)
        return 1
    print(blocks[int(argv[0]) - 1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
