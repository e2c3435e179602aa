# Tests for `python -m hmoe.bench mla`: its CPU-side logic here (GPU work faked), one tiny end-to-end GPU run.
import json
import math
import os
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from hmoe.bench import mla as bench  # noqa: E402
from tests.bench.gpu_fakes import fake_timing  # noqa: E402
from tests.ops.mla_reference import make_cache, mla_reference  # noqa: E402


def test_parse_args_defaults_and_shapes():
    opts = bench.parse_args([], "prog")
    assert [s.name for s in opts.shape_list] == bench.DEFAULT_SHAPES.split(",")
    assert (64, 4096, 16) in opts.shape_list and (1, 32768, 128) in opts.shape_list
    assert (opts.dtype, opts.page_size, opts.variant, opts.no_flashinfer, opts.eager) == ("bf16", 64, None, False, False)
    opts = bench.parse_args(["--shapes", "2x100x5, 1X64x1,", "--dtype", "fp16", "--page-size", "16",
                             "--variant", "sm_80", "--no-flashinfer", "--json", "x.json", "--plot", "r.png"], "prog")
    assert opts.shape_list == [bench.Shape(2, 100, 5), bench.Shape(1, 64, 1)]
    assert (opts.dtype, opts.page_size, opts.variant, opts.no_flashinfer, opts.json, opts.plot) == \
        ("fp16", 16, "sm_80", True, "x.json", "r.png")


