# Tests for `python -m hmoe.bench experts`: runs the bench in-process on tiny shapes and checks its CLI, table and JSON.
import json
import math
import statistics
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import hmoe  # noqa: E402
from hmoe import _reference, _threads, quant  # noqa: E402
from hmoe.bench import experts as bench  # noqa: E402
from hmoe.bench import experts_run, kt_peer, membw  # noqa: E402

# H, I multiples of 64 so any kernel blocking fits; K distinct experts out of E. No peer: the
# kt-kernel rows have their own tests (test_kt_peer.py).
TINY = ["--shape-custom", "128,64,8,2", "--quick", "--copy-mib", "16", "--no-flush", "--idle-ms", "1",
        "--peer", "none"]


def run_bench(tmp_path, capsys, *extra, args=TINY):
    path = tmp_path / "out.json"
    rc = bench.main([*args, "--json", str(path), *extra])
    out = capsys.readouterr().out
    return rc, out, json.loads(path.read_text())


def table_rows(out):
    return [line for line in out.splitlines() if line.startswith("custom ")]


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
    for opt in ("--shapes", "--tokens", "--formats", "--dtypes", "--int8-group", "--int4-group", "--peer",
                "--peer-threads", "--idle-ms", "--repeats", "--threads", "--isa", "--quick", "--experts-resident",
                "--json"):
        assert opt in r.stdout


def test_cli_formats_and_flags(capsys):
    opts = bench.parse_args([], "prog")
    assert opts.formats == bench.DEFAULT_FORMATS.split(",") == ["bf16", "int8", "int4", "fp8"]
    assert (opts.int8_group, opts.int4_group, opts.peer, opts.idle_ms) == (None, 128, "auto", 100.0)
    opts = bench.parse_args(["--formats", "fp32,int4,fp8", "--int8-group", "64", "--int4-group", "32",
                             "--peer", "none", "--peer-threads", "3", "--idle-ms", "0"], "prog")
    assert opts.formats == ["fp32", "int4", "fp8"]
    assert (opts.int8_group, opts.int4_group, opts.peer, opts.peer_threads, opts.idle_ms) == (64, 32, "none", 3, 0)
    assert bench.parse_args(["--dtypes", "bf16,fp16"], "prog").formats == ["bf16", "fp16"]  # the older name
    bad = (["--formats", "bf16,int3"], ["--formats", ","], ["--int4-group", "100"], ["--int8-group", "7"],
           ["--peer", "llama"], ["--idle-ms", "-1"], ["--peer-threads", "0"], ["--tokens", "0"], ["--rounds", "0"])
    for argv in bad:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv, "prog")
        assert e.value.code == 2, argv
    assert "unknown format(s) ['int3']" in capsys.readouterr().err


def parse_error(capsys, *argv) -> str:
    """parse_args must refuse argv with an argparse error (exit status 2); returns that one line."""
    with pytest.raises(SystemExit) as e:
        bench.parse_args(list(argv), "prog")
    assert e.value.code == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_cli_rejects_bad_numbers_at_parse_time(capsys):
    for opt in ("--repeats", "--copy-mib", "--rounds", "--peer-threads"):
        for value in ("0", "-5", "x"):
            err = parse_error(capsys, opt, value)
            assert f"argument {opt}: must be a positive whole number, got '{value}'" in err, err
    err = parse_error(capsys, "--warmup", "-1")
    assert "argument --warmup: must be a whole number >= 0" in err
    # the range of hmoe.set_num_threads
    for value in ("0", str(_threads.MAX_THREADS + 1), "5000"):
        err = parse_error(capsys, "--threads", value)
        assert "argument --threads" in err and f"from 1 to {_threads.MAX_THREADS}" in err and value in err
    assert bench.parse_args(["--threads", str(_threads.MAX_THREADS)], "prog").threads == _threads.MAX_THREADS
    # defaults only when the option is absent, never in place of a value given
    opts = bench.parse_args([], "prog")
    assert (opts.repeats, opts.copy_mib) == (10, None)
    assert bench.parse_args(["--quick"], "prog").repeats == 2
    assert bench._probe_bytes(bench.parse_args(["--quick"], "prog")) == 256 << 20
    opts = bench.parse_args(["--quick", "--repeats", "1", "--copy-mib", "1"], "prog")
    assert (opts.repeats, bench._probe_bytes(opts)) == (1, 1 << 20)


