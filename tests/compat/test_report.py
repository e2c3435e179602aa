"""hmoe.compat.report() with injected hardware and failures: the right lines, the right exit
code, nothing raised, and JSON that validates against schema.json."""
import importlib
import io
import json
import sys
import types
from pathlib import Path

import pytest

import hmoe
from hmoe import _arch, _native, compat
from hmoe._native import spec
from hmoe.compat import probes, render

from ..hardware import fake_nvml as F
from . import minischema
from .build import HAS_CUDA, MANIFEST, needs_cuda_build, needs_sass

SCHEMA = json.loads((Path(compat.__file__).parent / "schema.json").read_text())


def run(**kw):
    rep = compat.report(**kw)
    assert minischema.errors(rep, SCHEMA) == []
    text = render.render(rep)
    assert "\033[" not in text
    return rep, text


def problems(rep, severity=None):
    return [p["what"] for p in rep["problems"] if severity in (None, p["severity"])]


def rows(rep, device_prefix):
    return [r for r in rep["selections"] if r["device"].startswith(device_prefix)]


def test_schema_uses_only_what_the_validator_knows():
    assert minischema.unknown_keywords(SCHEMA) == []
    assert SCHEMA["properties"]["schema_version"]["const"] == compat.SCHEMA_VERSION


def test_this_machine_without_nvml(env):
    rep, text = run()
    assert rep["exit_code"] == 0 and rep["status"] == "ok", rep["problems"]
    assert rep["gpus"]["nvml"] is False and "libnvidia-ml.so.1 not found" in rep["gpus"]["reason"]
    assert rep["hmoe"]["version"] == hmoe.__version__ and rep["hmoe"]["manifest"]["version"]
    assert {r["op"] for r in rows(rep, "cpu")} >= {"experts", "grouped_topk"}
    assert all(r["ok"] for r in rep["selections"])
    assert "== selected variant per device and op" in text and "problems\n  none" in text
    assert rep["backends"]["flashinfer"]["detail"] == "not installed"
    assert "flashinfer    not installed" in text


def test_jsonschema_agrees_when_installed(env):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(compat.report(simulate_gpu=["9.0", "7.5"]), SCHEMA)


def test_report_equals_json_output(env):
    buf = io.StringIO()
    assert compat.check(["check", "--json"], stdout=buf) == 0
    assert json.loads(buf.getvalue()) == json.loads(json.dumps(compat.report()))


