"""GPU dispatch decisions on simulated devices, forcing, and load-time signature checks."""
import itertools
import sys
import types

import pytest

from hmoe import _native, dispatch
from hmoe._native import spec
from hmoe.hardware import gpu

from .hardware import fake_nvml as F

ABI = spec.constants()["abi_version"]
_names = itertools.count()


def kernels(*families, mod=None):
    """A manifest fragment as CMake writes it (mod: family -> native module name)."""
    mod = mod or {}
    table = {"portable": {"sass": ["80", "89", "90"], "ptx": ["90"]},
             "sm90a": {"sass": ["90a"], "ptx": []}}
    return {f: dict(table[f], op="mla_decode", family=f,
                    module=f"hmoe._native.{mod.get(f, 'not_loaded_' + f)}") for f in families}


BOTH = kernels("portable", "sm90a")


def sel(cc, driver=(13, 0), k=BOTH, **kw):
    kw.setdefault("load_module", False)
    kw.setdefault("build_cuda", "13.0.88")
    return dispatch.select_gpu("mla_decode", cc=cc, driver_cuda=driver,
                               device_label="cuda:0", kernels=k, **kw)


@pytest.mark.parametrize("cc, variant, target, reason", [
    ("8.0", "portable", "sm_80", "native: sm_80 SASS"),
    ("8.6", "portable", "sm_80", "fallback: sm_80 SASS on 8.6 (same major)"),
    ("8.7", "portable", "sm_80", "fallback: sm_80 SASS on 8.7 (same major)"),
    ("8.9", "portable", "sm_89", "native: sm_89 SASS"),
    ("9.0", "sm90a", "sm_90a", "native: sm_90a SASS"),
    ("10.0", "portable", "compute_90", "fallback: PTX JIT (compute_90) on 10.0"),
    ("12.0", "portable", "compute_90", "fallback: PTX JIT (compute_90) on 12.0"),
])
def test_decisions(cc, variant, target, reason):
    s = sel(cc)
    assert (s.variant, s.target, s.reason, s.device) == (variant, target, reason, "cuda:0")
    assert s.module == f"not_loaded_{variant}"


def test_portable_only_on_hopper():
    assert sel("9.0", k=kernels("portable")).reason == "native: sm_90 SASS"


def test_simulated_devices_through_detection():
    det = gpu.simulated("8.6", "9.0", "10.0")
    got = [sel(d.compute_capability, det.driver_cuda).reason for d in det.visible]
    assert got == ["fallback: sm_80 SASS on 8.6 (same major)", "native: sm_90a SASS",
                   "fallback: PTX JIT (compute_90) on 10.0"]


def test_unsupported():
    with pytest.raises(dispatch.NoGpuVariant) as e:
        sel("7.5")
    assert e.value.reason == "unsupported: 7.5 < 8.0" and "CPU" in e.value.fix
    assert isinstance(e.value, RuntimeError)


def test_driver_too_old():
    with pytest.raises(dispatch.NoGpuVariant) as e:
        sel("9.0", driver=(12, 2))
    assert e.value.reason == ("driver too old: it supports CUDA 12.2, this build needs 13.0: "
                              "upgrade the driver to 580.65.06 or newer, or install the cu12 wheel")
    assert e.value.fix == "upgrade the driver to 580.65.06 or newer, or install the cu12 wheel"
    assert str(e.value) == e.value.reason  # the fix is already in the reason


def test_driver_minor_older_is_fine_for_sass_not_for_ptx():
    assert sel("9.0", driver=(13, 0), build_cuda="13.1").variant == "sm90a"
    with pytest.raises(dispatch.NoGpuVariant) as e:
        sel("10.0", driver=(13, 0), build_cuda="13.1")
    assert e.value.reason.startswith("driver too old: PTX JIT (compute_90) on 10.0 needs a driver "
                                     "for CUDA 13.1, this one supports 13.0")


def test_driver_unknown_is_not_checked():
    assert sel("10.0", driver=None).target == "compute_90"