def test_cli_isa_checked_before_any_work(capsys, monkeypatch):
    from hmoe.hardware import cpu

    names = [lv["name"] for lv in cpu.levels()]
    err = parse_error(capsys, "--isa", "foo")
    assert "argument --isa: invalid choice: 'foo'" in err and all(n in err for n in names), err
    info = cpu.cpu_info(request_amx=True)  # as the selection does: without the grant AMX looked unrunnable
    runnable = [lv["name"] for lv in cpu.levels() if not cpu.missing_requirements(lv, info)]
    assert bench.parse_args(["--isa", runnable[-1]], "prog").isa == runnable[-1]
    cannot = [lv for lv in cpu.levels() if cpu.missing_requirements(lv, info)]
    if cannot:  # the library's own refusal (hmoe.dispatch.select_cpu), before the bandwidth probes
        err = parse_error(capsys, "--isa", cannot[0]["name"])
        assert f"--isa {cannot[0]['name']}: this CPU/OS cannot run it (missing" in err, err
        assert cpu.missing_requirements(cannot[0], info)[0] in err
        with pytest.raises(SystemExit) as e:
            bench.main([*TINY, "--isa", cannot[0]["name"]])
        assert e.value.code == 2 and "measuring" not in capsys.readouterr().err
    monkeypatch.setenv("HMOE_CPU_ISA", "foo")
    err = parse_error(capsys)
    assert "HMOE_CPU_ISA='foo' is not an ISA level" in err


def test_cli_bad_thread_variable_checked_before_any_work(capsys, monkeypatch):
    monkeypatch.setenv("HMOE_NUM_THREADS", "abc")
    err = parse_error(capsys)
    assert "HMOE_NUM_THREADS='abc'" in err and "--threads" in err
    assert bench.parse_args(["--threads", "2"], "prog").threads == 2  # --threads overrides the variable


