"""hmoe.hardware.gpu with a fake NVML: queries, failures, CUDA_VISIBLE_DEVICES, ordering, MIG."""
import sys

import pytest

from hmoe.hardware import gpu

from . import fake_nvml as F


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    yield
    gpu.refresh()


def detect(monkeypatch, nvml, cvd=None, order=None):
    if cvd is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    if order is not None:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    return gpu.detect(_nvml=nvml)


def uuids(det):
    return [(d.mig or d.gpu).uuid for d in det.visible]


def test_basic_fields(monkeypatch):
    det = detect(monkeypatch, F.make([F.H200], cuda=12080, driver="570.124.06"))
    assert det.ok and det.reason is None and not det.problems
    assert det.driver_version == "570.124.06" and det.driver_cuda == (12, 8)
    (g,) = det.gpus
    assert (g.nvml_index, g.name, g.uuid, g.compute_capability, g.cc) == (
        0, "NVIDIA H200", F.H200["uuid"], (9, 0), "9.0")
    assert g.memory_total == 141 << 30 and g.mig_mode is False and g.pci_bus_id == "00000000:19:00.0"
    assert det.by_ordinal(0).gpu is g and det.by_ordinal(1) is None
    assert det.by_ordinal(0).label == "cuda:0 (NVIDIA H200, 9.0)"


def test_no_torch_imported_and_nvml_shut_down(monkeypatch):
    nvml = F.make([F.H200])
    had_torch = "torch" in sys.modules
    detect(monkeypatch, nvml)
    assert nvml.calls[0] == "nvmlInit" and nvml.calls[-1] == "nvmlShutdown"
    assert ("torch" in sys.modules) == had_torch


@pytest.mark.parametrize("err, words", [
    (F.NVMLError_LibraryNotFound, "libnvidia-ml.so.1 not found"),
    (F.NVMLError_DriverNotLoaded, "driver is not loaded"),
    (F.NVMLError_LibRmVersionMismatch, "different versions"),
    (F.NVMLError_NoPermission, "no permission"),
    (F.NVMLError_Unknown, "NVML could not start: NVMLError_Unknown"),
])
def test_init_failures_become_reasons(monkeypatch, err, words):
    det = detect(monkeypatch, F.make([F.H200], init_error=err))
    assert not det.ok and words in det.reason and det.gpus == () and det.visible == ()


def test_real_pynvml_without_library():
    # This machine has nvidia-ml-py but no libnvidia-ml: the real module must say so.
    pytest.importorskip("pynvml")
    det = gpu.detect(refresh=True)
    if det.ok:
        pytest.skip("this machine has a working NVML")
    assert det.reason and det.visible == ()


def test_pynvml_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    gpu.refresh()
    det = gpu.detect()
    assert not det.ok and "pip install nvidia-ml-py" in det.reason


def test_hook_is_used_and_cached(monkeypatch):
    nvml = F.make([F.A100])
    monkeypatch.setattr(gpu, "_NVML_HOOK", nvml)
    gpu.refresh()
    assert gpu.detect().gpus[0].name == F.A100["name"]
    n = len(nvml.calls)
    gpu.detect()
    assert len(nvml.calls) == n  # cached
    gpu.detect(refresh=True)
    assert len(nvml.calls) > n


@pytest.mark.parametrize("fn", [
    "nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion_v2", "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName", "nvmlDeviceGetUUID",
    "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetMigMode", "nvmlDeviceGetNumGpuCores", "nvmlShutdown",
    "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetGpuInstanceId"])
def test_each_query_failing_is_a_line(monkeypatch, fn):
    det = detect(monkeypatch, F.make([F.H200, F.mig_a100()], fail={fn: F.NVMLError_Unknown}))
    assert det.ok
    lines = list(det.problems) + [p for g in det.gpus for p in g.problems]
    if fn in ("nvmlDeviceGetNumGpuCores", "nvmlShutdown"):
        assert lines == []  # optional / harmless
    else:
        assert lines and all("NVMLError_Unknown" in ln for ln in lines)
    if fn == "nvmlDeviceGetMigMode":
        assert all(g.mig_mode is None for g in det.gpus)


