"""Loads hmoe's native modules. Before a file is mapped its ELF headers are checked against its size
(a truncated .so from an interrupted install would otherwise kill the process with SIGBUS);
after import, its ABI version, signature table and constants must equal the installed spec
(spec.py: include/hmoe/signatures.h and constants.h); before an op uses it, it is bound to torch
(bind(): torch's DLPack exchange API, through which the module reads and allocates tensors)."""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import struct
import sys
import threading

from . import spec

# Held while a module is imported, checked or bound, and taken by os.fork() before it forks: a fork
# while another thread is inside a load would hand the child this lock and the module's import lock
# held by a thread the child does not have, and the child's first hmoe op would wait forever. So a
# fork waits for a load to finish (re-entrant: a thread that forks inside a load goes through).
_lock = threading.RLock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_lock.release)
_loaded: dict[str, object] = {}
_failed: dict[str, tuple[str, str]] = {}
_bound: dict[str, object] = {}


class NativeModuleError(RuntimeError):
    """A native module is missing, does not load, or does not match this Python package; `kind`
    says which: "missing", "load_error" or "signature_mismatch"."""

    def __init__(self, msg: str, kind: str = "signature_mismatch"):
        super().__init__(msg)
        self.kind = kind


def _fix_hint() -> str:
    return ("reinstall hmoe so that its Python files and native modules come from the same "
            "build: pip install --force-reinstall --no-deps hmoe (or rebuild from source)")


def module_kind(name: str) -> tuple[str, frozenset | None]:
    """(kind in signatures.h, the ops of a CUDA family or None) of hmoe._native.<name>."""
    if name == "cpu_core":
        return "cpu_core", None
    if name.startswith("experts_"):
        return "experts", None
    from .._build_info import _manifest

    family = _manifest().get("cuda_families", {}).get(name) or {}
    return "cuda", frozenset(family.get("ops", ()))


def expected_table(name: str) -> dict[str, str]:
    """The signature table hmoe._native.<name> must export (from the installed spec)."""
    kind, ops = module_kind(name)
    return spec.table(kind, ops)


def file_of(name: str) -> str | None:
    """hmoe._native.<name>'s file, found without importing it; None when absent."""
    found = importlib.machinery.PathFinder.find_spec(f"hmoe._native.{name}", list(__path__))
    return getattr(found, "origin", None) if found is not None else None


def check_file(path: str) -> str | None:
    """None when the ELF file at `path` holds every byte its headers promise, else why not. Reads
    the headers only (a few KB): a file cut short by an interrupted install or a full disk would
    be mapped by the loader and fault (SIGBUS) on its first touch of the missing pages."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            f.seek(0, 2)
            size = f.tell()
            if len(head) < 64 or head[:4] != b"\x7fELF":
                return f"{path} is not an ELF file ({size} bytes)"
            if head[4] != 2 or head[5] != 1:  # 64-bit little-endian: every platform hmoe builds for
                return None
            phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
            if shoff + shnum * shentsize > size or phoff + phnum * phentsize > size:
                return f"{path} is truncated: {size} bytes, its headers reach past the end"
            f.seek(phoff)
            table = f.read(phnum * phentsize)
    except OSError as e:
        return f"{path} cannot be read ({e.strerror})"
    for i in range(phnum):
        offset, filesz = struct.unpack_from("<Q", table, i * phentsize + 8)[0], \
            struct.unpack_from("<Q", table, i * phentsize + 32)[0]
        if offset + filesz > size:
            return f"{path} is truncated: {size} bytes, a segment needs {offset + filesz}"
    return None


def check_module(mod, name: str) -> None:
    """Raise NativeModuleError unless mod exports this package's ABI version, signature table and
    constants (a module from another build differs in at least one)."""
    try:
        abi = mod.abi_version()
        table = dict(mod.signatures())
        consts = dict(mod.constants())
    except Exception as e:  # an old or foreign .so without the table
        raise NativeModuleError(f"hmoe._native.{name} has no usable signature table ({e}); " + _fix_hint()) from None
    try:
        want_consts, want = spec.constants(), expected_table(name)
    except spec.SpecError as e:
        raise NativeModuleError(str(e), "missing") from None
    if abi != want_consts["abi_version"]:
        raise NativeModuleError(f"hmoe._native.{name} has ABI version {abi}, this hmoe expects "
                                f"{want_consts['abi_version']}; " + _fix_hint())
    for fn, sig in want.items():
        if table.get(fn) != sig:
            raise NativeModuleError(f"hmoe._native.{name}: signature of {fn} is {table.get(fn)!r}, expected "
                                    f"{sig!r}; " + _fix_hint())
    for key, value in want_consts.items():
        if consts.get(key) != value:
            raise NativeModuleError(f"hmoe._native.{name}: constant {key} is {consts.get(key)!r}, this hmoe "
                                    f"has {value!r}; " + _fix_hint())


def _fail(name: str, msg: str, kind: str):
    _failed[name] = (msg, kind)
    raise NativeModuleError(msg, kind) from None


def load(name: str):
    """hmoe._native.<name>, imported once and checked (file, ABI, signatures, constants)."""
    mod = _loaded.get(name)
    if mod is not None:
        return mod
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _failed:
            raise NativeModuleError(*_failed[name])
        if f"hmoe._native.{name}" not in sys.modules:  # not mapped yet: its file must be whole first
            path = file_of(name)
            if path is None:
                _fail(name, f"hmoe._native.{name} is not in this installation (see hmoe.build_info() for what "
                            f"the wheel contains); {_fix_hint()}", "missing")
            broken = check_file(path)
            if broken is not None:
                _fail(name, f"hmoe._native.{name} is corrupt: {broken} (an interrupted install?); {_fix_hint()}",
                      "load_error")
        try:
            mod = importlib.import_module(f"hmoe._native.{name}")
        except ImportError as e:
            kind = "missing" if "No module named" in str(e) else "load_error"
            _fail(name, f"hmoe._native.{name} could not be loaded: {e}", kind)
        try:
            check_module(mod, name)
        except NativeModuleError as e:
            _fail(name, str(e), e.kind)
        _loaded[name] = mod
        return mod


def bind(name: str):
    """hmoe._native.<name> loaded and bound to torch (ops call this): the module then reads
    tensors through torch's DLPack exchange API (torch_binding.py)."""
    mod = _bound.get(name)
    if mod is not None:
        return mod
    mod = load(name)
    from . import torch_binding

    with _lock:
        if name not in _bound:
            mod.bind_torch(*torch_binding.args())
            _bound[name] = mod
    return mod


def mark_failed(name: str, msg: str, kind: str = "load_error") -> None:
    """Make every later load of `name` fail with msg (what a crashing child process found)."""
    with _lock:
        if name not in _loaded:
            _failed[name] = (msg, kind)


def is_loaded(name: str) -> bool:
    return name in _loaded