def test_cli_json_path_checked_before_any_work(tmp_path, capsys):
    err = parse_error(capsys, "--json", "/nonexistent/dir/x.json")
    assert "argument --json: cannot write '/nonexistent/dir/x.json': the directory /nonexistent/dir does not exist" in err
    err = parse_error(capsys, "--json", str(tmp_path))
    assert "it is a directory" in err
    (tmp_path / "file").write_text("")
    err = parse_error(capsys, "--json", str(tmp_path / "file" / "x.json"))
    assert "is not a directory" in err
    assert bench.parse_args(["--json", str(tmp_path / "x.json")], "prog").json == str(tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()  # checked, not created
    r = subprocess.run([sys.executable, "-m", "hmoe.bench", "experts", *TINY, "--json", "/nonexistent/dir/x.json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "measuring" not in r.stderr
    assert "/nonexistent/dir does not exist" in r.stderr


def test_peer_choice_says_why(monkeypatch, capsys):
    def unavailable():
        raise kt_peer.KtUnavailable("no kt_kernel folder on sys.path")

    monkeypatch.setattr(kt_peer, "load", unavailable)
    assert bench.resolve_peer("auto") == (None, "peer: none (kt-kernel is not available: no kt_kernel folder on sys.path)")
    assert bench.resolve_peer("none") == (None, "peer: none (--peer none)")
    with pytest.raises(kt_peer.KtUnavailable):
        bench.resolve_peer("kt-kernel")
    rc = bench.main([*TINY[:-2], "--peer", "kt-kernel", "--formats", "fp32", "--tokens", "1"])
    assert rc == 2 and "no kt_kernel folder on sys.path" in capsys.readouterr().err


def test_tiny_run_table_and_json(tmp_path, capsys):
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "1,3,33", "--formats", "bf16,fp16,fp32")
    assert rc == 0, out
    table = table_rows(out)
    assert len(table) == len(data["results"]) and not any("FAIL" in line for line in table)
    for title in ("cold ms", "b2b ms", "MB/call", "%read", "b2b%rd", "err(fp32 ref)", "check"):
        assert title in out
    assert "read bandwidth:" in out and "the decode ceiling" in out and "bytes read + bytes written" in out
    read, copy = data["read_bandwidth"], data["copy_bandwidth"]
    assert read["gbps"] > 0 and read["counts"] == "bytes read"
    assert copy["gbps"] > 0 and copy["bytes_counted_per_copy"] == 2 * copy["bytes_buffer"]
    assert data["meta"]["cpu"] and data["meta"]["threads_hmoe"] >= 1 and data["meta"]["peer"] is None
    floor = data["meta"]["cold_floor"]
    assert floor["cold_us"] > 0 and floor["b2b_us"] > 0 and floor["calls"] >= 5 and "cold floor:" in out
    rows = data["results"]
    impls = {(r["T"], r["format"], r["impl"]) for r in rows}
    for T in (1, 3, 33):
        for f in ("bf16", "fp16", "fp32"):
            assert (T, f, "torch-loop") in impls and (T, f, "CPUExperts") in impls
            # the functional API runs on decode rows only
            assert ((T, f, "moe_experts_cpu") in impls) == (T <= bench.DECODE_MAX_T)
    for r in rows:
        assert "error" not in r, r
        for key in ("ms", "b2b_ms", "gbps", "b2b_gbps", "read_frac", "b2b_read_frac", "speedup", "gflops"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["repeats"] >= 1 and len(r["ms_all"]) == len(r["b2b_ms_all"]) == r["repeats"]
        assert all(t > 0 for t in r["ms_all"] + r["b2b_ms_all"])
        assert r["read_frac"] == pytest.approx(r["gbps"] / read["gbps"])
        assert r["threads"] >= 1 and r["isa"] and r["x_dtype"] == r["format"]
        # distinct experts hit: at least K, at most E; each impl counts its own storage
        elt = {"bf16": 2, "fp16": 2, "fp32": 4}[r["format"]]
        assert r["bytes_per_expert"] >= 3 * 128 * 64 * elt
        assert 2 * r["bytes_per_expert"] <= r["bytes_hit_mean"] <= 8 * r["bytes_per_expert"]
        assert 0 < r["err_fp64"] < 5e-2
        if r["impl"] == "torch-loop":
            assert r["speedup"] == 1.0 and "check" not in r
        else:
            c, dt = r["check"], bench.torch_dtype(r["format"])
            assert c["ok"] and c["rel_err"] <= _reference.tolerance("moe_experts", dt, w_dtype=dt) == c["tol"], r
            assert c["tokens"] == r["T"] and f"ok {c['rel_err']:.1e}" in out
    assert data["failures"] == 0 and not data["skipped"]
    isa = {r["isa"] for r in rows if r["impl"] == "CPUExperts"}
    assert len(isa) == 1 and isa != {"auto"}


def test_rounds_pool_the_calls_and_pair_the_ratios(tmp_path, capsys):
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "2,33", "--formats", "fp32", "--repeats", "3",
                              "--rounds", "3")
    assert rc == 0, out
    assert data["meta"]["rounds"] == 3 and "all blocks 3 times (rounds" in out
    rows = data["results"]
    assert len(table_rows(out)) == len(rows) == 5  # torch loop, CPUExperts at both T; moe_experts_cpu at T = 2
    for r in rows:
        assert r["rounds"] == 3 and len(r["rounds_ms"]) == 3 and all(t > 0 for t in r["rounds_ms"])
        # --quick stops a block after min_repeats once its time budget is spent: 1 to 3 calls a round
        assert 3 <= r["repeats"] == len(r["ms_all"]) == len(r["b2b_ms_all"]) <= 9
        assert r["ms"] == pytest.approx(1e3 * statistics.median(t / 1e3 for t in r["ms_all"]))
        assert len(r["speedup_rounds"]) == 3 and r["vs_kt_rounds"] == [None] * 3 and r["vs_kt"] is None
        assert r["speedup"] == statistics.median(r["speedup_rounds"])
        if r["impl"] == "torch-loop":
            assert r["speedup_rounds"] == [1.0] * 3
        else:
            assert r["check"]["ok"] and 0 < r["err_fp64"] < 5e-2


def test_merge_rounds_keeps_a_failed_round():
    shape = bench.Shape("custom", 128, 64, 8, 2, 8)
    good = {"impl": "CPUExperts", "repeats": 1, "ms": 2.0, "ms_all": [2.0], "b2b_ms_all": [1.0], "b2b_ms": 1.0,
            "bytes_per_expert": 100, "speedup": 3.0, "vs_kt": None}
    merged = experts_run.merge_rounds([good, dict(good, ms_all=[4.0], ms=4.0, speedup=1.0)], [2, 3], 10.0, shape, 4)
    assert merged["rounds"] == 2 and merged["ms_all"] == [2.0, 4.0] and merged["ms"] == 3.0
    # each round calls batches 0, 1, ...: batch 0 hits 2 experts in both
    assert merged["bytes_hit_mean"] == 200 and merged["speedup"] == 2.0 and merged["speedup_rounds"] == [3.0, 1.0]
    failed = experts_run.merge_rounds([good, {"impl": "CPUExperts", "error": "RuntimeError: boom"}], [2], 10.0, shape, 4)
    assert failed["error"] == "RuntimeError: boom" and failed["rounds"] == 2 and "ms" not in failed
    assert experts_run.merge_rounds([good], [2], 10.0, shape, 4) == dict(good, rounds=1)


def test_err_column_against_an_independent_reference(tmp_path, capsys, monkeypatch):
    real = hmoe.CPUExperts
    seen = {}

    class Recording:  # the real CPUExperts, recording the weights and every call
        def __init__(self, w13, w2, *, isa=None):
            seen["w"] = (w13.clone(), w2.clone())
            seen["calls"] = []
            self._real = real(w13, w2, isa=isa)
            self.isa, self.packed_bytes = self._real.isa, self._real.packed_bytes

        def __call__(self, x, ids, weights):
            out = self._real(x, ids, weights)
            seen["calls"].append((x.clone(), ids.clone(), weights.clone(), out.clone()))
            return out

    monkeypatch.setattr(hmoe, "CPUExperts", Recording)
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "5", "--formats", "bf16", "--warmup", "1")
    assert rc == 0, out
    (row,) = [r for r in data["results"] if r["impl"] == "CPUExperts"]
    x, ids, wts, got = seen["calls"][1]  # after the one warm-up call: the first cold call
    w13, w2 = (w.double() for w in seen["w"])
    I = w2.shape[2]
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            g, u = w13[e, :I] @ x[t].double(), w13[e, I:] @ x[t].double()
            ref[t] += float(wts[t, k]) * (w2[e] @ (g * torch.sigmoid(g) * u))
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert row["err_fp64"] == pytest.approx(err, rel=1e-9) and 0 < err < 2e-2
    assert f"{err:.1e}" in [line for line in table_rows(out) if "CPUExperts" in line][0]


def test_rows_for_every_format(tmp_path, capsys):
    """The real path: hmoe.quant of the bench's weights into CPUExperts, every format measured and
    checked against its contract reference."""
    formats = list(experts_run.FORMATS)
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "1,5", "--formats", ",".join(formats),
                              "--int4-group", "32", args=[TINY[0], "256,128,8,2", *TINY[2:]])
    assert rc == 0, out
    rows = {(r["format"], r["T"]): r for r in data["results"] if r["impl"] == "CPUExperts"}
    assert set(rows) == {(f, T) for f in formats for T in (1, 5)}
    for (f, T), r in rows.items():
        assert "error" not in r, r
        assert r["hmoe_format"] == f and r["x_dtype"] == experts_run.weight_dtype_name(f)
        assert r["ms"] > 0 and r["b2b_ms"] > 0 and r["read_frac"] > 0 and r["b2b_read_frac"] > 0
        assert r["bytes_per_expert"] * 8 == r["packed_bytes"]  # packed bytes of one expert, scales included
        c, w_dtype = r["check"], f if f in experts_run.QUANT_FORMATS else bench.torch_dtype(f)
        assert c["ok"] and c["tol"] == _reference.tolerance("moe_experts", bench.torch_dtype(r["x_dtype"]), w_dtype=w_dtype)
        assert c["tokens"] == T
        assert 0 < r["err_fp64"] < 0.3
    per_expert = {f: rows[(f, 1)]["bytes_per_expert"] for f in formats}
    assert per_expert["int4"] < per_expert["int8"] <= per_expert["fp8"] < per_expert["bf16"] < per_expert["fp32"]
    err = {f: rows[(f, 5)]["err_fp64"] for f in formats}  # against the original weights: what each format loses
    assert err["fp32"] < err["bf16"] < err["fp8"] < err["int4"] and err["int8"] < err["int4"]


