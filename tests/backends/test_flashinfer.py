"""mla_decode's flashinfer variants: pre-validation, fallback and errors on the CPU with a fake flashinfer; the real
fa2/fa3 backends against the reference on a GPU."""
import logging
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from hmoe import dispatch
from hmoe.backends import flashinfer as mf

from ..ops.mla_reference import TOL, make_cache, mla_reference, rel_err

SCALE = 1.0 / (192 ** 0.5)


class FakeWrapper:
    """flashinfer.mla.BatchMLAPagedAttentionWrapper's API computed with torch from the CSR page list, lse in
    base 2 like flashinfer's default. Class-level knobs: wrong[backend] is added to the output, broken[backend]
    makes plan() fail as a JIT build does, base_e gives natural-log lse; plans records each plan()."""
    wrong, broken, plans, base_e = {}, {}, [], False

    def __init__(self, workspace, backend="auto"):
        self.backend = backend

    def plan(self, *, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type):
        if self.backend in self.broken:
            raise RuntimeError("Ninja build failed. Ninja output:\n[1/3] nvcc ...\nerror: a pointer of type "
                               "DTypeO* is incompatible with float*")
        assert qo_indptr.dtype == kv_indptr.dtype == kv_indices.dtype == kv_len_arr.dtype == torch.int32
        assert (head_dim_ckv, head_dim_kpe, causal) == (512, 64, False) and q_data_type == kv_data_type
        self.p = (kv_indptr.tolist(), kv_indices, kv_len_arr.tolist(), page_size, sm_scale)
        FakeWrapper.plans.append(self.backend)

    def run(self, q_nope, q_pe, ckv, kpe, out=None, lse=None, return_lse=False):
        indptr, ids, lens, page, scale = self.p
        for b, L in enumerate(lens):
            pages = ids[indptr[b]:indptr[b + 1]].long()
            kv = ckv[pages].reshape(-1, 512)[:L].float()
            s = (q_nope[b].float() @ kv.T + q_pe[b].float() @ kpe[pages].reshape(-1, 64)[:L].float().T) * scale
            out[b] = (torch.softmax(s, -1) @ kv + self.wrong.get(self.backend, 0.0)).to(out.dtype)
            if return_lse:
                lse[b] = torch.logsumexp(s, -1) / (1.0 if self.base_e else math.log(2))
        return (out, lse) if return_lse else out


class FakeHardware:
    def __init__(self, cc=(9, 0), capturing=False, torch_cuda=(12, 8), driver_cuda=(12, 8)):
        self.cc_, self.capturing_, self.torch_cuda_, self.driver_cuda_ = cc, capturing, torch_cuda, driver_cuda

    index = staticmethod(lambda torch, dev: 0)
    device = staticmethod(lambda torch, index: torch.device("cpu"))
    sync = staticmethod(lambda torch, dev: None)
    cc = lambda self, torch, index: self.cc_  # noqa: E731
    capturing = lambda self, torch, index: self.capturing_  # noqa: E731
    torch_cuda = lambda self: self.torch_cuda_  # noqa: E731
    driver_cuda = lambda self: self.driver_cuda_  # noqa: E731