def test_missing_function_in_old_binding(monkeypatch):
    nvml = F.make([F.H200])
    del nvml.nvmlSystemGetCudaDriverVersion_v2
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 12020
    assert detect(monkeypatch, nvml).driver_cuda == (12, 2)
    del nvml.nvmlDeviceGetCudaComputeCapability
    det = detect(monkeypatch, nvml)
    assert det.gpus[0].compute_capability is None
    assert "no nvmlDeviceGetCudaComputeCapability" in det.gpus[0].problems[0]


def test_bytes_from_old_bindings(monkeypatch):
    nvml = F.make([dict(F.H200, name=b"NVIDIA H200", uuid=F.H200["uuid"].encode())])
    g = detect(monkeypatch, nvml).gpus[0]
    assert g.name == "NVIDIA H200" and g.uuid == F.H200["uuid"]


THREE = [F.H200, F.A100, F.L40]  # NVML order here is deliberately not PCI order


@pytest.mark.parametrize("cvd, order, expect", [
    (None, "PCI_BUS_ID", ["A100", "L40", "H200"]),
    (None, None, ["H200", "L40", "A100"]),           # FASTEST_FIRST approximation
    ("0,2", "PCI_BUS_ID", ["A100", "H200"]),
    ("2,0", "PCI_BUS_ID", ["H200", "A100"]),
    ("1", None, ["L40"]),
    (" 1 , 0", "PCI_BUS_ID", ["L40", "A100"]),
    ("1abc", "PCI_BUS_ID", ["L40"]),                  # CUDA reads indices like strtoul
    ("", None, []),
    ("0,7,1", "PCI_BUS_ID", ["A100"]),                # an invalid entry ends the list
    ("-1", None, []),
    ("0,foo,1", "PCI_BUS_ID", ["A100"]),
    ("0,0", None, []),                                # a duplicate hides every device
    ("GPU-8932f937", None, ["H200"]),                 # unique UUID prefix
    ("GPU-2222bbbb-0000-0000-0000-000000000002,GPU-8932", None, ["L40", "H200"]),
    ("gpu-8932F937", None, ["H200"]),
    ("GPU-", None, []),                               # ambiguous prefix
    ("GPU-dead,0", None, []),                         # unknown UUID ends the list
    ("0,GPU-8932f937", None, []),                     # index 0 is the H200 too: duplicate
    ("1,GPU-1111", "PCI_BUS_ID", ["L40", "A100"]),    # mixed forms
])
def test_cuda_visible_devices(monkeypatch, cvd, order, expect):
    det = detect(monkeypatch, F.make(THREE), cvd=cvd, order=order)
    names = [d.gpu.name.split()[1].split("-")[0] for d in det.visible]
    assert names == expect
    assert [d.ordinal for d in det.visible] == list(range(len(expect)))
    if cvd is not None and len(expect) < len([x for x in cvd.split(",") if x.strip()]):
        assert det.notes  # a truncation, an empty list or a duplicate is explained


def test_invalid_entry_note(monkeypatch):
    det = detect(monkeypatch, F.make(THREE), cvd="0,7,1")
    assert any("'7'" in n and "every entry after it" in n for n in det.notes)
    det = detect(monkeypatch, F.make(THREE), cvd="0,0")
    assert any("twice" in n for n in det.notes)
    det = detect(monkeypatch, F.make(THREE), cvd="")
    assert any("empty" in n for n in det.notes)