def test_quantised_formats_never_crash_the_bench(tmp_path, capsys, monkeypatch):
    real = hmoe.CPUExperts

    class FloatOnly:  # an hmoe without quantised kernels: CPUExperts refuses QuantizedWeights
        def __new__(cls, w13, w2, *, isa=None):
            if not isinstance(w13, torch.Tensor):
                raise TypeError(f"w13 must be a torch.Tensor, got {type(w13).__name__}")
            return real(w13, w2, isa=isa)

    monkeypatch.setattr(hmoe, "CPUExperts", FloatOnly)
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "1,3", "--formats", "fp32,int8,int4,fp8",
                              "--int4-group", "32", args=[TINY[0], "256,128,8,2", *TINY[2:]])
    assert rc == 1
    rows = data["results"]
    for f in ("int8", "int4", "fp8"):
        bad = [r for r in rows if r["format"] == f]
        assert {r["impl"] for r in bad} == {"CPUExperts"} and len(bad) == 2
        assert all(r["error"].startswith("CPUExperts: TypeError: w13 must be a torch.Tensor") for r in bad)
        assert all(r["weights_from"] == "bf16" and r["x_dtype"] == "bf16" for r in bad)
    assert sum("FAIL error: CPUExperts: TypeError" in line for line in table_rows(out)) == 6
    assert all("error" not in r and r["check"]["ok"] for r in rows if r["format"] == "fp32" and r["impl"] != "torch-loop")
    assert data["failures"] == 6 and "6 FAILED" in out