def test_no_cuda_in_build():
    with pytest.raises(dispatch.NoGpuVariant, match=r"no GPU kernels in this build \(HMOE_CUDA=OFF\)"):
        sel("9.0", k={}, build_cuda=None)
    with pytest.raises(dispatch.NoGpuVariant, match="no GPU kernels for mla_decode"):
        sel("9.0", k={})


def test_build_without_a_target_for_the_device():
    k = {"portable": dict(BOTH["portable"], sass=["90"], ptx=["90"])}
    with pytest.raises(dispatch.NoGpuVariant) as e:
        sel("8.6", k=k)
    assert e.value.reason == "unsupported: built for sm_90 SASS, compute_90 PTX; none runs on 8.6"


@pytest.mark.parametrize("how", ["arg", "env"])
def test_forcing(monkeypatch, how):
    kw = {}
    if how == "arg":
        kw["variant"] = "portable"
    else:
        monkeypatch.setenv("HMOE_CUDA_VARIANT", "portable")
    s = sel("9.0", **kw)
    src = "variant=" if how == "arg" else "HMOE_CUDA_VARIANT="
    assert s.variant == "portable" and s.reason == f"forced by {src}portable: native: sm_90 SASS"


@pytest.mark.parametrize("cc, variant, words", [
    ("8.0", "sm90a", "sm90a' cannot run on cuda:0: unsupported: built for sm_90a SASS"),
    ("10.0", "sm90a", "none runs on 10.0"),
    ("7.5", "portable", "unsupported: 7.5 < 8.0"),
    ("9.0", "nonsense", "no such GPU variant"),
])
def test_forcing_what_cannot_run(cc, variant, words):
    with pytest.raises(ValueError, match=words):
        sel(cc, variant=variant)


def test_forcing_with_old_driver():
    with pytest.raises(ValueError, match="driver too old"):
        sel("9.0", driver=(12, 4), variant="portable")


def test_env_family_missing_for_this_op_is_ignored(monkeypatch):
    monkeypatch.setenv("HMOE_CUDA_VARIANT", "sm90a")
    s = sel("9.0", k=kernels("portable"))
    assert s.variant == "portable" and "HMOE_CUDA_VARIANT=sm90a ignored" in s.reason
    with pytest.raises(ValueError, match=r"variant='sm90a': no such GPU variant of mla_decode in this build "
                                         r"\(built: portable;"):  # forced: refused, not ignored
        sel("9.0", k=kernels("portable"), variant="sm90a")
    monkeypatch.setenv("HMOE_CUDA_VARIANT", "typo")
    with pytest.raises(ValueError, match="typo"):
        sel("9.0")


def test_backends(monkeypatch):
    # A backend registered in hmoe.backends.BACKENDS (a fake module standing in for flashinfer).
    from hmoe import backends

    fake = types.ModuleType("fake_backend")
    fake.selectable = lambda name, cc, drv: (cc == (9, 0), "flashinfer 0.2.9 on sm_90" if cc == (9, 0)
                                             else "fa3 needs 9.0")
    monkeypatch.setitem(sys.modules, "fake_backend", fake)
    monkeypatch.setattr(backends, "BACKENDS", {"flashinfer-fa3": ("fake_backend", ("mla_decode",))})
    s = sel("9.0", variant="flashinfer-fa3")
    assert s.variant == "flashinfer-fa3" and s.module == "" and s.backend
    assert s.reason == "forced by variant=flashinfer-fa3: flashinfer 0.2.9 on sm_90"
    with pytest.raises(ValueError, match="fa3 needs 9.0"):
        sel("8.0", variant="flashinfer-fa3")
    # Another op: the backend does not apply; from the environment it is ignored.
    monkeypatch.setenv("HMOE_CUDA_VARIANT", "flashinfer-fa3")
    s = dispatch.select_gpu("grouped_topk", cc="9.0", driver_cuda=(13, 0), kernels=kernels("portable"),
                            build_cuda="13.0", load_module=False)
    assert s.variant == "portable"
    monkeypatch.setitem(backends.BACKENDS, "plain", ("fake_backend", ("mla_decode",)))
    fake.selectable = lambda name, cc, drv: (True, "ok")
    assert sel("8.0", variant="plain").reason == "forced by variant=plain: ok"