def test_ordinal_of_and_unknown_order(monkeypatch):
    det = detect(monkeypatch, F.make(THREE), cvd="2", order="PCI_BUS_ID")
    assert det.ordinal_of(det.gpus[0]) == [0] and det.ordinal_of(det.gpus[1]) == []
    det = detect(monkeypatch, F.make(THREE), order="SLOWEST_FIRST")
    assert det.device_order == "FASTEST_FIRST" and any("SLOWEST_FIRST" in n for n in det.notes)


def test_fastest_first_ties_keep_pci_order(monkeypatch):
    a = dict(F.H200, uuid="GPU-a", bus="00000000:02:00.0")
    b = dict(F.H200, uuid="GPU-b", bus="00000000:01:00.0")
    assert uuids(detect(monkeypatch, F.make([a, b]))) == ["GPU-b", "GPU-a"]


def test_mig(monkeypatch):
    mig = F.mig_a100()
    det = detect(monkeypatch, F.make([mig]))
    g = det.gpus[0]
    assert g.mig_mode is True and len(g.mig_devices) == 2
    assert g.mig_devices[0].memory_total == 40 << 30 and g.mig_devices[1].gpu_instance_id == 2
    # CUDA enumerates one MIG device per process.
    assert uuids(det) == [mig["mig"][0]["uuid"]]
    assert any("one MIG device" in n for n in det.notes)
    assert det.by_ordinal(0).label.startswith("cuda:0 (NVIDIA A100-SXM4-80GB MIG 3g.40gb, 8.0")


@pytest.mark.parametrize("cvd, expect", [
    ("MIG-f2b5fbbd-850e-51bb-8ffa-ac9fb48126da", [1]),
    ("MIG-f2b5fbbd-850e-51bb-8ffa-ac9fb48126da,MIG-89c850dc-38e3-57df-85c7-690c186b68e9", [1]),
    ("MIG-GPU-3333cccc-0000-0000-0000-000000000003/1/0", [0]),
    ("MIG-GPU-3333cccc-0000-0000-0000-000000000003/5/0", []),
    ("MIG-00000000", []),
    ("0", [0]),
])
def test_mig_uuids_in_cuda_visible_devices(monkeypatch, cvd, expect):
    mig = F.mig_a100()
    det = detect(monkeypatch, F.make([mig]), cvd=cvd)
    assert uuids(det) == [mig["mig"][i]["uuid"] for i in expect]


def test_mig_gpu_without_instances_and_mixed(monkeypatch):
    empty = dict(F.mig_a100(), mig=[])
    det = detect(monkeypatch, F.make([empty, F.H200]), order="PCI_BUS_ID")
    assert [d.gpu.name for d in det.visible] == ["NVIDIA H200"]
    assert any("MIG mode without MIG devices" in n for n in det.notes)


@pytest.mark.parametrize("text, cc", [("8.6", (8, 6)), ("86", (8, 6)), ("sm_90", (9, 0)),
                                      ("10.0", (10, 0)), ("100", (10, 0)), ("120", (12, 0)),
                                      ("9.0a", (9, 0)), ((7, 5), (7, 5))])
def test_parse_cc(text, cc):
    assert gpu.parse_cc(text) == cc


@pytest.mark.parametrize("bad", ["", "x", "8.", "8.6.1"])
def test_parse_cc_rejects(bad):
    with pytest.raises(ValueError, match="compute capability"):
        gpu.parse_cc(bad)


def test_simulated():
    det = gpu.simulated("8.6", "10.0", driver_cuda=(12, 2))
    assert det.simulated and det.driver_cuda == (12, 2)
    assert [d.compute_capability for d in det.visible] == [(8, 6), (10, 0)]
    assert gpu.simulated("9.0").by_ordinal(0).gpu.simulated


def test_malformed_answer_is_a_line(monkeypatch):
    det = detect(monkeypatch, F.make([dict(F.H200, cc="nine"), F.A100]))
    assert det.gpus[0].compute_capability is None and det.gpus[0].problems
    assert det.gpus[1].compute_capability == (8, 0)