def test_no_pynvml(env, monkeypatch, tmp_path):
    # NVML is asked in a child process: there, pynvml does not import.
    monkeypatch.setattr("hmoe.hardware.gpu._NVML_HOOK", None)
    (tmp_path / "pynvml.py").write_text("raise ImportError('No module named pynvml')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    env()
    from hmoe.hardware import gpu
    gpu.refresh()
    rep, text = run()
    assert rep["exit_code"] == 0 and "pip install nvidia-ml-py" in text
    assert any("nvidia-ml-py" in p for p in problems(rep, "warning"))


@pytest.mark.parametrize("err", [F.NVMLError_DriverNotLoaded, F.NVMLError_LibRmVersionMismatch])
def test_driver_broken_is_an_error(env, err):
    env(nvml=F.make([F.H200], init_error=err))
    rep, text = run()
    assert rep["exit_code"] == 1 and any(p.startswith("NVML: ") for p in problems(rep, "error"))
    assert "NVML          unavailable" in text


@needs_cuda_build
def test_h200(env):
    env(nvml=F.make([F.H200]))
    rep, text = run()
    (d,) = rep["gpus"]["devices"]
    assert (d["cuda_ordinal"], d["compute_capability"], d["mig_mode"]) == (0, "9.0", False)
    assert rep["gpus"]["driver_cuda"] == "13.0" and rep["gpus"]["driver_version"] == "580.65.06"
    gpu_rows = rows(rep, "cuda:0")
    assert gpu_rows and all(r["ok"] and r["reason"].endswith("SASS") for r in gpu_rows)
    assert "nvml 0  cuda:0  NVIDIA H200  cc 9.0  141.0 GiB  MIG off" in text
    assert rep["exit_code"] == 0


@pytest.mark.parametrize("fn", ["nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion_v2",
                                "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                                "nvmlDeviceGetName", "nvmlDeviceGetUUID",
                                "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMemoryInfo",
                                "nvmlDeviceGetPciInfo", "nvmlDeviceGetMigMode"])
def test_nvml_query_failures(env, fn):
    env(nvml=F.make([F.H200], fail={fn: F.NVMLError_Unknown}))
    rep, text = run()
    assert any("NVMLError_Unknown" in p for p in problems(rep, "warning"))
    cc_lost = fn in ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetCudaComputeCapability")
    if cc_lost:
        assert any("compute capability unknown" in p for p in problems(rep, "error"))
    if fn == "nvmlDeviceGetCount":
        assert rep["gpus"]["devices"] == []
    assert rep["exit_code"] == (1 if cc_lost or not HAS_CUDA and fn != "nvmlDeviceGetCount" else 0)


@needs_cuda_build
def test_old_driver(env):
    env(nvml=F.make([F.H200], driver="535.104.05", cuda=12020))
    rep, text = run()
    assert rep["exit_code"] == 1
    (r, *_) = rows(rep, "cuda:0")
    need = ".".join(MANIFEST["cuda_version"].split(".")[:2])
    assert r["reason"].startswith(f"driver too old: it supports CUDA 12.2, this build needs {need.split('.')[0]}.0")
    assert any("upgrade the driver" in p["fix"] for p in rep["problems"])


@needs_cuda_build
@needs_sass("80")
def test_mig(env):
    mig = F.mig_a100()
    env(nvml=F.make([mig]))
    rep, text = run()
    (d,) = rep["gpus"]["devices"]
    assert d["mig_mode"] is True and d["cuda_ordinal"] is None
    assert [m["cuda_ordinal"] for m in d["mig_devices"]] == [0, None]
    assert rows(rep, "cuda:0 (NVIDIA A100-SXM4-80GB MIG 3g.40gb, 8.0)")
    assert "MIG cuda:0" in text and "one MIG device" in text and rep["exit_code"] == 0


@needs_cuda_build
def test_uuids_in_cuda_visible_devices(env, monkeypatch):
    env(nvml=F.make([F.A100, F.H200]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8932f937,GPU-nope,0")
    rep, text = run()
    ords = {d["name"]: d["cuda_ordinal"] for d in rep["gpus"]["devices"]}
    assert ords == {"NVIDIA A100-SXM4-80GB": None, "NVIDIA H200": 0}
    assert any("'GPU-nope'" in p for p in problems(rep, "warning"))
    assert "CUDA_VISIBLE_DEVICES 'GPU-8932f937,GPU-nope,0'" in text


@needs_sass("80", "100", "120")
def test_simulated_gpus_and_cpu(env):
    rep, text = run(simulate_gpu=["8.6", "9.0", "10.0", "7.5", "12.0", "12.1"], simulate_cpu="avx2")
    assert rep["simulated"] == {"gpu": ["8.6", "9.0", "10.0", "7.5", "12.0", "12.1"], "cpu": "avx2"}
    assert rep["gpus"]["simulated"] and rep["cpu"]["simulated"]
    assert rows(rep, "cpu")[0]["variant"] == "avx2"
    if HAS_CUDA:
        reasons = {r["device"]: r["reason"] for r in rep["selections"] if r["device"] != "cpu"}
        assert reasons["cuda:0 (simulated GPU, 8.6)"] == "fallback: sm_80 SASS on 8.6 (same major)"
        assert reasons["cuda:2 (simulated GPU, 10.0)"] == "native: sm_100 SASS"
        assert reasons["cuda:3 (simulated GPU, 7.5)"] == "unsupported: 7.5 < 8.0"
        assert reasons["cuda:4 (simulated GPU, 12.0)"] == "native: sm_120 SASS"
        assert reasons["cuda:5 (simulated GPU, 12.1)"] == "fallback: sm_120 SASS on 12.1 (same major)"
    else:  # a build without GPU kernels lists every GPU op, each saying why none runs
        gpu_rows = [r for r in rep["selections"] if r["device"].startswith("cuda:1 ")]
        assert sorted(r["op"] for r in gpu_rows) == _arch.gpu_ops() and "mla_decode" in _arch.gpu_ops()
        assert all(r["reason"] == "no GPU kernels in this build (HMOE_CUDA=OFF)" for r in gpu_rows)
    assert rep["exit_code"] == 1 and "[simulated]" in text


def _corrupt(monkeypatch, module):
    # A None entry in sys.modules makes the import fail, as a truncated .so would (the real
    # file stays where it is: test_cli.py corrupts a copy of the package).
    monkeypatch.setitem(sys.modules, f"hmoe._native.{module}", None)


def test_corrupt_cpu_module_falls_back(env, monkeypatch):
    best = [r for r in compat.report()["variants"] if r["status"] == "ok" and r["kind"] == "cpu"][-1]
    env()
    monkeypatch.setattr(_native, "_loaded", {})
    _corrupt(monkeypatch, best["module"])
    rep, text = run()
    row = next(r for r in rep["variants"] if r["module"] == best["module"])
    assert row["status"] == "load_error" and rep["exit_code"] == 1
    experts = next(r for r in rows(rep, "cpu") if r["op"] == "experts")
    if best["ops"] == ["experts"]:
        assert experts["ok"] and experts["variant"] != best["isa"]
        assert experts["reason"].startswith("fallback: ")
    assert "load error" in text


def test_missing_module_file(env, monkeypatch):
    R = importlib.import_module("hmoe.compat.report")
    real = R._file
    monkeypatch.setattr(R, "_file", lambda m: None if m == "experts_generic" else real(m))
    rep, _ = run()
    row = next(r for r in rep["variants"] if r["module"] == "experts_generic")
    assert (row["present"], row["status"]) == (False, "missing") and rep["exit_code"] == 1


def test_mismatched_signature_table(env, monkeypatch):
    real = _native.expected_table

    def expected(name):  # as if the installed spec wanted another moe_experts
        table = real(name)
        return dict(table, moe_experts="moe_experts(x:ptr) -> None") if "moe_experts" in table else table
    monkeypatch.setattr(_native, "expected_table", expected)
    rep, text = run()
    loaded = [r for r in rep["variants"] if r["ops"] == ["experts"] and r["status"] != "not_loaded"]
    assert loaded and all(r["status"] == "signature_mismatch" for r in loaded)
    experts = next(r for r in rows(rep, "cpu") if r["op"] == "experts")
    assert not experts["ok"] and "signature of moe_experts" in experts["reason"]
    assert rep["exit_code"] == 1 and "reinstall hmoe" in text


def test_module_from_another_version(env, monkeypatch):
    fake = types.ModuleType("hmoe._native.cpu_core")
    fake.abi_version = lambda: spec.constants()["abi_version"] + 1
    fake.signatures = lambda: _native.expected_table("cpu_core")
    fake.constants = spec.constants
    monkeypatch.setitem(sys.modules, "hmoe._native.cpu_core", fake)
    rep, text = run()
    row = next(r for r in rep["variants"] if r["module"] == "cpu_core")
    assert row["status"] == "signature_mismatch" and "ABI version" in row["detail"]
    assert rep["exit_code"] == 1


@pytest.mark.parametrize("torch, words, code", [
    ({"installed": True, "error": "OSError: libcudnn.so.9: cannot open shared object file"},
     "torch is broken: OSError: libcudnn.so.9", 1),
    ({"installed": None, "error": "importing torch/flashinfer was killed by signal 11"},
     "killed by signal 11", 1),
    ({"installed": False}, "torch is not installed", 0),
])
def test_torch_problems(env, torch, words, code):
    env(torch=torch)
    rep, text = run()
    assert any(words in p for p in problems(rep)) and rep["exit_code"] == code


def test_torch_sees_other_gpus(env):
    env(nvml=F.make([F.H200]), torch={"installed": True, "version": "2.13.0", "cuda_version": "13.0",
                                      "cuda_available": True, "devices": []})
    rep, _ = run()
    assert rep["torch"]["same_gpus"] is False
    assert any("torch and NVML disagree" in p for p in problems(rep, "warning"))
    env(torch={"installed": True, "version": "2.13.0", "cuda_version": "13.0", "cuda_available": True,
               "devices": [{"ordinal": 0, "name": "NVIDIA H200", "cc": [9, 0],
                            "uuid": F.H200["uuid"][4:]}]})
    rep, text = run()
    assert rep["torch"]["same_gpus"] is True and "same GPUs as NVML" in text


@needs_sass("89")
def test_torch_devices_stand_in_for_nvml(env):
    env(torch={"installed": True, "version": "2.13.0", "cuda_version": "13.0", "cuda_available": True,
               "devices": [{"ordinal": 0, "name": "NVIDIA L40", "cc": [8, 9], "uuid": None}]})
    rep, _ = run()
    r = rows(rep, "cuda:0 (NVIDIA L40, 8.9) [from torch]")
    assert r and (not HAS_CUDA or r[0]["reason"] == "native: sm_89 SASS")


@pytest.mark.parametrize("fi, detail, warn", [
    ({"installed": False}, "not installed", False),
    ({"installed": True, "version": "0.2.9"}, "version 0.2.9", False),
    ({"installed": True, "version": None}, "installed, version unknown", True),
    ({"installed": True, "error": "RuntimeError: bad build"}, "installed, fails to import", True),
])
def test_flashinfer(env, fi, detail, warn):
    env(flashinfer=fi)
    rep, text = run()
    assert rep["backends"]["flashinfer"]["detail"] == detail
    assert any("flashinfer" in p for p in problems(rep, "warning")) == warn
    assert rep["exit_code"] == 0


def test_backend_states_hook(env, monkeypatch):
    # Each backend's compat_state() (hmoe.backends); one that raises reads as unusable.
    from hmoe import backends

    fake = types.ModuleType("fake_backend")
    fake.compat_state = lambda name: {"usable": True, "detail": "ok"} if name.endswith("fa2") else 1 / 0
    monkeypatch.setitem(sys.modules, "fake_backend", fake)
    monkeypatch.setattr(backends, "BACKENDS", {f"flashinfer-{b}": ("fake_backend", ("mla_decode",))
                                               for b in ("fa2", "fa3")})
    rep, text = run()
    st = rep["backends"]["states"]
    assert st["flashinfer-fa2"] == {"usable": True, "detail": "ok"}
    assert st["flashinfer-fa3"]["usable"] is False and "ZeroDivisionError" in st["flashinfer-fa3"]["detail"]
    assert "flashinfer-fa3: not usable" in text


def test_selftests(env, monkeypatch):
    rep, text = run(selftest=True)
    names = {(r["name"], r["device"]): r["ok"] for r in rep["selftests"]}
    assert names == {("experts", "cpu"): True, ("grouped_topk", "cpu"): True}, rep["selftests"]
    monkeypatch.setitem(compat.SELFTESTS, "broken", lambda dev: (False, "wrong numbers"))
    monkeypatch.setitem(compat.SELFTESTS, "raises", lambda dev: 1 / 0)
    monkeypatch.setitem(compat.SELFTESTS, "gpu_only", lambda dev: None if dev == "cpu" else (True, ""))
    rep, text = run(selftest=True)
    assert rep["exit_code"] == 1 and "broken on cpu: FAIL: wrong numbers" in text
    assert any("ZeroDivisionError" in r["detail"] for r in rep["selftests"])
    assert not any(r["name"] == "gpu_only" for r in rep["selftests"])


def test_forced_cpu_isa_it_cannot_run(env, monkeypatch):
    monkeypatch.setenv("HMOE_CPU_ISA", "amx")
    rep, _ = run(simulate_cpu="avx2")
    assert rep["exit_code"] == 1 and any("HMOE_CPU_ISA" in p["fix"] for p in rep["problems"])


@pytest.mark.parametrize("value", ["0", "-5", "abc", "inf"])
def test_bad_compat_timeout_is_reported_and_the_default_used(env, monkeypatch, value):
    monkeypatch.setenv("HMOE_COMPAT_TIMEOUT", value)
    assert probes.timeout_s(30.0) == 30.0
    rep, text = run()
    (p,) = [p for p in rep["problems"] if "HMOE_COMPAT_TIMEOUT" in p["what"]]
    assert p["severity"] == "warning" and f"HMOE_COMPAT_TIMEOUT={value!r}" in p["what"]
    assert "seconds > 0" in p["what"] and "ignored" in p["what"] and "HMOE_COMPAT_TIMEOUT" in p["fix"]
    # the children ran with their default limits: nothing "took over 0 s", nothing to reinstall
    assert "took over" not in text and not any("reinstall" in p["fix"] for p in rep["problems"]), rep["problems"]
    assert rep["exit_code"] == 0, rep["problems"]


def test_valid_compat_timeout_is_used(env, monkeypatch):
    monkeypatch.setenv("HMOE_COMPAT_TIMEOUT", "2.5")
    assert probes.timeout_s(30.0) == 2.5 and probes.timeout_problem() is None
    monkeypatch.setenv("HMOE_COMPAT_TIMEOUT", "")
    assert probes.timeout_s(30.0) == 30.0 and probes.timeout_problem() is None


@pytest.mark.parametrize("value", ["abc", "0", "2000"])
def test_bad_num_threads_is_a_problem_and_explains_the_selftest(env, monkeypatch, value):
    from hmoe import _threads

    fix = f"set HMOE_NUM_THREADS to an integer 1..{_threads.MAX_THREADS} or unset it"
    monkeypatch.setenv("HMOE_NUM_THREADS", value)
    rep, text = run(selftest=True)
    assert rep["exit_code"] == 1
    threads = [p for p in rep["problems"] if p["what"].startswith(f"HMOE_NUM_THREADS={value!r}")]
    assert len(threads) == 1 and threads[0]["severity"] == "error" and threads[0]["fix"] == fix, rep["problems"]
    assert f"fix: {fix}" in text
    (st,) = [r for r in rep["selftests"] if r["name"] == "experts"]
    assert not st["ok"]
    (p,) = [p for p in rep["problems"] if p["what"].startswith("self-test experts")]
    assert "could not run" in p["what"] and p["fix"] == fix and "force another variant" not in p["fix"]
    assert [p["what"] for p in rep["problems"] if "self-test" in p["what"]] == [p["what"]]  # grouped_topk passes


def test_check_exit_2_when_the_report_fails(env, monkeypatch, capsys):
    monkeypatch.setattr(compat, "report", lambda **kw: 1 / 0)
    assert compat.check(["check"]) == 2
    assert "could not run" in capsys.readouterr().err
    assert compat.check(["check", "--simulate-gpu", "abc"]) == 2
    assert compat.check(["check", "--simulate-cpu", "sse9"]) == 2


def test_colour_only_when_asked(env):
    buf = io.StringIO()
    compat.check(["check"], stdout=buf)
    assert "\033[" not in buf.getvalue()
    buf = io.StringIO()
    compat.check(["check", "--color", "always"], stdout=buf)
    assert "\033[" in buf.getvalue()


def _two_mla_families(monkeypatch):
    """A manifest whose mla_decode has both families (portable, sm90a) and fake modules for them:
    sm90a declines 16 heads or fewer on long walks (a rule by the shape and the SM count, as the real one's)."""
    from hmoe import _build_info

    R = importlib.import_module("hmoe.compat.report")
    man = dict(MANIFEST, cuda_version="13.0.88", cuda_families={
        "portable": {"module": "hmoe._native.portable", "ops": ["mla_decode"], "sass": ["80", "89", "90"], "ptx": ["90"]},
        "sm90a": {"module": "hmoe._native.sm90a", "ops": ["mla_decode"], "sass": ["90a"], "ptx": []}})
    man["cuda_kernels"] = {f"mla_decode/{f}": dict(e, op="mla_decode", family=f) for f, e in man["cuda_families"].items()}
    monkeypatch.setattr(_build_info, "_manifest", lambda: man)
    for name in ("portable", "sm90a"):
        m = types.ModuleType(f"hmoe._native.{name}")
        m.abi_version = lambda: spec.constants()["abi_version"]
        m.signatures = lambda name=name: _native.expected_table(name)
        m.constants = spec.constants
        m.mla_decode_declines = (lambda sms, b, h, mp, p: "") if name == "portable" else \
            (lambda sms, b, h, mp, p: "few heads are memory-bound" if h <= 16 and b * mp * p > 64 * sms else "")
        monkeypatch.setitem(sys.modules, f"hmoe._native.{name}", m)
    real = R._file
    monkeypatch.setattr(R, "_file", lambda m: f"/fake/{m}.so" if m in ("portable", "sm90a") else real(m))
    monkeypatch.setattr(probes, "ModuleProbe", type("NoChild", (), {
        "__init__": lambda self, name: setattr(self, "name", name), "crashed": lambda self: None}))


def test_both_mla_families_per_device_and_shape(env, monkeypatch):
    _two_mla_families(monkeypatch)
    rep, text = run(simulate_gpu=["9.0", "8.6"], mla_shapes=[(64, 4096, 16, 64), (64, 4096, 128, 64), (1, 4096, 16, 64)])
    h, a = [r for r in rep["selections"] if r["op"] == "mla_decode"]
    assert (h["variant"], h["target"], h["reason"]) == ("sm90a", "sm_90a", "native: sm_90a SASS")
    assert h["alternatives"] == [{"variant": "portable", "target": "sm_90", "ok": True, "reason":
                                  "native: sm_90 SASS; runs the shapes sm90a declines (--mla-shape shows which)"}]
    assert (a["variant"], a["reason"]) == ("portable", "fallback: sm_80 SASS on 8.6 (same major)")
    assert a["alternatives"] == [{"variant": "sm90a", "target": None, "ok": False,
                                  "reason": "unsupported: built for sm_90a SASS; none runs on 8.6"}]
    assert "sm90a (sm_90a): native: sm_90a SASS [simulated]" in text
    assert "  also portable (sm_90): native: sm_90 SASS; runs the shapes sm90a declines" in text
    assert "  also sm90a: unsupported: built for sm_90a SASS; none runs on 8.6" in text
    runs = {(p["device"][:6], p["shape"]): (p["variant"], p["reason"]) for p in rep["plans"]}
    declined = ("fallback: sm90a declines 64 requests of up to 4096 tokens, 16 heads, page size 64: few heads are "
                "memory-bound (as on 132 SMs)")
    sm80 = ("portable", "fallback: sm_80 SASS on 8.6 (same major)")
    assert runs == {
        ("cuda:0", "64x4096x16 page 64"): ("portable", declined),
        ("cuda:0", "64x4096x128 page 64"): ("sm90a", "native: sm_90a SASS (as on 132 SMs)"),
        ("cuda:0", "1x4096x16 page 64"): ("sm90a", "native: sm_90a SASS (as on 132 SMs)"),  # a short walk
        ("cuda:1", "64x4096x16 page 64"): sm80, ("cuda:1", "64x4096x128 page 64"): sm80,
        ("cuda:1", "1x4096x16 page 64"): sm80}
    assert all(p["plan"] is None and p["error"].startswith("plans need the real GPU") for p in rep["plans"])
    assert (f"cuda:0 (simulated GPU, 9.0)  64x4096x16 page 64: portable ({declined}): no plan: plans need the real "
            "GPU") in text
    monkeypatch.setattr(sys.modules["hmoe._native.sm90a"], "mla_decode_declines", lambda *shape: 1 / 0)
    rep, text = run(simulate_gpu=["9.0"], mla_shapes=[(1, 64, 128, 64)])
    (p,) = rep["plans"]
    assert p["variant"] is None and p["reason"].startswith("unknown: hmoe._native.sm90a cannot say (ZeroDivisionError")
    assert "1x64x128 page 64: unknown: hmoe._native.sm90a cannot say" in text


def test_a_forced_family_that_declines_a_simulated_shape_is_an_error(env, monkeypatch):
    # route() refuses HMOE_CUDA_VARIANT=sm90a for a shape sm90a declines; the simulation says the same
    _two_mla_families(monkeypatch)
    monkeypatch.setenv("HMOE_CUDA_VARIANT", "sm90a")
    rep, text = run(simulate_gpu=["9.0"], mla_shapes=[(64, 4096, 16, 64), (64, 4096, 128, 64)])
    runs = {p["shape"]: (p["variant"], p["reason"]) for p in rep["plans"]}
    assert runs["64x4096x128 page 64"][0] == "sm90a"
    variant, reason = runs["64x4096x16 page 64"]
    assert variant is None and reason.startswith("mla_decode: HMOE_CUDA_VARIANT='sm90a' does not serve 64 requests "
                                                 "of up to 4096 tokens, 16 heads, page size 64 on cuda:0")
    assert reason.endswith("few heads are memory-bound; the 'portable' variant serves this shape (force it, or "
                           "leave the choice to hmoe) (as on 132 SMs)")


def test_plans_from_the_gpu_child_name_the_variant(env, monkeypatch):
    # What the torch child reports on a real GPU (probes._CHILD): the route and the plan per shape.
    _two_mla_families(monkeypatch)
    plans = [{"device": "cuda:0", "shape": "64x4096x16 page 64", "variant": "portable",
              "reason": "fallback: sm90a declines 64 requests of up to 4096 tokens, 16 heads, page size 64: few heads",
              "plan": "1 KV split(s), ...",
              "error": None},
             {"device": "cuda:0", "shape": "1x2x3 page 64", "variant": None, "reason": None, "plan": None,
              "error": "ValueError: bad"}]
    monkeypatch.setitem(probes.PythonProbe.answer, "plans", plans)  # PythonProbe is conftest's FakeProbe
    rep, text = run(mla_shapes=[(64, 4096, 16, 64), (1, 2, 3, 64)])
    assert rep["plans"] == plans
    assert ("cuda:0  64x4096x16 page 64: portable (fallback: sm90a declines 64 requests of up to 4096 tokens, 16 "
            "heads, page size 64: few heads): 1 KV split(s), ...") in text
    assert "cuda:0  1x2x3 page 64: no plan: ValueError: bad" in text
