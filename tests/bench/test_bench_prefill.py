# Tests for `python -m hmoe.bench prefill`: its CPU-side logic here (GPU work faked), one tiny end-to-end GPU run.
import json
import math
import os
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from hmoe import _reference  # noqa: E402
from hmoe.bench import prefill as bench  # noqa: E402
from tests.bench.gpu_fakes import fake_timing  # noqa: E402


def test_parse_args_defaults_and_cases():
    opts = bench.parse_args([], "prog")
    assert [(c.name, c.dqk, c.dv) for c in opts.cases] == [("4x4096", 192, 128), ("mix16k", 192, 128),
                                                            ("4x4096", 128, 128), ("mix16k", 128, 128)]
    assert all(sum(c.lens) == 16384 and c.H == c.Hkv == 128 and c.causal for c in opts.cases)
    assert (opts.dtype, opts.variant, opts.no_flashinfer, opts.eager, opts.config) == ("bf16", None, False, False, None)
    opts = bench.parse_args(["--shapes", "2x100+37, 5", "--dims", "64x64", "--heads", "8", "--kv-heads", "2",
                             "--no-causal", "--dtype", "fp16", "--config", "1", "--json", "x.json"], "prog")
    assert [c.lens for c in opts.cases] == [[100, 100, 37], [5]]
    assert all((c.dqk, c.dv, c.H, c.Hkv, c.causal) == (64, 64, 8, 2, False) for c in opts.cases)
    assert (opts.dtype, opts.config, opts.json) == ("fp16", 1, "x.json")


def test_parse_args_paged_and_chunked():
    opts = bench.parse_args(["--kv", "paged", "--page-size", "16", "--queries", "1024", "--dims", "192x128"], "prog")
    assert opts.op == "paged_prefill" and [(c.kv, c.page, c.queries) for c in opts.cases] == [("paged", 16, 1024)] * 2
    c = opts.cases[0]
    assert c.label == "4x4096 192x128 H128/128 paged16 q1024" and c.q_lens == [1024] * 4 and c.lens == [4096] * 4
    assert bench.parse_args(["--queries", "3000", "--shapes", "mix16k"], "prog").cases[0].q_lens == \
        [3000, 3000, 2600, 2000, 1500, 1000, 700, 400, 184]
    assert bench.parse_args([], "prog").op == "ragged_prefill"