def _exe(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{text}'\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def fi(monkeypatch, tmp_path):
    """A machine with flashinfer 0.6.0 (fake), an H100-class GPU, torch and nvcc of CUDA 12.8, ninja."""
    mod, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
    mod.__version__, mod.mla, mla.BatchMLAPagedAttentionWrapper = "0.6.0", mla, FakeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setitem(sys.modules, "flashinfer_jit_cache", None)
    for k in ("CUDA_PATH", "FLASHINFER_NVCC"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    _exe(tmp_path / "cuda" / "bin" / "nvcc", "Cuda compilation tools, release 12.8, V12.8.93")
    _exe(tmp_path / "bin" / "ninja", "1.11.1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(mf, "_hw", FakeHardware())
    monkeypatch.setattr(mf, "_checked", {})
    monkeypatch.setattr(mf, "_engines", {})
    monkeypatch.setattr(FakeWrapper, "wrong", {})
    monkeypatch.setattr(FakeWrapper, "broken", {})
    monkeypatch.setattr(FakeWrapper, "plans", [])
    monkeypatch.setattr(FakeWrapper, "base_e", False)
    return types.SimpleNamespace(module=mod, root=tmp_path, mp=monkeypatch)


def _problem(lens=(37, 0, 130, 1), B=4, H=8, page=16, seed=0):
    return make_cache(B, H, list(lens), page, torch.bfloat16, "cpu", torch.Generator().manual_seed(seed))


def _select(variant, cc=(9, 0)):
    return dispatch.select_gpu("mla_decode", cc=cc, driver_cuda=(12, 8), variant=variant)


def test_registered_for_mla_decode_only(fi):
    sel = _select("flashinfer-fa2")
    assert sel.variant == "flashinfer-fa2" and sel.module == "" and "flashinfer 0.6.0 fa2 on 9.0" in sel.reason
    assert "JIT-compiles on first use with nvcc 12.8" in sel.reason
    from hmoe import backends
    assert sel.backend and not backends.serves("flashinfer-fa3", "grouped_topk")


def test_absent_flashinfer_refuses_both(fi):
    fi.mp.setitem(sys.modules, "flashinfer", None)
    for v in ("flashinfer-fa2", "flashinfer-fa3"):
        with pytest.raises(ValueError, match="flashinfer is not installed"):
            _select(v)


def test_versions(fi):
    fi.module.__version__ = "0.6.8.post1"
    assert mf.check("fa2", (9, 0))[0]
    for v in ("0.5.3", "0.7.0", "1.0"):
        fi.module.__version__ = v
        ok, why = mf.check("fa2", (9, 0))
        assert not ok and f"flashinfer {v} is not a version hmoe knows" in why and "0.6.0 <= version < 0.7.0" in why
        assert "HMOE_FLASHINFER_TRUST=1" in why
    fi.mp.setenv("HMOE_FLASHINFER_TRUST", "1")
    ok, why = mf.check("fa2", (9, 0))
    assert ok and "trusted (HMOE_FLASHINFER_TRUST=1)" in why
    fi.module.__version__ = None
    assert mf.check("fa2", (9, 0)) == (False, "flashinfer reports no version: hmoe cannot tell whether it works")


def test_sms(fi):
    for cc in ((8, 6), (8, 9), (10, 0)):
        ok, why = mf.check("fa2", cc)
        assert not ok and "hmoe has not validated flashinfer fa2" in why and "validated: 8.0, 9.0" in why
    ok, why = mf.check("fa3", (8, 0))
    assert not ok and "needs sm_90" in why
    with pytest.raises(ValueError, match="needs sm_90"):
        _select("flashinfer-fa3", cc=(8, 0))
    fi.mp.setenv("HMOE_FLASHINFER_TRUST", "1")
    assert mf.check("fa2", (8, 6))[0] and not mf.check("fa3", (8, 9))[0] and not mf.check("fa2", (7, 5))[0]


def test_compiler(fi):
    fi.mp.setenv("CUDA_HOME", str(fi.root / "nowhere"))
    ok, why = mf.check("fa2", (9, 0))
    assert not ok and "there is no nvcc at" in why and "flashinfer-jit-cache 0.6.0" in why
    jit = types.ModuleType("flashinfer_jit_cache")
    jit.__version__ = "0.6.0+cu128"
    fi.mp.setitem(sys.modules, "flashinfer_jit_cache", jit)
    ok, why = mf.check("fa2", (9, 0))
    assert ok and "prebuilt kernels (flashinfer-jit-cache 0.6.0+cu128)" in why
    fi.mp.setitem(sys.modules, "flashinfer_jit_cache", None)
    _exe(fi.root / "cuda13" / "bin" / "nvcc", "Cuda compilation tools, release 13.0, V13.0.48")
    fi.mp.setenv("CUDA_HOME", str(fi.root / "cuda13"))
    ok, why = mf.check("fa2", (9, 0))
    assert not ok and "nvcc 13.0" in why and "does not match torch's CUDA 12.8" in why
    fi.mp.setattr(mf, "_hw", FakeHardware(torch_cuda=None))
    assert "CPU-only" in mf.check("fa2", (9, 0))[1]
    fi.mp.setattr(mf, "_hw", FakeHardware(torch_cuda=(13, 0), driver_cuda=(12, 4)))
    assert "cannot load" in mf.check("fa2", (9, 0), (12, 4))[1]
    fi.mp.setenv("PATH", str(fi.root / "nowhere"))
    assert "ninja" in mf.check("fa2", (9, 0))[1]


def test_fa3_cheap_failure_on_hopper_selects_fa2(fi):
    _exe(fi.root / "cuda122" / "bin" / "nvcc", "Cuda compilation tools, release 12.2, V12.2.140")
    fi.mp.setenv("CUDA_HOME", str(fi.root / "cuda122"))
    fi.mp.setattr(mf, "_hw", FakeHardware(torch_cuda=(12, 2)))
    sel = _select("flashinfer-fa3")
    assert "fa3 refused (fa3 needs CUDA >= 12.3 (nvcc 12.2, torch's CUDA 12.2)); falls back to fa2" in sel.reason
    out = mf.run("flashinfer-fa3", *_problem(), sm_scale=SCALE)
    assert FakeWrapper.plans == ["fa2", "fa2"] and out.shape == (4, 8, 512)  # self-check, then the call
    st = {s["backend"]: s for s in mf.states()}
    assert st["fa3"]["stage"] == "check" and st["fa3"]["fallback"] == "fa2" and st["fa2"]["usable"]


def test_run_against_reference(fi):
    args = _problem()
    out, lse = mf.run("flashinfer-fa2", *args, sm_scale=SCALE, return_lse=True)
    ref_o, ref_l = mla_reference(*args, SCALE)
    nz = args[5] > 0
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_err(out[nz], ref_o[nz]) < TOL[torch.bfloat16]
    assert (lse[nz] - ref_l[nz]).abs().max() < 1e-4  # base 2 converted to natural
    assert (out[~nz] == 0).all() and torch.isneginf(lse[~nz]).all()
    [st] = mf.states()
    assert st["usable"] and st["stage"] == "self-check" and st["fallback"] is None
    assert "self-check passed" in st["detail"] and "base 2, converted" in st["detail"]
    assert st["lse_scale"] == pytest.approx(math.log(2))
    assert FakeWrapper.plans == ["fa2", "fa2"]  # the self-check's, then this one's
    given = torch.full_like(out, float("nan"))  # poisoned: an unwritten out cannot equal out
    assert mf.run("flashinfer-fa2", *args, sm_scale=SCALE, out=given) is given
    assert FakeWrapper.plans == ["fa2", "fa2"] and torch.equal(given, out)  # same inputs: no new plan()
    q_nope, q_pe, ckv, kpe, pt, lens = args
    moved = torch.where(pt >= 0, (pt + 1) % ckv.shape[0], pt)  # page p's content now in page p + 1
    again = mf.run("flashinfer-fa2", q_nope, q_pe, ckv.roll(1, 0), kpe.roll(1, 0), moved, lens, sm_scale=SCALE)
    assert len(FakeWrapper.plans) == 3 and torch.equal(again, out)  # same lengths, new page ids: plan() again
    pt2 = pt.clone()
    pt2[0, 0] = ckv.shape[0] + 5
    with pytest.raises(ValueError, match=r"page_table\[0, 0\] = .* is outside"):
        mf.run("flashinfer-fa2", q_nope, q_pe, ckv, kpe, pt2, lens, sm_scale=SCALE)
    empty = mf.run("flashinfer-fa2", q_nope, q_pe, ckv, kpe, pt, torch.zeros_like(lens), sm_scale=SCALE,
                   return_lse=True)
    assert (empty[0] == 0).all() and torch.isneginf(empty[1]).all()


def test_lse_base_comes_from_the_self_check(fi):
    FakeWrapper.base_e = True  # a flashinfer whose lse is already natural is not converted
    args = _problem()
    _, lse = mf.run("flashinfer-fa2", *args, sm_scale=SCALE, return_lse=True)
    nz = args[5] > 0
    assert (lse[nz] - mla_reference(*args, SCALE)[1][nz]).abs().max() < 1e-4
    [st] = mf.states()
    assert st["lse_scale"] == 1.0 and "natural)" in st["detail"]


def test_fa3_failing_self_check_falls_back_to_fa2(fi, caplog):
    FakeWrapper.wrong["fa3"] = 0.5
    args = _problem()
    with caplog.at_level(logging.WARNING, logger="hmoe.backends.flashinfer"):
        out = mf.run("flashinfer-fa3", *args, sm_scale=SCALE)
        mf.run("flashinfer-fa3", *args, sm_scale=SCALE)
    ref_o, _ = mla_reference(*args, SCALE)
    assert rel_err(out, ref_o) < TOL[torch.bfloat16]
    st = {s["backend"]: s for s in mf.states()}
    assert not st["fa3"]["usable"] and st["fa3"]["fallback"] == "fa2" and st["fa2"]["usable"]
    assert "self-check failed: out rel. error" in st["fa3"]["detail"] and "(tol 1e-02)" in st["fa3"]["detail"]
    falls = [r for r in caplog.records if "falls back to fa2" in r.getMessage()]
    assert len(falls) == 1 and "self-check failed" in falls[0].getMessage()
    assert FakeWrapper.plans[-1] == "fa2"


def test_fa2_failure_is_an_error(fi):
    FakeWrapper.wrong["fa2"] = 0.5
    with pytest.raises(RuntimeError, match=r"flashinfer-fa2 cannot run mla_decode on cuda:0 \(bfloat16\): .*"
                                           r"self-check failed: out rel\. error"):
        mf.run("flashinfer-fa2", *_problem(), sm_scale=SCALE)
    FakeWrapper.broken["fa3"] = True
    with pytest.raises(RuntimeError) as e:
        mf.run("flashinfer-fa3", *_problem(), sm_scale=SCALE)
    msg = str(e.value)
    assert "fa3: build failed: RuntimeError: Ninja build failed" in msg and "DTypeO* is incompatible" in msg
    assert "fa2 (its fallback): " in msg and "self-check failed" in msg


def test_capture_is_an_error(fi):
    fi.mp.setattr(mf, "_hw", FakeHardware(capturing=True))
    with pytest.raises(RuntimeError, match="cannot run inside CUDA-graph capture"):
        mf.run("flashinfer-fa2", *_problem(), sm_scale=SCALE)
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        mf.prewarm(0)
    assert mf.states() == [] and FakeWrapper.plans == []


def test_prewarm(fi):
    states = mf.prewarm(0, dtypes=("bfloat16", torch.float16))
    assert sorted((s["backend"], s["dtype"], s["usable"]) for s in states) == [
        ("fa2", "bfloat16", True), ("fa2", "float16", True), ("fa3", "bfloat16", True), ("fa3", "float16", True)]
    fi.mp.setattr(mf, "_checked", {})
    fi.mp.setattr(mf, "_hw", FakeHardware(cc=(8, 0)))
    assert [s["backend"] for s in mf.prewarm(0)] == ["fa2"]  # fa3 is never selected off Hopper
    with pytest.raises(RuntimeError, match="needs sm_90"):
        mf.prewarm(0, backends=("fa3",))


def test_compat_probe(fi, monkeypatch):
    from hmoe import compat
    from hmoe.hardware import gpu

    monkeypatch.setattr(gpu, "detect", lambda **kw: gpu.simulated("9.0", "8.0", driver_cuda=(12, 8)))
    st = compat.backend_states()
    assert st["flashinfer-fa2"]["usable"] and "8.0: flashinfer 0.6.0 fa2 on 8.0" in st["flashinfer-fa2"]["detail"]
    assert st["flashinfer-fa3"]["usable"] and "8.0: flashinfer fa3 needs sm_90" in st["flashinfer-fa3"]["detail"]
    mf.run("flashinfer-fa2", *_problem(), sm_scale=SCALE)
    assert "cuda:0 bfloat16: flashinfer 0.6.0 fa2 on 9.0" in compat.backend_states()["flashinfer-fa2"]["detail"]
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setattr(gpu, "detect", lambda **kw: gpu.simulated("9.0"))
    st = compat.backend_states()["flashinfer-fa3"]
    assert not st["usable"] and st["detail"].startswith("fa3: flashinfer is not installed")


def test_torch_cuda_without_importing_torch():
    code = "import sys; from hmoe.backends import flashinfer as m; print(m._hw.torch_cuda(), 'torch' in sys.modules)"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    want = tuple(int(x) for x in torch.version.cuda.split(".")[:2]) if torch.version.cuda else None
    assert got == f"{want} False"


# --- the real flashinfer -------------------------------------------------------------------------------------

def _real_problems():
    g = torch.Generator().manual_seed(11)
    yield make_cache(5, 16, [1, 100, 0, 257, 64], 16, torch.bfloat16, "cuda", g)
    yield make_cache(3, 128, [300, 5, 2048], 64, torch.bfloat16, "cuda", g)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_real_backends_against_reference():
    pytest.importorskip("flashinfer", reason="flashinfer is an optional dependency")
    cc = torch.cuda.get_device_capability()
    for backend in mf.BACKENDS:
        if cc not in mf.KNOWN[backend][0]:  # refused, as pre-validation says; nothing to skip
            with pytest.raises(RuntimeError, match="needs sm_90|has not validated"):
                mf.prewarm(torch.cuda.current_device(), backends=(backend,))
            continue
        mf.prewarm(torch.cuda.current_device(), backends=(backend,))
        st = {s["backend"]: s for s in mf.states() if s["dtype"] == "bfloat16"}
        assert st[backend]["usable"] and st[backend]["fallback"] is None, st  # this backend itself passed
        for q_nope, q_pe, ckv, kpe, pt, lens in _real_problems():
            out, lse = mf.run(f"flashinfer-{backend}", q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE,
                              return_lse=True)
            torch.cuda.synchronize()
            ref_o, ref_l = mla_reference(q_nope, q_pe, ckv, kpe, pt, lens, SCALE)
            nz = lens.cpu() > 0
            assert rel_err(out[nz], ref_o[nz]) < TOL[torch.bfloat16], backend
            assert (lse.cpu()[nz] - ref_l[nz]).abs().max() < 1e-2, (backend, st[backend]["detail"])
            assert (out[~nz] == 0).all() and torch.isneginf(lse[~nz].cpu()).all()
        with pytest.raises(RuntimeError, match="CUDA-graph capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                mf.run(f"flashinfer-{backend}", q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE)


@pytest.mark.gpu
def test_mla_decode_variant_flashinfer():
    """Through hmoe.ops.mla_decode (variant=...): the branch in ops/mla.py that hands over to run()."""
    pytest.importorskip("flashinfer", reason="flashinfer is an optional dependency")
    import hmoe

    variant = "flashinfer-fa2" if torch.cuda.get_device_capability() in mf.KNOWN["fa2"][0] else None
    if variant is None:
        with pytest.raises(ValueError, match="has not validated"):
            hmoe.ops.mla_decode(*next(_real_problems()), sm_scale=SCALE, variant="flashinfer-fa2")
        return
    args = next(_real_problems())
    out, lse = hmoe.ops.mla_decode(*args, sm_scale=SCALE, return_lse=True, variant=variant)
    ref_o, ref_l = mla_reference(*args, SCALE)
    nz = args[5].cpu() > 0
    assert rel_err(out[nz], ref_o[nz]) < TOL[torch.bfloat16] and (lse.cpu()[nz] - ref_l[nz]).abs().max() < 1e-2
