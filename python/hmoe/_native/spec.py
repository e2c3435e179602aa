"""The native entry points and constants as include/hmoe/signatures.h and constants.h declare them,
read from the copies installed with the package (hmoe/_native/spec/). Python keeps no list of its
own: it checks each module against these files, and takes its constants from them."""
from __future__ import annotations

import functools
import re
from pathlib import Path

_SPEC = Path(__file__).resolve().parent / "spec"


class SpecError(RuntimeError):
    """The installed spec files are missing or unreadable (an incomplete installation)."""


def _text(name: str) -> str:
    path = _SPEC / name
    try:
        # Line continuations joined: every macro is one logical line.
        return path.read_text().replace("\\\n", " ")
    except OSError as e:
        raise SpecError(f"{path} is missing or unreadable ({e.strerror}): hmoe is not completely installed; "
                        "reinstall it (pip install --force-reinstall --no-deps hmoe)") from None


@functools.lru_cache(maxsize=1)
def constants() -> dict[str, int]:
    """name -> value of every HMOE_CONSTANTS entry."""
    found = {m[1]: int(m[2]) for m in re.finditer(r"\bX\((\w+),\s*(-?\d+)\)", _text("constants.h"))}
    if "abi_version" not in found:
        raise SpecError(f"{_SPEC / 'constants.h'} declares no abi_version: it is corrupt; reinstall hmoe")
    return found


def _args(defines: dict[str, str], name: str, seen=()) -> list[tuple[str, str]]:
    """(kind, name) pairs of HMOE_ARGS_<name>, with the macros it names expanded."""
    if name in seen or name not in defines:
        raise SpecError(f"signatures.h: HMOE_ARGS_{name} is undefined or recursive")
    out = []
    for token in re.finditer(r"HMOE_ARGS_(\w+)|\(\s*(\w+)\s*,\s*(\w+)\s*\)", defines[name]):
        out += _args(defines, token[1], seen + (name,)) if token[1] else [(token[2], token[3])]
    return out


@functools.lru_cache(maxsize=1)
def entry_points() -> tuple[tuple[str, str, str, str], ...]:
    """(module kind, op, name, signature) of every entry point; the signature is the string each
    module's signatures() reports: "name(arg:kind, ...) -> returns"."""
    text = _text("signatures.h")
    defines = {m[1]: m[2] for m in re.finditer(r"#define HMOE_ARGS_(\w+)[ \t]*([^\n]*)", text)}
    rows = []
    for m in re.finditer(r'\bX\(\s*(\w+),\s*(\w+),\s*(\w+),\s*"([^"]*)",\s*HMOE_ARGS_(\w+)\s*\)', text):
        kind, op, name, ret, args = m.groups()
        sig = f"{name}({', '.join(f'{n}:{k}' for k, n in _args(defines, args))}) -> {ret}"
        rows.append((kind, op, name, sig))
    if not rows:
        raise SpecError(f"{_SPEC / 'signatures.h'} declares no entry points: it is corrupt; reinstall hmoe")
    return tuple(rows)


def table(kind: str, ops=None) -> dict[str, str]:
    """The signature table a module of `kind` (cpu_core, experts, cuda) must export; for a CUDA
    family, `ops` are the ops it was built with."""
    return {name: sig for k, op, name, sig in entry_points()
            if k == kind and (ops is None or op == "cuda" or op in ops)}