@pytest.mark.parametrize("argv", [["--shapes", "4x"], ["--shapes", "0x10"], ["--shapes", "a"], ["--shapes", ","],
                                  ["--dims", "96x96"], ["--dims", "192"], ["--heads", "6", "--kv-heads", "4"],
                                  ["--dtype", "fp32"], ["--repeats", "0"], ["--kv", "blocked"],
                                  ["--kv", "paged", "--page-size", "0"], ["--queries", "0"],
                                  ["--json", "/nonexistent/dir/x.json"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv, "prog")
    assert e.value.code == 2 and "prog: error" in capsys.readouterr().err


def test_causal_flop_count():
    c = bench.Case("x", [4096] * 4, 192, 128, 128, 128, True)
    # 4 requests x 4096 * 4097 / 2 pairs x 128 heads x (192 + 128) x 2
    assert bench.flops(c) == 4 * 4096 * 4097 // 2 * 128 * 320 * 2
    assert bench.flops(c._replace(causal=False)) == 4 * 4096 * 4096 * 128 * 320 * 2
    # brute force on a small ragged batch: count the mask's pairs
    small = bench.Case("y", [3, 1, 5], 64, 64, 2, 1, True)
    pairs = sum(int(_reference._visible(L, L, True, "cpu").sum()) for L in small.lens)
    assert bench.flops(small) == 2 * pairs * 2 * 128
    assert bench.bytes_moved(small) == 2 * 9 * (2 * 64 + 1 * 128 + 2 * 64)


def test_flop_count_of_chunks():
    # the last lq tokens of each request as queries: count the mask's pairs
    c = bench.Case("y", [7, 3, 12], 64, 64, 2, 1, True, "paged", 4, 5)
    assert c.q_lens == [5, 3, 5]
    pairs = sum(int(_reference._visible(lq, lk, True, "cpu").sum()) for lq, lk in zip(c.q_lens, c.lens))
    assert bench.flops(c) == 2 * pairs * 2 * 128
    assert bench.flops(c._replace(causal=False)) == 2 * (5 * 7 + 3 * 3 + 5 * 12) * 2 * 128
    assert bench.bytes_moved(c) == 2 * (13 * 2 * 128 + 22 * 1 * 128)


def test_paged_inputs_hold_the_ragged_keys():
    c = bench.Case("y", [30, 1, 50, 16], 64, 64, 4, 2, True, "paged", 16, 20)
    inp = bench.make_inputs(c, torch.bfloat16, torch.device("cpu"), seed=1)
    assert inp.q.shape == (20 + 1 + 20 + 16, 4, 64) and inp.qo_indptr.tolist() == [0, 20, 21, 41, 57]
    assert inp.k_cache.shape == (2 + 1 + 4 + 1, 16, 2, 64) and inp.page_table.shape == (4, 4)
    assert sorted(inp.page_table[inp.page_table.new_tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1],
                                                            [1, 0, 0, 0]]).bool()].tolist()) == list(range(8))
    assert inp.page_table[:, 0].tolist() != [0, 2, 3, 7]  # shuffled, not in order (seed 1)
    k, v, indptr = _reference.paged_as_ragged(inp.k_cache, inp.v_cache, inp.page_table, inp.kv_lens)
    assert torch.equal(k, inp.k) and torch.equal(v, inp.v) and torch.equal(indptr, inp.kv_indptr)


def test_inputs_and_reference():
    c = bench.Case("y", [30, 1, 50], 64, 64, 4, 2, True)
    inp = bench.make_inputs(c, torch.bfloat16, torch.device("cpu"), seed=1)
    assert inp.q.shape == (81, 4, 64) and inp.k.shape == (81, 2, 64) and inp.v.shape == (81, 2, 64)
    assert inp.qo_indptr.tolist() == [0, 30, 31, 81] == inp.kv_indptr.tolist()
    assert bench.check_heads(4) == [0, 2, 3] and bench.check_heads(1) == [0]
    ref = bench.reference(inp, c, [0, 3])
    full, _ = _reference.prefill(inp.q, inp.k, inp.v, inp.qo_indptr, inp.kv_indptr, 64 ** -0.5)
    assert ref.dtype == torch.float64 and torch.equal(ref, full[:, [0, 3]])
    assert bench.rel_err(ref.float().fill_(float("nan")), ref) == math.inf


class FakeWrapper:
    """flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper's documented semantics on the CPU."""
    broken = set()  # backends that fail in plan (as a JIT failure would)
    wrong = set()  # backends that ignore the causal mask
    last = None

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None, kv_indptr_buf=None,
                 backend="auto"):
        assert kv_layout == "NHD" and backend in ("fa2", "fa3") and (not use_cuda_graph or qo_indptr_buf is not None)
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, causal=False,
             sm_scale=None, q_data_type=None, kv_data_type=None):
        if self.backend in self.broken:
            raise RuntimeError("Ninja build failed\n...500 lines of compiler output...")
        self.p = types.SimpleNamespace(qo=qo_indptr.clone(), kv=kv_indptr.clone(), scale=sm_scale,
                                       causal=causal and self.backend not in self.wrong)

    def run(self, q, k, v, out=None):
        FakeWrapper.last = self.backend
        got, _ = _reference.prefill(q, k, v, self.p.qo, self.p.kv, self.p.scale, self.p.causal)
        out.copy_(got.to(out.dtype))
        return out