# --- load-time validation ---------------------------------------------------------------------

def fake_module(monkeypatch, abi=ABI, sigs=None, consts=None, broken=False):
    """A module in sys.modules as if imported; by default with the table and constants the spec wants."""
    name = f"fake_gpu_mod_{next(_names)}"
    m = types.ModuleType(f"hmoe._native.{name}")
    if not broken:
        m.abi_version = lambda: abi
        m.signatures = lambda: dict(_native.expected_table(name) if sigs is None else sigs)
        m.constants = lambda: dict(spec.constants() if consts is None else consts)
    monkeypatch.setitem(sys.modules, f"hmoe._native.{name}", m)
    return name


def test_load_ok(monkeypatch):
    good = fake_module(monkeypatch)
    s = sel("9.0", k=kernels("portable", "sm90a", mod={"portable": good, "sm90a": good}),
            load_module=True)
    assert s.variant == "sm90a" and _native.is_loaded(good)


@pytest.mark.parametrize("bad", [dict(abi=ABI + 1),
                                 dict(sigs={"prewarm": "prewarm(device:i32, old:i32) -> None"}),
                                 dict(sigs={}), dict(consts={"abi_version": ABI}), dict(broken=True)])
def test_signature_mismatch_falls_back(monkeypatch, bad):
    good, wrong = fake_module(monkeypatch), fake_module(monkeypatch, **bad)
    s = sel("9.0", k=kernels("portable", "sm90a", mod={"portable": good, "sm90a": wrong}),
            load_module=True)
    assert s.variant == "portable" and s.reason.startswith("fallback: sm_90 SASS (sm90a refused: ")
    assert wrong in s.reason and s.refused and "reinstall" in s.reason


def test_missing_module_falls_back(monkeypatch):
    good = fake_module(monkeypatch)
    s = sel("9.0", k=kernels("portable", "sm90a", mod={"portable": good, "sm90a": "no_such_mod"}),
            load_module=True)
    assert s.variant == "portable" and "not in this installation" in s.reason


def test_every_family_refused(monkeypatch):
    w1, w2 = fake_module(monkeypatch, abi=0), fake_module(monkeypatch, abi=0)
    with pytest.raises(RuntimeError) as e:
        sel("9.0", k=kernels("portable", "sm90a", mod={"portable": w1, "sm90a": w2}), load_module=True)
    assert "sm90a refused" in str(e.value) and "portable refused" in str(e.value)


def test_forced_family_with_bad_module_raises(monkeypatch):
    wrong = fake_module(monkeypatch, abi=0)
    with pytest.raises(_native.NativeModuleError, match="ABI version 0"):
        sel("9.0", k=kernels("portable", mod={"portable": wrong}), variant="portable", load_module=True)


def test_a_family_table_holds_its_ops(monkeypatch):
    # A CUDA family's table: prewarm plus the entry points of the ops it was built with.
    from hmoe import _build_info

    fams = {"fam_a": {"ops": ["mla_decode"]}, "fam_b": {"ops": ["grouped_topk"]}}
    monkeypatch.setattr(_build_info, "_manifest", lambda: {"cuda_families": fams})
    a, b = _native.expected_table("fam_a"), _native.expected_table("fam_b")
    assert {"prewarm", "mla_decode", "mla_decode_plan", "mla_decode_check", "mla_decode_declines"} == set(a)
    assert {"prewarm", "grouped_topk"} == set(b)


def test_installed_manifest_is_the_default():
    # Whatever this machine built: grouped_topk's CUDA kernel, or a clear HMOE_CUDA=OFF.
    try:
        s = dispatch.select_gpu("grouped_topk", cc="9.0", driver_cuda=(99, 0), load_module=False)
    except dispatch.NoGpuVariant as e:
        assert "HMOE_CUDA=OFF" in e.reason
    else:
        assert s.variant == "portable" and s.module == "portable"


# --- select_gpu_for_device ----------------------------------------------------------------------