@pytest.mark.parametrize("argv", [["--shapes", "64x4096"], ["--shapes", "0x10x2"], ["--shapes", "axbxc"],
                                  ["--shapes", ","], ["--dtype", "fp32"], ["--page-size", "0"], ["--repeats", "0"],
                                  ["--copy-mib", "-5"], ["--json", "/nonexistent/dir/x.json"], ["--plot", "/nonexistent/p.png"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv, "prog")
    assert e.value.code == 2 and "prog: error" in capsys.readouterr().err


def test_flop_and_byte_accounting():
    s = bench.Shape(64, 4096, 16)
    kv = 64 * 4096 * 576 * 2
    assert bench.bytes_moved(s) == kv + 64 * 16 * 576 * 2 + 64 * 16 * 512 * 2
    assert bench.bytes_moved(s, elt=4) == 2 * bench.bytes_moved(s)
    assert bench.flops(s) == 64 * 16 * 4096 * (576 + 512) * 2
    # about 1.9*H FLOP per byte (2*H*1088 per 1152 B of KV; q and out add a few %): H = 16 is bandwidth-bound
    ai16 = bench.flops(s) / bench.bytes_moved(s)
    ai128 = bench.flops(bench.Shape(64, 4096, 128)) / bench.bytes_moved(bench.Shape(64, 4096, 128))
    assert 29 < ai16 < 31 and 225 < ai128 < 235
    assert bench.bytes_moved(bench.Shape(128, 8192, 16)) > 1.2e9  # the largest cache, as the brief says


def test_floor_is_the_slower_of_bytes_and_flops():
    # 16 heads: bandwidth-bound; 128 heads: compute-bound at these rates (ridge at 806e3 / 4277 = 188 FLOP/B)
    s16, s128 = bench.Shape(64, 4096, 16), bench.Shape(64, 4096, 128)
    us, by = bench.floor_us(s16, 4277.0, 806.0)
    assert by == "bytes" and us == pytest.approx(bench.bytes_moved(s16) / 4277e3)
    us, by = bench.floor_us(s128, 4277.0, 806.0)
    assert by == "FLOPs" and us == pytest.approx(bench.flops(s128) / 806e6)
    assert 90 < us < 91  # 64 x 4096 x 128 x (576 + 512) x 2 FLOP at 806 TFLOP/s: 90.6 us
    res = bench.derive({"us": 2 * us, "timing": "graph"}, s128, 4277.0, 806.0)
    assert (res["floor_by"], res["x_floor"]) == ("FLOPs", pytest.approx(2.0))
    assert res["floor_us"] == pytest.approx(us) and res["tflops"] == pytest.approx(403.0)
    assert res["copy_frac"] == pytest.approx(bench.bytes_moved(s128) / (2 * us * 1e3) / 4277.0)


def test_inputs_are_shuffled_pages_and_reference_matches_tests_reference():
    s = bench.Shape(3, 150, 5)
    inp = bench.make_inputs(s, 32, torch.bfloat16, torch.device("cpu"), seed=1)
    per_req = math.ceil(150 / 32)
    assert inp.ckv.shape == (3 * per_req, 32, 512) and inp.kpe.shape == (3 * per_req, 32, 64)
    assert inp.q_nope.shape == (3, 5, 512) and inp.q_pe.shape == (3, 5, 64) and inp.q_nope.dtype == torch.bfloat16
    assert inp.page_table.dtype == torch.int32 and inp.page_table.shape == (3, per_req)
    assert sorted(inp.page_table.flatten().tolist()) == list(range(3 * per_req))  # every page once
    assert inp.page_table.flatten().tolist() != list(range(3 * per_req))  # ... not in order
    assert inp.seq_lens.tolist() == [150] * 3
    got = bench.reference(inp, 3, bench.SM_SCALE)
    want, _ = mla_reference(inp.q_nope, inp.q_pe, inp.ckv, inp.kpe, inp.page_table, inp.seq_lens, bench.SM_SCALE)
    assert got.dtype == torch.float64 and bench.rel_err(want, got) < 1e-6


def test_reference_with_the_tests_cache_builder():
    # variable lengths, 0 included, garbage past the used pages: the bench's reference reads only what it must
    q_nope, q_pe, ckv, kpe, pt, lens = make_cache(4, 3, [0, 1, 70, 130], 64, torch.float16, "cpu", torch.Generator().manual_seed(2))
    inp = types.SimpleNamespace(q_nope=q_nope, q_pe=q_pe, ckv=ckv, kpe=kpe, page_table=pt, seq_lens=lens)
    got = bench.reference(inp, 4, 0.1)
    want, _ = mla_reference(q_nope, q_pe, ckv, kpe, pt, lens, 0.1)
    assert torch.isfinite(got).all() and float((got - want.double()).abs().max()) < 1e-5
    assert bench.rel_err(got.float().clone().fill_(float("nan")), got) == math.inf


class FakeWrapper:
    """flashinfer.mla.BatchMLAPagedAttentionWrapper's documented semantics on the CPU: CSR page table
    (kv_indices page ids, kv_indptr offsets in pages, kv_len_arr tokens), ckv [pages, page_size, 512]."""
    broken = set()  # backends that fail in plan (as a JIT failure would)
    wrong = set()  # backends that ignore the page table (read pages in order)
    last = None  # the backend that ran last, for the fake measure()

    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        assert backend in ("fa2", "fa3") and (not use_cuda_graph or kv_indices is not None)
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        if self.backend in self.broken:
            raise RuntimeError("Ninja build failed\n...500 lines of compiler output...")
        assert (head_dim_ckv, head_dim_kpe, causal) == (512, 64, False) and qo_indptr.tolist() == list(range(len(qo_indptr)))
        self.p = types.SimpleNamespace(indptr=kv_indptr.tolist(), indices=kv_indices.clone(), lens=kv_len_arr.tolist(),
                                       page=page_size, scale=sm_scale, heads=num_heads)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        p, FakeWrapper.last = self.p, self.backend
        assert ckv_cache.shape[1] == p.page and q_nope.shape[1] == p.heads
        for b, L in enumerate(p.lens):
            pages = p.indices[p.indptr[b]: p.indptr[b + 1]].long()
            if self.backend in self.wrong:
                pages = torch.arange(p.indptr[b], p.indptr[b + 1])
            kv, pe = ckv_cache[pages].reshape(-1, 512)[:L].float(), kpe_cache[pages].reshape(-1, 64)[:L].float()
            s = (q_nope[b].float() @ kv.T + q_pe[b].float() @ pe.T) * p.scale
            out[b] = (s.softmax(-1) @ kv).to(out.dtype)
        return out


def fake_run(monkeypatch, hmoe_out, fi_skip=None, **opts):
    """run_shape on the CPU with the GPU parts faked: hmoe 10 us, fa2 15 us, fa3 12 us a call."""

    def hmoe_runner(inp, opts):
        out = hmoe_out(inp)
        return (lambda: None), out

    fake_timing(monkeypatch, FakeWrapper, {"hmoe": 10.0, "fa2": 15.0, "fa3": 12.0})
    monkeypatch.setattr(bench, "hmoe_runner", hmoe_runner)
    monkeypatch.setattr(bench, "hmoe_route", lambda inp, opts: ("portable", "1 KV split(s), ..."))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    fi = types.SimpleNamespace(mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeWrapper))
    o = types.SimpleNamespace(dtype="bf16", page_size=16, device=torch.device("cpu"), seed=3, eager=False, variant=None,
                              repeats=5, rounds=3, warmup=1, warmup_ms=0)
    vars(o).update(opts)
    return bench.run_shape(bench.Shape(3, 70, 4), o, fi, fi_skip or {}, 1000.0, 500.0, None, lambda m: None)


def right(inp):
    return bench.reference(inp, inp.q_nope.shape[0], bench.SM_SCALE).to(inp.q_nope.dtype)


@pytest.fixture(autouse=True)
def _reset_fake():
    FakeWrapper.broken, FakeWrapper.wrong, FakeWrapper.last = set(), set(), None


def test_run_shape_checks_against_reference_and_flashinfer(monkeypatch):
    row = fake_run(monkeypatch, right)
    assert not row["failed"], row["checks"]
    whats = {c["what"]: c for c in row["checks"]}
    assert set(whats) == {"hmoe vs ref", "fa2 vs ref", "fa3 vs ref", "hmoe vs fa2", "hmoe vs fa3"}
    assert all(c["ok"] for c in row["checks"]) and whats["hmoe vs ref"]["rel_err"] < 1e-2
    assert row["flashinfer"]["fa2"]["speedup"] == 1.5 and row["flashinfer"]["fa3"]["speedup"] == 1.2
    line = bench.format_row(row)
    assert line.split()[:2] == ["3x70x4", "portable"] and "1.50x" in line and "1.20x" in line and " ok ref " in line
    assert (row["hmoe"]["variant"], row["hmoe"]["plan"]) == ("portable", "1 KV split(s), ...")
    assert row["intensity"] == bench.flops(bench.Shape(3, 70, 4)) / bench.bytes_moved(bench.Shape(3, 70, 4))


def test_wrong_hmoe_output_fails(monkeypatch):
    row = fake_run(monkeypatch, lambda inp: torch.zeros_like(inp.q_nope))
    assert row["failed"]
    cell = bench.check_cell(row)
    assert cell.startswith("FAIL hmoe vs ref 1.0e+00 > 1e-02") and "hmoe vs fa2" in cell


def test_wrong_flashinfer_does_not_fail_hmoe(monkeypatch):
    FakeWrapper.wrong = {"fa2"}
    row = fake_run(monkeypatch, right)
    assert not row["failed"]
    assert "(flashinfer off: fa2 vs ref, hmoe vs fa2)" in bench.check_cell(row)


def test_flashinfer_errors_and_skips_are_cells_and_lines(monkeypatch):
    FakeWrapper.broken = {"fa2"}
    row = fake_run(monkeypatch, right, fi_skip={"fa3": "needs sm_90, this GPU is sm_89"})
    assert not row["failed"]
    assert row["flashinfer"]["fa2"] == {"error": "RuntimeError: Ninja build failed"}
    assert row["flashinfer"]["fa3"] == {"skipped": "needs sm_90, this GPU is sm_89"}
    first, second = bench.format_row(row).splitlines()
    assert "error" in first and "n/a" in first and second == "    fa2: RuntimeError: Ninja build failed"


def test_hmoe_error_fails_but_flashinfer_still_runs(monkeypatch):
    def boom(inp):
        raise ValueError("q_nope has 4 heads; bad\nsecond line")

    row = fake_run(monkeypatch, boom)
    assert row["failed"] and row["hmoe"] == {"error": "ValueError: q_nope has 4 heads; bad"}
    assert "us" in row["flashinfer"]["fa2"] and "speedup" not in row["flashinfer"]["fa2"]
    assert bench.check_cell(row) == "FAIL hmoe: ValueError: q_nope has 4 heads; bad"


def test_table_formatting_is_fixed_width():
    head = bench.format_header().splitlines()
    assert head[0].startswith("shape BxSxH") and set(head[1]) == {"-"} and len(head[1]) == len(head[0])
    row = {"shape": "64x4096x16", "hmoe": {"us": 123.456, "gbps": 2475.3, "tflops": 68.2, "copy_frac": 0.853,
                                           "floor_us": 71.13, "floor_by": "bytes", "x_floor": 1.7357,
                                           "timing": "graph", "timing_note": None, "variant": "sm90a"},
           "flashinfer": {"fa2": {"us": 200.0, "speedup": 1.62}, "fa3": {"error": "x"}},
           "checks": [{"what": "hmoe vs ref", "rel_err": 3e-3, "tol": 1.2e-2, "ok": True, "counts": True}]}
    line = bench.format_row(row).splitlines()[0]
    cols = [head[0].index(t) for t in ("variant", "us(med)", "GB/s", "%copy", "floor us", "x floor", "fa2 us", "x fa2",
                                        "fa3 us", "check")]
    assert [line[c:].split()[0] for c in cols] == ["sm90a", "123.5", "2475", "85.3%", "71.1", "1.74", "200.0", "1.62x",
                                                   "error", "ok"]
    assert "71.1 (bytes)" in line
    assert bench.format_row(dict(row, hmoe={"error": "E"}, flashinfer={})).split()[1:7] == ["-"] * 6


def test_roofline_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"shape": "64x4096x16", "intensity": 30.0, "hmoe": {"tflops": 100.0},
             "flashinfer": {"fa2": {"tflops": 70.0}, "fa3": {"error": "x"}}},
            {"shape": "64x4096x128", "intensity": 240.0, "hmoe": {"error": "x"}, "flashinfer": {}}]
    path = tmp_path / "roof.png"
    bench.plot_roofline(rows, 4300.0, 700.0, str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lists_and_refuses_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU even on a GPU machine
    r = subprocess.run([sys.executable, "-m", "hmoe.bench"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "mla" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hmoe.bench", "mla", "--help"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and all(o in r.stdout for o in ("--shapes", "--dtype", "--page-size", "--repeats",
                                                              "--json", "--plot", "--no-flashinfer", "--variant"))
    r = subprocess.run([sys.executable, "-m", "hmoe.bench", "mla", "--shapes", "1x64x1"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert "no usable CUDA device" in r.stderr and "NVIDIA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [[], ["--eager", "--no-flashinfer"]])
def test_tiny_end_to_end(tmp_path, capsys, mode):
    path = tmp_path / "mla.json"
    rc = bench.main(["--shapes", "3x200x5,1x64x16", "--repeats", "3", "--warmup", "1", "--copy-mib", "256",
                     "--json", str(path), *mode])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads(path.read_text())
    assert data["failures"] == 0 and data["copy_bandwidth"]["gbps"] > 0 and data["matmul"]["tflops"] > 0
    assert [r["shape"] for r in data["results"]] == ["3x200x5", "1x64x16"]
    for r in data["results"]:
        assert r["hmoe"]["us"] > 0 and r["hmoe"]["timing"] == ("eager" if mode else "graph"), r["hmoe"]
        assert r["hmoe"]["floor_by"] in ("bytes", "FLOPs") and r["hmoe"]["x_floor"] > 0, r["hmoe"]
        assert len(r["hmoe"]["us_all"]) == 3 and any(c["what"] == "hmoe vs ref" and c["ok"] for c in r["checks"])
        for backend, res in r["flashinfer"].items():  # where flashinfer ran, the bench fed it the same cache
            assert "us" not in res or any(c["what"] == f"{backend} vs ref" and c["ok"] for c in r["checks"]), r
    assert "3x200x5" in out and "all hmoe outputs check out" in out
    from hmoe.ops import _cuda, mla

    idx = torch.cuda.current_device()
    chosen = _cuda.select("mla_decode", idx).variant  # the device's (sm90a on 9.0), said in the header
    assert data["meta"]["hmoe_variant"].startswith(f"{chosen} (") and f"hmoe variant: {chosen} (" in out
    for r in data["results"]:  # and the variant that ran each shape: the route's (portable for few heads)
        assert r["hmoe"]["variant"] == mla.route(idx, r["B"], r["H"], -(-r["S"] // 64), 64).variant and \
            r["hmoe"]["plan"], r["hmoe"]