class FakePagedWrapper(FakeWrapper):
    """flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper's documented semantics on the CPU: a
    CSR page list (kv_indptr in pages, kv_indices, last_page_len) over NHD pages."""

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, backend="auto"):
        assert not use_cuda_graph or None not in (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                                                  paged_kv_last_page_len_buf)
        super().__init__(workspace, kv_layout, use_cuda_graph, qo_indptr_buf, paged_kv_indptr_buf, backend)

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
             head_dim_vo=None, causal=False, sm_scale=None, q_data_type=None, kv_data_type=None):
        # the keys' indptr is set by run, from the pages
        super().plan(qo_indptr, qo_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, causal, sm_scale)
        self.pages = (kv_indptr.tolist(), kv_indices.tolist(), last_page_len.tolist(), page_size)

    def run(self, q, kv_cache, out=None):
        assert kv_cache[0].stride() == kv_cache[1].stride(), "K and V pages of one stride (flashinfer checks it)"
        indptr, indices, last, page = self.pages
        ks, vs, lens = [], [], []
        for b in range(len(last)):
            ids = indices[indptr[b]:indptr[b + 1]]
            L = (len(ids) - 1) * page + last[b] if ids else 0
            ks.append(kv_cache[0][ids].flatten(0, 1)[:L])
            vs.append(kv_cache[1][ids].flatten(0, 1)[:L])
            lens.append(L)
        self.p.kv = bench._indptr(lens, "cpu")
        return super().run(q, torch.cat(ks), torch.cat(vs), out=out)


def fake_run(monkeypatch, hmoe_out, fi_skip=None, variants=(None,), calls=None, case=None):
    """The rows of one case run with fakes: hmoe's output from hmoe_out(inp, c) (hmoe 10 us, or
    8 us for a variant named 'fast'), flashinfer's from the fake wrapper (fa2 15 us, fa3 12 us)."""

    def hmoe_runner(inp, c, variant):
        return (lambda: variant), hmoe_out(inp, c)

    fake_timing(monkeypatch, FakeWrapper, {"hmoe": 10.0, "fast": 8.0, "fa2": 15.0, "fa3": 12.0}, calls)
    monkeypatch.setattr(bench, "hmoe_runner", hmoe_runner)
    monkeypatch.setattr(bench, "hmoe_plan", lambda *a: "a plan")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    fi = types.SimpleNamespace(prefill=types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=FakeWrapper,
                                                             BatchPrefillWithPagedKVCacheWrapper=FakePagedWrapper))
    o = types.SimpleNamespace(dtype="bf16", device=torch.device("cpu"), seed=3, eager=False, variants=list(variants),
                              repeats=7, rounds=3, warmup=0, warmup_ms=0)
    c = case or bench.Case("t", [20, 0, 33], 64, 64, 3, 1, True)
    rows = bench.run_case(c, o, fi, fi_skip or {}, 800.0, None, lambda m: None)
    return rows if len(variants) > 1 else rows[0]


def right(inp, c):
    ref, _ = _reference.prefill(inp.q, inp.k, inp.v, inp.qo_indptr, inp.kv_indptr, c.dqk ** -0.5, c.causal)
    return ref.to(inp.q.dtype)


@pytest.fixture(autouse=True)
def _reset_fake():
    FakeWrapper.broken, FakeWrapper.wrong, FakeWrapper.last = set(), set(), None


def test_run_case_checks_against_reference_and_flashinfer(monkeypatch):
    row = fake_run(monkeypatch, right)
    assert not row["failed"], row["checks"]
    assert {ch["what"] for ch in row["checks"]} == {"hmoe vs ref", "fa2 vs ref", "fa3 vs ref", "hmoe vs fa2",
                                                    "hmoe vs fa3"}
    assert row["flashinfer"]["fa2"]["speedup"] == 1.5 and row["flashinfer"]["fa3"]["speedup"] == 1.2
    line = bench.format_row(row)
    assert line.startswith("t 64x64 H3/1") and "1.50x" in line and "1.20x" in line and " ok ref " in line


