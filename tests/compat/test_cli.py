"""`python -m hmoe.compat check` as a user runs it: exit codes, speed, JSON, and failures injected
into a copy of the installed package or through fake torch/flashinfer packages."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hmoe
from hmoe import _build_info, compat
from hmoe.compat import probes
from hmoe.hardware import gpu

from . import minischema
from .build import needs_sass

SCHEMA = json.loads((Path(compat.__file__).parent / "schema.json").read_text())
PKG = Path(hmoe.__file__).resolve().parent


def cli(*args, pythonpath=None, cwd=None, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HMOE_")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "hmoe.compat", "check", *args], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_plain_and_ok_without_gpu(tmp_path):
    # Speed is the benchmarks' business; cli()'s timeout (120 s) only catches a hang.
    p = cli(cwd=tmp_path)
    assert "\033[" not in p.stdout and "== selected variant per device and op" in p.stdout
    if gpu.detect(refresh=True).visible:
        # With GPUs a CUDA torch imports slower and the verdict depends on the machine.
        assert p.returncode in (0, 1), p.stdout + p.stderr
        return
    assert p.returncode == 0 and "== problems\n  none" in p.stdout, p.stdout + p.stderr


@needs_sass("80", "90")
def test_json_validates(tmp_path):
    p = cli("--json", "--simulate-gpu", "9.0", "--simulate-gpu", "8.6", cwd=tmp_path)
    rep = json.loads(p.stdout)
    assert minischema.errors(rep, SCHEMA) == [] and p.returncode == rep["exit_code"] == 0


@pytest.mark.parametrize("args, code", [(["--simulate-gpu", "7.5"], 1),
                                        (["--simulate-gpu", "seven"], 2),
                                        (["--simulate-cpu", "sse9"], 2),
                                        (["--no-such-option"], 2)])
def test_exit_codes(tmp_path, args, code):
    p = cli(*args, cwd=tmp_path)
    assert p.returncode == code, p.stdout + p.stderr


def test_bad_environment_variables(tmp_path):
    p = cli(cwd=tmp_path, env_extra={"HMOE_COMPAT_TIMEOUT": "0"})
    assert "WARNING: HMOE_COMPAT_TIMEOUT='0' is not a finite number of seconds > 0: ignored" in p.stdout
    assert "took over" not in p.stdout and "reinstall" not in p.stdout, p.stdout
    if not gpu.detect(refresh=True).visible:
        assert p.returncode == 0, p.stdout + p.stderr
    p = cli("--json", cwd=tmp_path, env_extra={"HMOE_NUM_THREADS": "abc"})
    rep = json.loads(p.stdout)
    assert p.returncode == rep["exit_code"] == 1 and minischema.errors(rep, SCHEMA) == []
    assert any(q["what"].startswith("HMOE_NUM_THREADS='abc'") and q["severity"] == "error"
               and q["fix"] == "set HMOE_NUM_THREADS to an integer 1..1024 or unset it" for q in rep["problems"])


@pytest.fixture
def pkg_copy(tmp_path):
    """A copy of the installed hmoe package, first on the path of the child process."""
    root = tmp_path / "site"
    shutil.copytree(PKG, root / "hmoe", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _module_file(root, module):
    (f,) = list((root / "hmoe" / "_native").glob(f"{module}.*.so")) or \
        list((root / "hmoe" / "_native").glob(f"{module}.*"))
    return f


def test_corrupt_and_missing_module_files(pkg_copy, tmp_path):
    _module_file(pkg_copy, "experts_generic").write_bytes(b"\x7fELF this is not a shared object")
    _module_file(pkg_copy, "experts_avx2").unlink()
    p = cli("--json", pythonpath=pkg_copy, cwd=tmp_path)
    rep = json.loads(p.stdout)
    assert rep["hmoe"]["install_path"] == str(pkg_copy / "hmoe")
    status = {v["module"]: v["status"] for v in rep["variants"]}
    assert status["experts_generic"] == "load_error" and status["experts_avx2"] == "missing"
    assert p.returncode == 1 and minischema.errors(rep, SCHEMA) == []
    text = cli(pythonpath=pkg_copy, cwd=tmp_path).stdout
    assert "experts_avx2" in text and "missing" in text and "fix: reinstall hmoe" in text


def test_missing_manifest(pkg_copy, tmp_path):
    (pkg_copy / "hmoe" / "build_info.json").unlink()
    p = cli(pythonpath=pkg_copy, cwd=tmp_path)
    assert p.returncode == 1 and "build manifest is unreadable" in p.stdout, p.stdout + p.stderr


def _fake_packages(root, torch_body=None, flashinfer_body=None):
    root.mkdir(exist_ok=True)
    for name, body in (("torch", torch_body), ("flashinfer", flashinfer_body)):
        if body is not None:
            (root / name).mkdir()
            (root / name / "__init__.py").write_text(body)
    return root


def test_probe_broken_torch_and_versionless_flashinfer(tmp_path, monkeypatch):
    fake = _fake_packages(tmp_path / "fake", "raise OSError('libcudnn.so.9: cannot open shared object file')",
                          "")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    got = probes.PythonProbe().result()
    assert got["torch"]["installed"] and "libcudnn.so.9" in got["torch"]["error"]
    assert got["flashinfer"] == {"installed": True, "version": None}


def test_probe_crashing_torch(tmp_path, monkeypatch):
    fake = _fake_packages(tmp_path / "fake", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    got = probes.PythonProbe().result()
    assert "killed by signal 11" in got["torch"]["error"]


def test_probe_hanging_torch(tmp_path, monkeypatch):
    fake = _fake_packages(tmp_path / "fake", "import time\ntime.sleep(60)")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    got = probes.PythonProbe(timeout=1.0).result()
    assert "took over 1 s" in got["torch"]["error"]


def test_probe_flashinfer_version(tmp_path, monkeypatch):
    fake = _fake_packages(tmp_path / "fake", None, "__version__ = '0.2.9'")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    assert probes.PythonProbe().result()["flashinfer"] == {"installed": True, "version": "0.2.9"}


def test_cli_with_broken_torch(tmp_path):
    fake = _fake_packages(tmp_path / "fake", "raise ImportError('undefined symbol: cudaGetDriverEntryPoint')")
    p = cli(pythonpath=fake, cwd=tmp_path)
    assert p.returncode == 1 and "torch is broken: ImportError: undefined symbol" in p.stdout
    assert "torch         broken" in p.stdout


def test_mla_plans(tmp_path):
    p = cli("--json", "--mla-shape", "1x32768x128", "--mla-shape", "64x4096x16:32", cwd=tmp_path)
    rep = json.loads(p.stdout)
    assert minischema.errors(rep, SCHEMA) == []
    shapes = {r["shape"] for r in rep["plans"]}
    assert shapes == {"1x32768x128 page 64", "64x4096x16 page 32"}
    if gpu.detect(refresh=True).visible:  # the variant that runs each shape (mla.route), and its plan
        assert all(r["plan"] and "KV split" in r["plan"] and r["variant"] and r["reason"] for r in rep["plans"]), \
            rep["plans"]
    else:
        assert all(r["plan"] is None and r["error"] for r in rep["plans"])
    sim = json.loads(cli("--json", "--simulate-gpu", "9.0", "--mla-shape", "8x4096x16", cwd=tmp_path).stdout)
    if _build_info.cuda_kernels_for("mla_decode"):
        assert sim["plans"] and all(r["error"].startswith("plans need the real GPU") for r in sim["plans"])
    else:  # nothing would run it: the reason, not a plan the real GPU could give
        assert sim["plans"] and all(r["variant"] is None and r["error"].startswith(
            "no variant runs it: no GPU kernels in this build") for r in sim["plans"]), sim["plans"]
    if "sm90a" in _build_info.cuda_kernels_for("mla_decode"):  # 16 heads, one wave of short walks: sm90a runs it
        (r,) = sim["plans"]
        assert r["variant"] == "sm90a" and r["reason"] == "native: sm_90a SASS (as on 132 SMs)", r
        # two waves of sm90a's CTAs, and a small call: sm90a declines, portable runs them
        two_waves, small = json.loads(cli("--json", "--simulate-gpu", "9.0", "--mla-shape", "256x1024x16",
                                          "--mla-shape", "2x4096x16", cwd=tmp_path).stdout)["plans"]
        assert two_waves["variant"] == "portable" and two_waves["reason"].startswith(
            "fallback: sm90a declines 256 requests of up to 1024 tokens, 16 heads, page size 64: 16 heads or fewer on "
            "more requests than the device has SMs"), two_waves
        assert small["variant"] == "portable" and "on a cache of fewer than 16384 tokens" in small["reason"], small
    bad = cli("--mla-shape", "1x2", cwd=tmp_path)
    assert bad.returncode == 2 and "not a shape" in bad.stderr