def test_wrong_results_are_flagged(tmp_path, capsys, monkeypatch):
    class ZeroExperts:  # the failure the bench must catch: empty output for a dtype
        isa, packed_bytes = "broken", 8 * 3 * 128 * 64 * 2

        def __init__(self, w13, w2, *, isa=None):
            pass

        def __call__(self, x, ids, weights):
            return torch.zeros_like(x)

    monkeypatch.setattr(hmoe, "CPUExperts", ZeroExperts)
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "33", "--formats", "bf16")
    assert rc == 1
    assert "FAIL rel_err 1.0e+00" in out
    assert data["failures"] == 1
    (row,) = [r for r in data["results"] if r["impl"] == "CPUExperts"]
    assert row["err_fp64"] == pytest.approx(1.0)


def test_wrong_dtype_is_flagged(tmp_path, capsys, monkeypatch):
    class Fp32Experts:  # right numbers, wrong output dtype (contract: result in x.dtype)
        isa, packed_bytes = "fp32out", 8 * 3 * 128 * 64 * 2

        def __init__(self, w13, w2, *, isa=None):
            self.w13, self.w2 = w13, w2

        def __call__(self, x, ids, weights):
            return bench.torch_expert_loop(x, ids, weights, self.w13, self.w2).float()

    monkeypatch.setattr(hmoe, "CPUExperts", Fp32Experts)
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "33", "--formats", "bf16")
    assert rc == 1 and "FAIL" in out and "torch.float32" in out