@pytest.mark.parametrize("kv,queries,dims", [("paged", None, (64, 64)), ("paged", 9, (64, 64)),
                                             ("paged", None, (192, 128)), ("ragged", 9, (64, 64))])
def test_chunks_and_paged_cases_check_against_reference_and_flashinfer(monkeypatch, kv, queries, dims):
    case = bench.Case("t", [20, 1, 33], *dims, 3, 1, True, kv, 8, queries)
    row = fake_run(monkeypatch, right, case=case)
    assert not row["failed"], row["checks"]
    assert {ch["what"] for ch in row["checks"]} == {"hmoe vs ref", "fa2 vs ref", "fa3 vs ref", "hmoe vs fa2",
                                                    "hmoe vs fa3"}
    label = f"t {dims[0]}x{dims[1]} H3/1" + (" paged8" if kv == "paged" else "") + (" q9" if queries else "")
    assert bench.format_row(row).startswith(label + " ")
    # the keys one page further on (an off-by-a-page walk) fail against the reference
    shifted = lambda inp, c: right(types.SimpleNamespace(**dict(vars(inp), k=inp.k.roll(8, 0))), c)  # noqa: E731
    assert fake_run(monkeypatch, shifted, case=case)["failed"]


def test_every_variant_is_a_row_beside_one_flashinfer_timing(monkeypatch):
    calls = []
    rows = fake_run(monkeypatch, right, variants=("slow", "fast"), calls=calls)
    # the variants and the backends take turns (_gpu_bench.turn_order): 3 rounds, 7 calls each as 3 + 2 + 2
    assert calls == [("hmoe", 3), ("fast", 3), ("fa2", 3), ("fa3", 3), ("fa3", 2), ("fa2", 2), ("fast", 2),
                     ("hmoe", 2), ("fast", 2), ("fa2", 2), ("fa3", 2), ("hmoe", 2)]
    assert [r["variant"] for r in rows] == ["slow", "fast"] and not any(r["failed"] for r in rows)
    assert [r["flashinfer"]["fa3"]["speedup"] for r in rows] == [1.2, 1.5]
    assert {ch["what"] for ch in rows[1]["checks"]} == {"hmoe vs ref", "fa2 vs ref", "fa3 vs ref", "hmoe vs fa2",
                                                        "hmoe vs fa3"}
    assert " fast " in bench.format_row(rows[1]) and "1.50x" in bench.format_row(rows[1])


def test_wrong_hmoe_output_fails(monkeypatch):
    row = fake_run(monkeypatch, lambda inp, c: torch.zeros(inp.q.shape[0], c.H, c.dv, dtype=inp.q.dtype))
    assert row["failed"] and bench.check_cell(row).startswith("FAIL hmoe vs ref 1.0e+00")


def test_non_causal_output_fails_a_causal_case(monkeypatch):
    def full(inp, c):
        ref, _ = _reference.prefill(inp.q, inp.k, inp.v, inp.qo_indptr, inp.kv_indptr, c.dqk ** -0.5, False)
        return ref.to(inp.q.dtype)
    assert fake_run(monkeypatch, full)["failed"]


def test_flashinfer_errors_skips_and_wrong_results(monkeypatch):
    FakeWrapper.broken, FakeWrapper.wrong = {"fa2"}, {"fa3"}
    row = fake_run(monkeypatch, right)
    assert not row["failed"]
    assert row["flashinfer"]["fa2"] == {"error": "RuntimeError: Ninja build failed"}
    assert "(flashinfer off: fa3 vs ref, hmoe vs fa3)" in bench.check_cell(row)
    row = fake_run(monkeypatch, right, fi_skip={"fa3": "needs sm_90, this GPU is sm_89"})
    assert row["flashinfer"]["fa3"] == {"skipped": "needs sm_90, this GPU is sm_89"}


