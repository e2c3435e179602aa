"""python -m hmoe.bench e2e on the tiny preset, CPU only: runs, compares with transformers, writes JSON."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the e2e bench builds transformers models")


def test_e2e_bench_tiny_cpu(tmp_path):
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
    out = subprocess.run([sys.executable, "-m", "hmoe.bench", "e2e", "--preset", "huge", "--cpu-only"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "unknown preset 'huge'" in out.stderr