def test_skips_what_does_not_fit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(membw, "mem_available_bytes", lambda: 1 << 20)
    rc, out, data = run_bench(tmp_path, capsys, "--tokens", "1", "--formats", "fp32,int4")
    assert rc == 0
    assert "skip custom fp32: needs" in out and "skip custom int4: needs" in out
    assert [s["format"] for s in data["skipped"]] == ["fp32", "int4"] and not data["results"]


def test_time_block_cold_then_back_to_back():
    log = []

    class Opts:
        warmup, repeats, min_repeats, time_budget = 1, 3, 1, 60.0

    def fn(r):
        log.append(("call", r))
        return r * 10

    cold, b2b, first = experts_run.time_block(fn, lambda r: (r,), Opts, lambda: log.append(("gap",)))
    assert first == 0 and len(cold) == len(b2b) == 3 and all(t > 0 for t in cold + b2b)
    # warm-up, a gap before every cold call, one untimed call, then the same batches without gaps
    assert log == [("call", -1), ("gap",), ("call", 0), ("gap",), ("call", 1), ("gap",), ("call", 2),
                   ("call", 2), ("call", 0), ("call", 1), ("call", 2)]


def test_reference_one_expert_at_a_time_is_the_reference_module():
    shape = bench.Shape("t", 128, 64, 6, 3, 6)
    for fmt in experts_run.FORMATS:
        w13, w2 = bench.make_weights(shape, bench.torch_dtype(experts_run.weight_dtype_name(fmt)), 1, lambda m: None)
        if fmt in experts_run.QUANT_FORMATS:
            kw = {"int4": {"group_size": 32}}.get(fmt, {})  # int8 per row, int4 in groups, fp8 in blocks
            w13, w2 = quant.quantize(w13, fmt, **kw), quant.quantize(w2, fmt, **kw)
        for x_dtype in (torch.float32, torch.bfloat16):
            x, ids, wts = bench.make_inputs(shape, 7, x_dtype, 2)
            for contract in (False, True):
                want = _reference.moe_experts(x, ids, wts, w13, w2, contract=contract)
                got = experts_run.reference(x, ids, wts, w13, w2, contract=contract)
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=f"{fmt} {x_dtype} {contract}")


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


def test_memory_estimate_grows_with_what_is_held():
    s = bench.SHAPES["v2lite"]
    bf16_need, how = bench.memory_needed(s, "bf16", with_peer=False)
    assert bf16_need > 2 * s.weight_bytes(2) and "weights" in how
    assert bench.memory_needed(s, "bf16", with_peer=True)[0] > bf16_need  # kt's copies come on top
    # with rounds, kt-kernel loads again while hmoe's packed copy is held
    assert bench.memory_needed(s, "bf16", with_peer=True, rounds=2)[0] > bench.memory_needed(s, "bf16", True)[0]
    assert bench.memory_needed(s, "bf16", with_peer=False, rounds=2)[0] == bf16_need
    assert bench.memory_needed(s, "fp32", with_peer=False)[0] > bf16_need
    assert bench.memory_needed(s, "int4", with_peer=False)[0] >= 3 * s.weight_bytes(2)  # quantize's fp32 temporary


def test_memory_helpers_are_sane():
    assert membw.llc_bytes() > 0
    assert membw.mem_total_bytes() >= membw.mem_available_bytes() > 0
    assert membw.copy_buffer_bytes() >= 64 << 20
