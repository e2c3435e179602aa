"""python -m hmoe.bench e2e on the tiny preset, CPU only: runs, compares with transformers, writes JSON;
and its refusals of bad options, which need no transformers."""
import json
import subprocess
import sys

import pytest


def bench(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hmoe.bench", "e2e", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_e2e_bench_tiny_cpu(tmp_path):
    pytest.importorskip("transformers", reason="the e2e bench builds transformers models")
    path = tmp_path / "e2e.json"
    cmd = [sys.executable, "-m", "hmoe.bench", "e2e", "--preset", "tiny", "--cpu-only", "--steps", "2",
           "--baseline-steps", "1", "--prefill", "16", "--batches", "1,2", "--json", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hmoe eager, B=1" in out.stdout and "baseline: transformers on the CPU" in out.stdout
    assert "4 rounds of 2 steps" in out.stdout
    assert "swapped 2 MoE blocks" in out.stdout
    res = json.loads(path.read_text())
    assert set(res["decode"]) == {"1", "2"}
    for e in res["decode"].values():
        assert e["eager"] > 0 and e["bound_s"] > 0 and e["cpu_experts_alone_s"] > 0
        assert e["eager cpu experts inside"] == 0  # no hand-over on a CUDA stream on the CPU
        low, high = e["eager ratio range"]  # the rounds' step / experts-alone ratios; the row's is their median
        assert 0 < low <= e["eager / cpu experts alone"] <= high
    assert res["prefill"]["hmoe_s"] > 0 and res["baseline"]["prefill_s"] > 0
    assert res["read_bw"]["gbps"] > 0


def test_e2e_bench_rejects_bad_options():
    out = subprocess.run([sys.executable, "-m", "hmoe.bench", "e2e", "--batches", "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--batches" in out.stderr
    out = subprocess.run([sys.executable, "-m", "hmoe.bench", "e2e", "--rounds", "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--rounds" in out.stderr
    out = subprocess.run([sys.executable, "-m", "hmoe.bench", "e2e", "--handovers", "doorbell,pigeon"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--handovers must list some of doorbell, host_func" in out.stderr
    out = bench("--preset", "huge", "--cpu-only")
    assert out.returncode == 2 and "argument --preset: invalid choice: 'huge'" in out.stderr and "tiny" in out.stderr
    for opt, value, rule in (("--layers", "0", "a positive whole number"), ("--steps", "-1", "a positive whole number"),
                             ("--prefill", "-1", "a whole number >= 0"), ("--prompt", "x", "a positive whole number")):
        out = bench(opt, value, "--preset", "tiny", "--cpu-only")
        assert out.returncode == 2 and f"argument {opt}: must be {rule}, got '{value}'" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    out = bench("--preset", "tiny", "--cpu-only", "--json", "/nonexistent/dir/e2e.json")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "argument --json: cannot write '/nonexistent/dir/e2e.json': the directory /nonexistent/dir does not exist" \
        in out.stderr


def test_e2e_bench_without_transformers(monkeypatch, capsys):
    from hmoe.bench import e2e

    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when it is absent
    assert e2e.transformers_missing() == "it is not installed"
    assert e2e.main(["--preset", "tiny", "--cpu-only"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and not captured.out, captured
    assert "needs transformers" in err and "not installed" in err and "pip install 'transformers>=4.48'" in err
