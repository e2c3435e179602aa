"""Loads hmoe's native modules and checks their ABI version and signature table first."""
from __future__ import annotations

import importlib
import threading

# Must equal HMOE_ABI_VERSION in cpp/common/abi.h.
ABI_VERSION = 1

_lock = threading.Lock()
_loaded: dict[str, object] = {}
_failed: dict[str, str] = {}


class NativeModuleError(RuntimeError):
    """A native module is missing, does not load, or does not match this Python package; `kind`
    says which: "missing", "load_error" or "signature_mismatch"."""

    def __init__(self, msg: str, kind: str = "signature_mismatch"):
        super().__init__(msg)
        self.kind = kind


def _fix_hint() -> str:
    return ("reinstall hmoe so that its Python files and native modules come from the same "
            "build: pip install --force-reinstall --no-deps hmoe (or rebuild from source)")


def check_module(mod, name: str, expected: dict[str, str]) -> None:
    """Raise NativeModuleError unless mod exports our ABI version and the expected signatures."""
    try:
        abi = mod.abi_version()
        table = dict(mod.signatures())
    except Exception as e:  # an old or foreign .so without the table
        raise NativeModuleError(f"hmoe._native.{name} has no usable signature table ({e}); "
                                + _fix_hint()) from None
    if abi != ABI_VERSION:
        raise NativeModuleError(f"hmoe._native.{name} has ABI version {abi}, this hmoe expects "
                                f"{ABI_VERSION}; " + _fix_hint())
    for fn, sig in expected.items():
        got = table.get(fn)
        if got != sig:
            raise NativeModuleError(
                f"hmoe._native.{name}: signature of {fn} is {got!r}, expected {sig!r}; "
                + _fix_hint())


def load(name: str, expected: dict[str, str]):
    """Import hmoe._native.<name> once, validated against `expected` (function -> signature)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _failed:
            raise NativeModuleError(*_failed[name])
        try:
            mod = importlib.import_module(f"hmoe._native.{name}")
        except ImportError as e:
            kind, msg = "load_error", f"hmoe._native.{name} could not be loaded: {e}"
            if "No module named" in str(e):
                kind, msg = "missing", (f"hmoe._native.{name} is not in this installation (see "
                                        f"hmoe.build_info() for what the wheel contains); {_fix_hint()}")
            _failed[name] = (msg, kind)
            raise NativeModuleError(msg, kind) from None
        try:
            check_module(mod, name, expected)
        except NativeModuleError as e:
            _failed[name] = (str(e), e.kind)
            raise
        _loaded[name] = mod
        return mod


def is_loaded(name: str) -> bool:
    return name in _loaded
