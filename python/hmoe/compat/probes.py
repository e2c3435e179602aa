"""hmoe.compat's environment probes (GPUs, CPU, torch, flashinfer): each returns plain JSON data
and never raises; torch and flashinfer are imported in a child process so that a broken or
crashing install, or a slow import, cannot take the check down or create a CUDA context here."""
from __future__ import annotations

import json
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
sys.stdout.write("\n" + json.dumps(out))
"""


class PythonProbe:
    """Starts the torch/flashinfer child at once, so it runs while the other probes do."""

    def __init__(self, timeout: float = 120.0, python: str | None = None):
        self.timeout = timeout
        self.proc = None
        self.error = None
        try:
            self.proc = subprocess.Popen([python or sys.executable, "-c", _CHILD],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         stdin=subprocess.DEVNULL, text=True)
        except Exception as e:
            self.error = f"could not start {python or sys.executable}: {e}"

    def result(self) -> dict:
        unknown = {"installed": None, "error": None}
        if self.proc is None:
            return {"torch": dict(unknown, error=self.error),
                    "flashinfer": dict(unknown, error=self.error)}
        try:
            out, err = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            why = f"importing torch/flashinfer took over {self.timeout:.0f} s"
            return {"torch": dict(unknown, error=why), "flashinfer": dict(unknown, error=why)}
        try:
            return json.loads(out.strip().splitlines()[-1])
        except Exception:
            rc = self.proc.returncode
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
            tail = (err or "").strip().splitlines()[-1:] or [""]
            why = f"importing torch/flashinfer {how} {tail[0][:200]}".strip()
            return {"torch": dict(unknown, error=why), "flashinfer": dict(unknown, error=why)}


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