def test_table_is_fixed_width():
    head = bench.format_header().splitlines()
    assert head[0].startswith("case") and set(head[1]) == {"-"} and len(head[1]) == len(head[0])
    row = {"case": "4x4096 192x128 H128/128", "hmoe": {"us": 7012.4, "tflops": 392.1, "floor_us": 3480.0,
                                                       "x_floor": 2.015, "timing": "graph", "timing_note": None},
           "flashinfer": {"fa2": {"us": 9000.0, "speedup": 1.283}, "fa3": {"error": "x"}},
           "checks": [{"what": "hmoe vs ref", "rel_err": 3e-3, "tol": 1.2e-2, "ok": True, "counts": True}]}
    line = bench.format_row(row).splitlines()[0]
    cols = [head[0].index(t) for t in ("us(med)", "TFLOP/s", "floor us", "x floor", "fa2 us", "x fa2", "fa3 us",
                                       "check")]
    assert [line[c:].split()[0] for c in cols] == ["7012", "392", "3480", "2.02", "9000", "1.28x", "error", "ok"]


def test_lists_and_refuses_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "hmoe.bench"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "prefill" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hmoe.bench", "prefill", "--help"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0 and all(o in r.stdout for o in ("--shapes", "--dims", "--heads", "--kv-heads",
                                                             "--no-causal", "--json", "--no-flashinfer", "--config"))
    r = subprocess.run([sys.executable, "-m", "hmoe.bench", "prefill", "--shapes", "64"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2 and r.stdout == "" and "no usable CUDA device" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [[], ["--eager", "--no-flashinfer"]])
def test_tiny_end_to_end(tmp_path, capsys, mode):
    path = tmp_path / "prefill.json"
    rc = bench.main(["--shapes", "300+77,2x128", "--dims", "192x128", "--heads", "4", "--kv-heads", "2",
                     "--repeats", "3", "--warmup", "1", "--json", str(path), *mode])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads(path.read_text())
    variants = sorted({r["variant"] for r in data["results"]})
    assert data["failures"] == 0 and data["matmul"]["tflops"] > 0 and len(data["results"]) == 2 * len(variants)
    assert "portable" in variants
    for r in data["results"]:
        assert r["hmoe"]["us"] > 0 and r["hmoe"]["timing"] == ("eager" if mode else "graph"), r["hmoe"]
        assert r["hmoe"]["x_floor"] > 1 and any(c["what"] == "hmoe vs ref" and c["ok"] for c in r["checks"])
        for backend, res in r["flashinfer"].items():
            assert "us" not in res or any(c["what"] == f"{backend} vs ref" and c["ok"] for c in r["checks"]), r
    assert "all hmoe outputs check out" in out and "hmoe.ops.ragged_prefill (ragged k/v; queries: every token) " \
        "variants: " in out and "portable (" in out


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
def test_tiny_paged_end_to_end(tmp_path, capsys, page):
    path = tmp_path / "prefill.json"
    rc = bench.main(["--kv", "paged", "--page-size", str(page), "--queries", "100", "--shapes", "300+77,2x128",
                     "--dims", "192x128", "--heads", "4", "--kv-heads", "2", "--repeats", "3", "--warmup", "1",
                     "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads(path.read_text())
    assert data["failures"] == 0 and data["meta"]["op"] == "paged_prefill" and data["meta"]["page_size"] == page
    assert [r["variant"] for r in data["results"]] == ["portable", "portable"]
    for r in data["results"]:
        assert r["hmoe"]["us"] > 0 and any(c["what"] == "hmoe vs ref" and c["ok"] for c in r["checks"])
        for backend, res in r["flashinfer"].items():
            assert "us" not in res or any(c["what"] == f"{backend} vs ref" and c["ok"] for c in r["checks"]), r
    assert f"paged cache, page size {page}, shuffled pages; queries: each request's last 100 tokens" in out
