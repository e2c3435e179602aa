# Tests for `python -m hmoe.bench experts`: runs the bench in-process on tiny shapes and checks its table and JSON.
import json
import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import hmoe  # noqa: E402
from hmoe import _reference  # noqa: E402
from hmoe.bench import experts as bench  # noqa: E402
from hmoe.bench import membw  # noqa: E402

# H, I multiples of 64 so any kernel blocking fits; K distinct experts out of E
TINY = ["--shape-custom", "128,64,8,2", "--quick", "--copy-mib", "16", "--no-flush"]


def run_bench(tmp_path, capsys, *extra):
    path = tmp_path / "out.json"
    rc = bench.main([*TINY, "--json", str(path), *extra])
    out = capsys.readouterr().out
    return rc, out, json.loads(path.read_text())


def test_lists_subcommands():
    for args in ([], ["--help"]):
        r = subprocess.run([sys.executable, "-m", "hmoe.bench", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "experts" in r.stdout and "usage" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hmoe.bench", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "experts" in r.stderr


def test_experts_help_lists_options():
    r = subprocess.run([sys.executable, "-m", "hmoe.bench", "experts", "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for opt in ("--shapes", "--tokens", "--dtypes", "--repeats", "--threads", "--isa", "--quick",
                "--experts-resident", "--json"):
        assert opt in r.stdout


def test_tiny_run_table_and_json(tmp_path, capsys):
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "1,3,33", "--dtypes", "bf16,fp16,fp32")
    assert rc == 0, out
    table = [line for line in out.splitlines() if line.startswith("custom ")]
    assert len(table) == len(data["results"]) and not any("FAIL" in line for line in table)
    assert "ms(med)" in out and "bytes read + bytes written" in out
    copy = data["copy_bandwidth"]
    assert copy["gbps"] > 0 and copy["bytes_counted_per_copy"] == 2 * copy["bytes_buffer"]
    rows = data["results"]
    impls = {(r["T"], r["dtype"], r["impl"]) for r in rows}
    for T in (1, 3, 33):
        for d in ("bf16", "fp16", "fp32"):
            assert (T, d, "torch-loop") in impls and (T, d, "CPUExperts") in impls
            # the functional API runs on decode rows only
            assert ((T, d, "moe_experts_cpu") in impls) == (T <= bench.DECODE_MAX_T)
    dt = lambda r: bench.torch_dtype(r["dtype"])  # noqa: E731
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["gbps"] > 0 and r["copy_frac"] > 0 and r["speedup"] > 0
        assert math.isfinite(r["ms"]) and r["repeats"] >= 1 and len(r["ms_all"]) == r["repeats"]
        assert r["threads"] >= 1 and r["isa"]
        # distinct experts hit: at least K, at most E
        per_expert = 3 * 128 * 64 * {"bf16": 2, "fp16": 2, "fp32": 4}[r["dtype"]]
        assert 2 * per_expert <= r["bytes_hit_mean"] <= 8 * per_expert
        if r["impl"] == "torch-loop":
            assert r["speedup"] == 1.0
        else:
            c = r["check"]
            assert c["ok"] and c["rel_err"] <= _reference.tolerance("moe_experts_vs_torch_loop", dt(r), w_dtype=dt(r)), r
            assert f"ok {c['rel_err']:.1e}" in out
    assert data["failures"] == 0 and not data["skipped"]
    isa = {r["isa"] for r in rows if r["impl"] == "CPUExperts"}
    assert len(isa) == 1 and isa != {"auto"}


def test_wrong_results_are_flagged(tmp_path, capsys, monkeypatch):
    class ZeroExperts:  # the failure the bench must catch: empty output for a dtype
        isa = "broken"

        def __init__(self, w13, w2, *, isa=None):
            pass

        def __call__(self, x, ids, weights):
            return torch.zeros_like(x)

    monkeypatch.setattr(hmoe, "CPUExperts", ZeroExperts)
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "33", "--dtypes", "bf16")
    assert rc == 1
    assert "FAIL rel_err 1.0e+00" in out
    assert data["failures"] == 1


def test_wrong_dtype_is_flagged(tmp_path, capsys, monkeypatch):
    class Fp32Experts:  # right numbers, wrong output dtype (contract: result in x.dtype)
        isa = "fp32out"

        def __init__(self, w13, w2, *, isa=None):
            self.w13, self.w2 = w13, w2

        def __call__(self, x, ids, weights):
            return bench.torch_expert_loop(x, ids, weights, self.w13, self.w2).float()

    monkeypatch.setattr(hmoe, "CPUExperts", Fp32Experts)
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "33", "--dtypes", "bf16")
    assert rc == 1 and "FAIL" in out and "torch.float32" in out


def test_skips_what_does_not_fit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(membw, "mem_available_bytes", lambda: 1 << 20)
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "1", "--dtypes", "fp32")
    assert rc == 0
    assert "skip custom fp32: needs" in out
    assert data["skipped"] and not data["results"]


def test_torch_loop_matches_fp64_formula():
    shape = bench.Shape("t", 32, 16, 6, 3, 6)
    w13, w2 = bench.make_weights(shape, torch.float64, 1, lambda m: None)
    x, ids, wts = bench.make_inputs(shape, 5, torch.float64, 2)
    assert all(len(set(row.tolist())) == 3 for row in ids)  # distinct experts per token
    ref = torch.zeros(5, 32, dtype=torch.float64)
    for t in range(5):
        for k in range(3):
            e = int(ids[t, k])
            g, u = w13[e, :16] @ x[t], w13[e, 16:] @ x[t]
            ref[t] += wts[t, k].double() * (w2[e] @ (g * torch.sigmoid(g) * u))
    got = bench.torch_expert_loop(x, ids, wts, w13, w2)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_memory_helpers_are_sane():
    assert membw.llc_bytes() > 0
    assert membw.mem_total_bytes() >= membw.mem_available_bytes() > 0
    assert membw.copy_buffer_bytes() >= 64 << 20
