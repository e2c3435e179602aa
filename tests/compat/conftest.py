"""Fixtures for hmoe.compat tests: a fake NVML, a fake torch/flashinfer probe, clean caches."""
import pytest

from hmoe import _native
from hmoe.compat import probes
from hmoe.hardware import gpu

from ..hardware import fake_nvml


class FakeProbe:
    """Stands in for the torch/flashinfer child process (which takes about a second)."""
    answer = {"torch": {"installed": True, "version": "2.13.0+cpu", "cuda_version": None,
                        "cuda_available": False, "devices": []},
              "flashinfer": {"installed": False}}

    def __init__(self, timeout=120.0, python=None, mla_shapes=()):
        self.mla_shapes = mla_shapes

    def result(self):
        import copy

        return copy.deepcopy(self.answer)


@pytest.fixture
def env(monkeypatch):
    """Returns set(nvml=..., torch=..., flashinfer=...) to describe the machine."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.setattr(_native, "_failed", {})
    monkeypatch.setattr(probes, "PythonProbe", FakeProbe)
    monkeypatch.setattr(FakeProbe, "answer", dict(FakeProbe.answer))

    def set_(nvml=None, torch=None, flashinfer=None):
        if nvml is not None:
            monkeypatch.setattr(gpu, "_NVML_HOOK", nvml)
            gpu.refresh()
        if torch is not None:
            FakeProbe.answer["torch"] = torch
        if flashinfer is not None:
            FakeProbe.answer["flashinfer"] = flashinfer
    set_(nvml=fake_nvml.make([], init_error=fake_nvml.NVMLError_LibraryNotFound))
    yield set_
    gpu.refresh()
