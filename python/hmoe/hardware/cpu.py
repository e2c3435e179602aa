"""CPU detection (raw CPUID/XCR0/auxv from the baseline native module, read against arch/cpu.json) and the
host's memory."""
from __future__ import annotations

import dataclasses
import functools
import os
import platform
import struct

from .. import _arch


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    processor: str                 # key into arch/cpu.json "processors"
    vendor: str
    model: str
    features: dict                 # feature name -> bool (names from arch/cpu.json)
    xcr0: int                      # 0 when unknown / not x86
    amx_permission: str | None     # "granted", a reason, or None when not asked
    simulated: bool = False

    def os_enabled(self, bit_names) -> list[str]:
        """The XCR0 state components among bit_names that the OS has NOT enabled."""
        bits = _arch.load("cpu")["processors"][self.processor].get("xcr0_bits", {})
        return [b for b in bit_names if not (self.xcr0 >> bits[b]) & 1]


def processor() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _brand(core) -> tuple[str, str]:
    vendor_regs = core.cpuid(0, 0)
    vendor = struct.pack("<III", vendor_regs[1], vendor_regs[3], vendor_regs[2]).decode(
        "ascii", "replace").strip("\0")
    parts = []
    if core.cpuid(0x80000000, 0)[0] >= 0x80000004:
        for leaf in (0x80000002, 0x80000003, 0x80000004):
            parts.append(struct.pack("<IIII", *core.cpuid(leaf, 0)))
    model = b"".join(parts).decode("ascii", "replace").strip("\0").strip()
    return vendor, model


@functools.lru_cache(maxsize=2)
def cpu_info(request_amx: bool = False) -> CpuInfo:
    """This machine's CPU. With request_amx, asks the kernel for AMX tile permission (a
    per-process, one-way grant) when the CPU has AMX."""
    from .._native import load

    proc = processor()
    table = _arch.load("cpu")["processors"].get(proc)
    if table is None:
        return CpuInfo(proc, "unknown", platform.processor(), {}, 0, None)
    core = load("cpu_core")
    features = {}
    if proc == "x86_64":
        leaves = {}
        for name, (leaf, sub, reg, bit) in table["features"].items():
            regs = leaves.setdefault((leaf, sub), core.cpuid(leaf, sub))
            features[name] = bool((regs["eax ebx ecx edx".split().index(reg)] >> bit) & 1)
        vendor, model = _brand(core)
        xcr0 = core.xcr0()
        amx = None
        if request_amx and features.get("amx_tile"):
            amx = core.request_amx_permission()
        return CpuInfo(proc, vendor, model, features, xcr0, amx)
    hw = core.hwcap()
    for name, (word, bit) in table["features"].items():
        features[name] = bool((hw[0 if word == "hwcap" else 1] >> bit) & 1)
    return CpuInfo(proc, "unknown", platform.processor() or proc, features, 0, None)


def levels(proc: str | None = None) -> list[dict]:
    """ISA levels of a processor from arch/cpu.json, lowest first."""
    return _arch.load("cpu")["processors"].get(proc or processor(), {}).get("levels", [])


def missing_requirements(level: dict, info: CpuInfo) -> list[str]:
    """What `info` lacks to run `level` (empty when it can run it)."""
    req = level.get("requires", {})
    missing = [f"cpuid:{f}" for f in req.get("cpuid", []) if not info.features.get(f)]
    missing += [f"hwcap:{f}" for f in req.get("hwcap", []) if not info.features.get(f)]
    if req.get("xcr0"):
        missing += [f"os-xsave:{b}" for b in info.os_enabled(req["xcr0"])]
    perm = req.get("permission")
    if perm == "amx_tiledata" and not missing and info.amx_permission != "granted":
        missing.append(f"permission:amx_tiledata ({info.amx_permission or 'not requested'})")
    return missing


def simulated(level_name: str, proc: str | None = None) -> CpuInfo:
    """A CPU that has exactly what `level_name` requires (for compat --simulate-cpu)."""
    proc = proc or processor()
    lv = {lv["name"]: lv for lv in levels(proc)}
    if level_name not in lv:
        raise ValueError(f"unknown ISA level {level_name!r} for {proc}; known: {sorted(lv)}")
    req = lv[level_name].get("requires", {})
    feats = {f: True for f in req.get("cpuid", []) + req.get("hwcap", [])}
    bits = _arch.load("cpu")["processors"][proc].get("xcr0_bits", {})
    xcr0 = sum(1 << bits[b] for b in req.get("xcr0", []))
    perm = "granted" if req.get("permission") else None
    return CpuInfo(proc, "simulated", f"simulated {level_name}", feats, xcr0, perm, True)


def mem_available_bytes() -> int:
    """What this process can allocate without swapping, bytes: MemAvailable from /proc/meminfo, or less where
    its memory cgroup's limit leaves less (a container's: /proc/meminfo shows the host's); 0 if unknown."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not avail:
        try:  # non-Linux fallback: free pages are a lower bound of what is available
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 0
    room = cgroup_room()
    return avail if room is None or (avail and avail < room) else room


# cgroup v1 writes "no limit" as the largest page multiple below 2^63
_NO_LIMIT = 1 << 62


def _read_int(path: str, key: str | None = None) -> int | None:
    """The integer in file `path` (None for v2's "max" or an unreadable file), or key's value in a stat file."""
    try:
        with open(path) as f:
            if key is None:
                text = f.read().strip()
                return None if text == "max" else int(text)
            for line in f:
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    except (OSError, ValueError):
        pass
    return None


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroups let it take still: the least over its group and the groups above
    it of limit - usage, the reclaimable inactive page cache not counted as used (cgroup v2 memory.max /
    memory.current / memory.stat inactive_file; v1 memory.limit_in_bytes / memory.usage_in_bytes /
    total_inactive_file). None where no limit applies or none can be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if ctrls == "":  # v2: one hierarchy at the root
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in ctrls.split(","):
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                         "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        # the group and those above it; in a container whose cgroup namespace hides the path, the group is
        # mounted at the root, where the walk ends too
        for depth in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:depth])
            limit = _read_int(os.path.join(d, files[0]))
            if limit is None or limit >= _NO_LIMIT:
                continue
            usage = _read_int(os.path.join(d, files[1]))
            if usage is None:
                continue
            inactive = _read_int(os.path.join(d, "memory.stat"), files[2]) or 0
            rooms.append(max(0, limit - max(0, usage - inactive)))
    return min(rooms) if rooms else None


def mem_total_bytes() -> int:
    """Physical memory, bytes; 0 if unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