@pytest.fixture
def nvml_hook(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)

    def use(nvml):
        monkeypatch.setattr(gpu, "_NVML_HOOK", nvml)
        gpu.refresh()
    yield use
    gpu.refresh()


def test_for_device_uses_nvml(nvml_hook, monkeypatch):
    nvml_hook(F.make([F.A100, F.H200]))
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    try:
        s = dispatch.select_gpu_for_device("grouped_topk", 1, load_module=False)
    except dispatch.NoGpuVariant as e:  # the selection raises (it returns no variant) in such a build
        assert "HMOE_CUDA=OFF" in e.reason
        pytest.skip("this build has no CUDA kernels")
    assert s.device == "cuda:1 (NVIDIA H200, 9.0)" and s.variant == "portable"


def test_for_device_old_driver(nvml_hook):
    nvml_hook(F.make([F.H200], cuda=12020, driver="535.104.05"))
    with pytest.raises(dispatch.NoGpuVariant, match="(driver too old|HMOE_CUDA=OFF)"):
        dispatch.select_gpu_for_device("grouped_topk", 0, load_module=False)


def test_for_device_no_driver(nvml_hook, monkeypatch):
    nvml_hook(F.make([F.H200], init_error=F.NVMLError_DriverNotLoaded))
    monkeypatch.setattr(dispatch, "_torch_capability", lambda o, may_init: None)
    with pytest.raises(dispatch.NoGpuVariant, match="no CUDA device 0: the NVIDIA kernel driver"):
        dispatch.select_gpu_for_device("grouped_topk", 0, load_module=False)


def test_for_device_hidden_by_cuda_visible_devices(nvml_hook, monkeypatch):
    nvml_hook(F.make([F.H200]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(dispatch, "_torch_capability", lambda o, may_init: None)
    with pytest.raises(dispatch.NoGpuVariant, match="empty"):
        dispatch.select_gpu_for_device("grouped_topk", 0, load_module=False)


def test_for_device_torch_fallback_and_override(nvml_hook, monkeypatch):
    nvml_hook(F.make([], init_error=F.NVMLError_LibraryNotFound))
    asked = []

    def torch_cc(o, may_init):
        asked.append(may_init)
        return (8, 6)
    monkeypatch.setattr(dispatch, "_torch_capability", torch_cc)
    monkeypatch.setattr(dispatch, "_build_info", types.SimpleNamespace(
        cuda_kernels_for=lambda op: kernels("portable"), _manifest=lambda: {"cuda_version": "13.0"}))
    s = dispatch.select_gpu_for_device("mla_decode", 0, load_module=False)
    assert asked == [True] and s.reason == "fallback: sm_80 SASS on 8.6 (same major)"
    # NVML says 9.0 but torch (already initialised) says 8.6: torch wins.
    nvml_hook(F.make([F.H200]))
    s = dispatch.select_gpu_for_device("mla_decode", 0, load_module=False)
    assert asked[-1] is False and s.target == "sm_80"


def test_forced_ptx_jit_skips_sass_only_families(monkeypatch):
    """CUDA_FORCE_PTX_JIT=1 has the driver ignore SASS: the sm90a family (no PTX) would not load,
    so the choice on 9.0 is the portable family's compute_90 PTX, and forcing sm90a is refused."""
    monkeypatch.setenv("CUDA_FORCE_PTX_JIT", "1")
    s = sel("9.0")
    assert (s.variant, s.target) == ("portable", "compute_90")
    assert s.reason == "fallback: PTX JIT (compute_90) on 9.0 (CUDA_FORCE_PTX_JIT=1: the driver ignores SASS)"
    with pytest.raises(ValueError, match="CUDA_FORCE_PTX_JIT=1: the driver ignores SASS and no PTX"):
        sel("9.0", variant="sm90a")
    with pytest.raises(dispatch.NoGpuVariant, match="CUDA_FORCE_PTX_JIT=1"):
        sel("9.0", k=kernels("sm90a"))
    monkeypatch.setenv("CUDA_FORCE_PTX_JIT", "0")
    assert sel("9.0").variant == "sm90a"
