"""hmoe.compat's environment probes (GPUs, CPU, torch, flashinfer, native modules): each returns
plain JSON data and never raises. Whatever can crash or hang the process runs first in a child
process with a time limit (Child): importing torch and flashinfer, NVML, loading each native
module; the check itself then never does what killed a child."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

from .. import _arch, dispatch

# Runs in the child: everything it learns goes to stdout as one JSON object.
_CHILD = r"""
import json, sys
out = {"torch": {"installed": True}, "flashinfer": {"installed": True}}
def why(e):
    return (f"{type(e).__name__}: {e}".strip().splitlines() or [""])[0][:300]
try:
    import torch
    t = out["torch"]
    t.update(version=str(torch.__version__), cuda_version=torch.version.cuda)
    t["cuda_available"] = bool(torch.cuda.is_available())
    t["devices"] = []
    if t["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            u = getattr(p, "uuid", None)
            t["devices"].append({"ordinal": i, "name": p.name, "cc": [p.major, p.minor],
                                 "uuid": None if u is None else str(u)})
except ModuleNotFoundError as e:
    out["torch"] = {"installed": False} if e.name == "torch" else {"installed": True, "error": why(e)}
except BaseException as e:
    out["torch"]["error"] = why(e)
try:
    import flashinfer
    v = getattr(flashinfer, "__version__", None)
    out["flashinfer"]["version"] = v if isinstance(v, str) else None
except ModuleNotFoundError as e:
    out["flashinfer"] = {"installed": False} if e.name == "flashinfer" else {"installed": True, "error": why(e)}
except BaseException as e:
    out["flashinfer"]["error"] = why(e)
shapes = [tuple(s) for s in json.loads(sys.argv[1])] if len(sys.argv) > 1 else []
if shapes:
    out["plans"] = []
    try:
        import torch
        from hmoe.ops import mla
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except BaseException as e:
        n, broken = 0, why(e)
    else:
        broken = None if n else "no CUDA device torch can use"
    for B, S, H, page in shapes:
        row = {"shape": f"{B}x{S}x{H} page {page}", "variant": None, "reason": None, "plan": None, "error": None}
        if not n:
            out["plans"].append(dict(row, device="-", error=broken))
        for i in range(n):
            try:
                r = mla.route(i, B, H, -(-S // page), page)
                plan = mla.plan(i, B, H, -(-S // page), page).describe()
                out["plans"].append(dict(row, device=f"cuda:{i}", variant=r.variant, reason=r.reason, plan=plan))
            except BaseException as e:
                out["plans"].append(dict(row, device=f"cuda:{i}", error=why(e)))
sys.stdout.write("\n" + json.dumps(out))
"""


TIMEOUT_FIX = "set HMOE_COMPAT_TIMEOUT to a number of seconds > 0 (e.g. 120) or unset it"


def _env_timeout() -> tuple[float | None, str | None]:
    """$HMOE_COMPAT_TIMEOUT: (seconds, None); (None, None) when unset or empty; (None, why) when it is
    not a finite number of seconds > 0 (then every child keeps its default time limit)."""
    text = os.environ.get("HMOE_COMPAT_TIMEOUT")
    if not text:
        return None, None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        return None, (f"HMOE_COMPAT_TIMEOUT={text!r} is not a finite number of seconds > 0: ignored, the check's "
                      "child processes ran with their default time limits")
    return value, None


def timeout_problem() -> str | None:
    """Why $HMOE_COMPAT_TIMEOUT is ignored, or None (unset, or a valid time limit)."""
    return _env_timeout()[1]


def timeout_s(default: float) -> float:
    """A child's time limit: $HMOE_COMPAT_TIMEOUT seconds when set to a valid value, else `default`."""
    value, _ = _env_timeout()
    return default if value is None else value


class Child:
    """`code` run by a Python child started at once (it runs while the check does other work);
    the code prints one JSON object as the last line of its stdout. result() -> (data, None), or
    (None, why) when the child could not start, died (by which signal), exited badly or ran past
    its time limit (then it is killed)."""

    def __init__(self, code: str, timeout: float, python: str | None = None, args=()):
        self.timeout, self.proc, self.error = timeout, None, None
        try:
            self.proc = subprocess.Popen([python or sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        except Exception as e:
            self.error = f"could not start {python or sys.executable}: {e}"

    def result(self) -> tuple[dict | None, str | None]:
        if self.proc is None:
            return None, self.error
        try:
            out, err = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            # a limit the user set is named: it, not the child, may be what is wrong
            user_limit, _ = _env_timeout()
            set_by = f" (HMOE_COMPAT_TIMEOUT={user_limit:g})" if user_limit is not None else ""
            return None, f"took over {self.timeout:g} s{set_by}"
        try:
            return json.loads(out.strip().splitlines()[-1]), None
        except Exception:
            rc = self.proc.returncode
            if rc < 0:
                try:
                    how = f"was killed by signal {-rc} ({signal.Signals(-rc).name})"
                except ValueError:
                    how = f"was killed by signal {-rc}"
            else:
                how = f"exited with status {rc}"
            tail = (err or "").strip().splitlines()[-1:] or [""]
            return None, f"{how} {tail[0][:200]}".strip()


class PythonProbe:
    """torch and flashinfer imported in a child (see Child); with `mla_shapes` ((B, S, H, page),
    ...) the child also finds the variant that runs each (hmoe.ops.mla.route) and its plan on every
    CUDA device (it has torch and a CUDA context; the check itself has neither)."""

    def __init__(self, timeout: float = 120.0, python: str | None = None, mla_shapes=()):
        args = (json.dumps([list(s) for s in mla_shapes]),) if mla_shapes else ()
        self.child = Child(_CHILD, timeout_s(timeout), python, args)

    def result(self) -> dict:
        data, why = self.child.result()
        if data is not None:
            return data
        why = f"importing torch/flashinfer {why}"
        unknown = {"installed": None, "error": why}
        return {"torch": dict(unknown), "flashinfer": dict(unknown)}


_NVML_CHILD = r"""
import json, sys
from hmoe.hardware import gpu
sys.stdout.write("\n" + json.dumps(gpu.query_json()))
"""

_MODULE_CHILD = r"""
import json, sys
from hmoe import _native
try:
    _native.load(sys.argv[1])
    out = {"ok": True}
except _native.NativeModuleError as e:
    out = {"ok": False, "kind": e.kind, "detail": str(e)}
sys.stdout.write("\n" + json.dumps(out))
"""


_MODEL_CHILD = r"""
import json, sys
try:
    from hmoe.nn._load import memory_needs
    out = memory_needs(sys.argv[1])
except Exception as e:  # a path that is no DeepSeek checkpoint, transformers missing: said in the report
    out = {"path": sys.argv[1], "error": f"{type(e).__name__}: {e}"}
sys.stdout.write("\n" + json.dumps(out))
"""


class ModelProbe:
    """--model: what hmoe.nn.load_model(path) would hold (hmoe.nn._load.memory_needs), from the checkpoint's
    config.json, counted in a child (it imports torch and transformers; the check itself does not)."""

    def __init__(self, path: str, timeout: float = 120.0, python: str | None = None):
        self.path = path
        self.child = Child(_MODEL_CHILD, timeout_s(timeout), python, (path,))

    def result(self) -> dict:
        data, why = self.child.result()
        return data if data is not None else {"path": self.path, "error": f"counting it {why}"}


class NvmlProbe:
    """NVML asked in a child: a truncated libnvidia-ml or a driver that never answers costs this
    check a line, not the process."""

    def __init__(self, timeout: float = 30.0):
        self.child = Child(_NVML_CHILD, timeout_s(timeout))

    def result(self) -> dict:
        """hmoe.hardware.gpu.query_json()'s data, or a failed answer that says why."""
        data, why = self.child.result()
        if data is not None:
            return data
        return {"ok": False, "reason": f"NVML (queried in a child process) {why}: the NVIDIA driver's "
                                       "libnvidia-ml is broken or hangs", "gpus": [], "problems": []}


class ModuleProbe:
    """A native module loaded in a child first: a file that crashes its loader (SIGBUS from a
    truncated .so, an initialiser that faults or hangs) fails there, not here."""

    def __init__(self, name: str, timeout: float = 30.0):
        self.name = name
        self.child = Child(_MODULE_CHILD.replace("sys.argv[1]", repr(name)), timeout_s(timeout))

    def crashed(self) -> str | None:
        """Why loading the module would take this process down, or None (it loads, or it fails
        with an ordinary error, which the in-process load reports the same way)."""
        data, why = self.child.result()
        if data is not None:
            return None
        return (f"loading hmoe._native.{self.name} in a child process {why}: the file is corrupt or does "
                "not fit this machine (an interrupted install?)")


def gpu_section(det) -> dict:
    """The JSON form of a hardware.gpu.GpuDetection."""
    ordinal = {}
    for d in det.visible:
        ordinal[id(d.mig) if d.mig is not None else id(d.gpu)] = d.ordinal
    devices = []
    for g in det.gpus:
        devices.append({
            "nvml_index": g.nvml_index, "cuda_ordinal": ordinal.get(id(g)), "uuid": g.uuid,
            "name": g.name, "compute_capability": g.cc, "memory_total_bytes": g.memory_total,
            "pci_bus_id": g.pci_bus_id, "mig_mode": g.mig_mode,
            "mig_devices": [{"uuid": m.uuid, "name": m.name, "memory_total_bytes": m.memory_total,
                             "cuda_ordinal": ordinal.get(id(m))} for m in g.mig_devices],
            "problems": list(g.problems), "simulated": g.simulated})
    cuda = det.driver_cuda
    return {"nvml": det.ok, "reason": det.reason, "driver_version": det.driver_version,
            "driver_cuda": None if cuda is None else f"{cuda[0]}.{cuda[1]}",
            "cuda_visible_devices": det.cuda_visible_devices, "device_order": det.device_order,
            "notes": list(det.notes), "problems": list(det.problems), "devices": devices,
            "simulated": det.simulated}


def cpu_section(info) -> dict:
    """The JSON form of a hardware.cpu.CpuInfo, with the OS's XCR0 state per component."""
    bits = _arch.load("cpu")["processors"].get(info.processor, {}).get("xcr0_bits", {})
    return {"processor": info.processor, "vendor": info.vendor, "model": info.model,
            "features": dict(info.features),
            "xcr0": f"{info.xcr0:#x}" if bits else None,
            "os_support": {name: bool((info.xcr0 >> bit) & 1) for name, bit in bits.items()},
            "amx_permission": info.amx_permission, "simulated": info.simulated, "error": None}


def torch_section(raw: dict, det) -> tuple[dict, list]:
    """torch's part of the report, and (severity, what, fix) problems, against NVML's view."""
    t = dict(raw)
    t.setdefault("version", None)
    t.setdefault("cuda_version", None)
    t.setdefault("cuda_available", None)
    t.setdefault("error", None)
    devs = t.pop("devices", None) or []
    t["devices"] = devs
    t["same_gpus"], t["detail"] = None, ""
    problems = []
    if t["error"]:
        t["detail"] = "fails to import" if t["installed"] else "unknown"
        problems.append(("error", f"torch is broken: {t['error']}",
                         "reinstall torch (pip install --force-reinstall torch)"))
        return t, problems
    if t["installed"] is False:
        t["detail"] = "not installed"
        problems.append(("warning", "torch is not installed: hmoe's ops take torch tensors",
                         "pip install torch (before hmoe; see README)"))
        return t, problems
    if det is None or det.simulated:
        return t, problems
    nv = list(det.visible)
    if nv and t["cuda_version"] is None:
        problems.append(("warning", f"torch {t['version']} is a CPU-only build but this machine has "
                         "NVIDIA GPUs", "install a CUDA build of torch to use hmoe's GPU ops"))
    if t["cuda_version"] and det.driver_cuda is not None:
        tv = dispatch._version(t["cuda_version"])
        if tv[0] > det.driver_cuda[0]:
            problems.append(("warning", f"torch is built for CUDA {t['cuda_version']}, the driver "
                             f"supports {det.driver_cuda[0]}.{det.driver_cuda[1]}",
                             "upgrade the driver or install a torch build for the driver's CUDA"))
    if t["cuda_available"] is None or not det.ok or not t["cuda_version"]:
        return t, problems  # nothing to compare (a CPU-only torch was reported above)
    mine = [((d.mig or d.gpu).uuid or "").lower().removeprefix("gpu-") for d in nv]
    theirs = [(d.get("uuid") or "").lower().removeprefix("gpu-") for d in devs]
    if len(nv) != len(devs):
        t["same_gpus"] = False
        t["detail"] = f"torch sees {len(devs)} CUDA device(s), NVML + CUDA_VISIBLE_DEVICES give {len(nv)}"
    elif all(theirs) and all(mine):
        t["same_gpus"] = all(a.endswith(b) or b.endswith(a) for a, b in zip(mine, theirs))
        t["detail"] = "same UUIDs in the same order" if t["same_gpus"] else "UUIDs differ"
    else:
        t["same_gpus"] = all(tuple(d["cc"]) == v.compute_capability for d, v in zip(devs, nv))
        t["detail"] = "same count and compute capabilities (no UUIDs to compare)"
    if t["same_gpus"] is False:
        problems.append(("warning", f"torch and NVML disagree on the CUDA devices: {t['detail']}",
                         "set CUDA_DEVICE_ORDER=PCI_BUS_ID so both number GPUs the same way"))
    return t, problems


def flashinfer_section(raw: dict) -> tuple[dict, list]:
    f = {"installed": raw.get("installed"), "version": raw.get("version"),
         "error": raw.get("error"), "detail": ""}
    problems = []
    if f["installed"] is False:
        f["detail"] = "not installed"
    elif f["error"] and f["installed"]:
        f["detail"] = "installed, fails to import"
        problems.append(("warning", f"flashinfer is installed but does not import: {f['error']}",
                         "reinstall flashinfer for this torch and CUDA, or uninstall it"))
    elif f["installed"] and not f["version"]:
        f["detail"] = "installed, version unknown"
        problems.append(("warning", "flashinfer imports but reports no version: hmoe will not "
                         "use it", "install a released flashinfer (pip install flashinfer-python)"))
    elif f["installed"]:
        f["detail"] = f"version {f['version']}"
    return f, problems
