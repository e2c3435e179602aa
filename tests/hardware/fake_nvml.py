"""A fake pynvml module for CPU-only tests: GPUs from plain dicts, failures on demand."""
from __future__ import annotations

import types


class NVMLError(Exception):
    text = "Unknown Error"

    def __str__(self):
        return self.text


def _err(name, text):
    return type(name, (NVMLError,), {"text": text})


NVMLError_LibraryNotFound = _err("NVMLError_LibraryNotFound", "NVML Shared Library Not Found")
NVMLError_DriverNotLoaded = _err("NVMLError_DriverNotLoaded", "Driver Not Loaded")
NVMLError_NotSupported = _err("NVMLError_NotSupported", "Not Supported")
NVMLError_NotFound = _err("NVMLError_NotFound", "Not Found")
NVMLError_Unknown = _err("NVMLError_Unknown", "Unknown Error")
NVMLError_NoPermission = _err("NVMLError_NoPermission", "Insufficient Permissions")
NVMLError_LibRmVersionMismatch = _err("NVMLError_LibRmVersionMismatch",
                                      "RM has detected an NVML/RM version mismatch.")
NVMLError_InvalidArgument = _err("NVMLError_InvalidArgument", "Invalid Argument")

H200 = {"name": "NVIDIA H200", "uuid": "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "cc": (9, 0),
        "mem": 141 << 30, "bus": "00000000:19:00.0", "cores": 16896}
A100 = {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-1111aaaa-0000-0000-0000-000000000001",
        "cc": (8, 0), "mem": 80 << 30, "bus": "00000000:07:00.0", "cores": 6912}
L40 = {"name": "NVIDIA L40", "uuid": "GPU-2222bbbb-0000-0000-0000-000000000002", "cc": (8, 9),
       "mem": 48 << 30, "bus": "00000000:0B:00.0", "cores": 18176}


def make(gpus=(), *, driver="580.65.06", cuda=13000, init_error=None, fail=None):
    """A module object with pynvml's names. gpus: dicts like H200 above (add "mig": [dict(uuid,
    name, mem, gi, ci), ...] for MIG mode); fail: {function name: exception class} raised by
    every call of that function; init_error: exception class nvmlInit raises."""
    fail = dict(fail or {})
    m = types.ModuleType("fake_pynvml")
    for k, v in globals().items():
        if k.startswith("NVMLError"):
            setattr(m, k, v)
    m.calls = []

    def fn(name, impl):
        def call(*a):
            m.calls.append(name)
            if name in fail:
                raise fail[name]()
            return impl(*a)
        setattr(m, name, call)

    def gpu(h):
        kind, i, j = h
        g = gpus[i]
        return g if kind == "gpu" else g["mig"][j]

    def init():
        if init_error is not None:
            raise init_error()

    fn("nvmlInit", init)
    fn("nvmlShutdown", lambda: None)
    fn("nvmlSystemGetDriverVersion", lambda: driver)
    fn("nvmlSystemGetCudaDriverVersion_v2", lambda: cuda)
    fn("nvmlDeviceGetCount", lambda: len(gpus))
    fn("nvmlDeviceGetHandleByIndex", lambda i: ("gpu", i, None))
    fn("nvmlDeviceGetName", lambda h: gpu(h)["name"])
    fn("nvmlDeviceGetUUID", lambda h: gpu(h)["uuid"])
    fn("nvmlDeviceGetCudaComputeCapability", lambda h: gpu(h)["cc"])
    fn("nvmlDeviceGetMemoryInfo", lambda h: types.SimpleNamespace(total=gpu(h)["mem"]))
    fn("nvmlDeviceGetPciInfo", lambda h: types.SimpleNamespace(busId=gpu(h)["bus"]))
    fn("nvmlDeviceGetNumGpuCores", lambda h: gpu(h)["cores"])

    def mig_mode(h):
        if "mig" not in gpu(h):
            raise NVMLError_NotSupported()
        return (1, 1)

    def mig_handle(h, j):
        if j >= len(gpu(h)["mig"]):
            raise NVMLError_NotFound()
        return ("mig", h[1], j)

    fn("nvmlDeviceGetMigMode", mig_mode)
    fn("nvmlDeviceGetMaxMigDeviceCount", lambda h: 7)
    fn("nvmlDeviceGetMigDeviceHandleByIndex", mig_handle)
    fn("nvmlDeviceGetGpuInstanceId", lambda h: gpu(h)["gi"])
    fn("nvmlDeviceGetComputeInstanceId", lambda h: gpu(h)["ci"])
    return m


def mig_a100(uuid_suffix="3"):
    """An A100 in MIG mode with two 3g.40gb devices."""
    g = dict(A100, uuid=f"GPU-3333cccc-0000-0000-0000-00000000000{uuid_suffix}",
             bus=f"00000000:4{uuid_suffix}:00.0")
    g["mig"] = [
        {"name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "uuid": "MIG-89c850dc-38e3-57df-85c7-690c186b68e9",
         "mem": 40 << 30, "gi": 1, "ci": 0},
        {"name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "uuid": "MIG-f2b5fbbd-850e-51bb-8ffa-ac9fb48126da",
         "mem": 40 << 30, "gi": 2, "ci": 0},
    ]
    return g
