# Tests for hmoe.bench.kt_peer (kt-kernel driven through its extension) and the bench's kt-kernel rows, on tiny shapes.
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")

from hmoe import quant  # noqa: E402
from hmoe.bench import experts as bench  # noqa: E402
from hmoe.bench import experts_run, kt_peer  # noqa: E402

try:
    KT = kt_peer.load()
except kt_peer.KtUnavailable as e:  # kt-kernel is an optional peer: without it these tests have nothing to drive
    pytest.skip(f"kt-kernel is not available: {e}", allow_module_level=True)

E, K, H, I = 8, 2, 256, 128  # kt's AVX2 / AMX kernels take multiples of 128 here
THREADS = 2


def problem(T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K].to(torch.int32)
    w = torch.rand(T, K, generator=g) + 0.1
    return w13, w2, x, ids, w / w.sum(1, keepdim=True)


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def offered(fmt):
    try:
        return kt_peer.pick_class(KT, fmt)
    except kt_peer.KtUnsupported:
        return None


def test_load_says_what_it_loaded():
    assert kt_peer.load() is KT  # once per process
    assert KT.variant in ("amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base", "avx2")
    assert KT.version in KT.describe() and KT.variant in KT.describe()
    assert offered("bf16") is not None  # every variant has a bf16 MoE
    for fmt in ("fp16", "fp32"):  # kt has no fp16/fp32 weights on any variant
        with pytest.raises(kt_peer.KtUnsupported, match=f"kt-kernel has no {fmt} on {KT.variant}"):
            kt_peer.pick_class(KT, fmt)


def test_bf16_against_fp64():
    w13, w2, x, ids, w = problem()
    with kt_peer.KtExperts(KT, "bf16", w13, w2, top_k=K, threads=THREADS, max_tokens=16) as kt:
        assert kt.bytes_per_expert == 3 * H * I * 2 and kt.weights_note == "the bf16 weights"
        out = kt(*kt.prepare(x, ids, w))
    assert out.dtype == torch.bfloat16 and out.shape == (5, H)
    ref = experts_run.reference(x, ids, w, w13, w2)
    assert rel(out, ref) < 1e-2  # bf16 output rounding (~4e-3 measured)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantised_formats_hand_over_the_right_layout(fmt):
    w13, w2, x, ids, w = problem()
    if offered(fmt) is None:  # this variant has none: the bench prints "n/a" with this message
        with pytest.raises(kt_peer.KtUnsupported, match=f"kt-kernel has no {fmt} on {KT.variant}"):
            kt_peer.KtExperts(KT, fmt, w13, w2, top_k=K, threads=THREADS, max_tokens=16)
        return
    with kt_peer.KtExperts(KT, fmt, w13, w2, top_k=K, threads=THREADS, max_tokens=16, int4_group=32) as kt:
        out = kt(*kt.prepare(x, ids, w))
        handover, per_expert = kt.handover, kt.bytes_per_expert
    assert torch.isfinite(out.float()).all()
    assert per_expert < 3 * H * I * 2 * 0.6  # quantised: about half the bf16 bytes or less
    if handover == "online":  # kt quantised the weights itself: only the original weights say how well
        assert rel(out, experts_run.reference(x, ids, w, w13, w2)) < 0.35
        return
    # hmoe.quant's weights handed over: kt must compute with exactly them (a wrong nibble order, sign
    # convention or scale layout is far off), to bf16 activations and output
    kw = {"group_size": 32} if fmt == "int4" else {}
    deq = [quant.dequantize(quant.quantize(m, fmt, **kw)) for m in (w13[:, :I], w13[:, I:], w2)]
    ref = experts_run.reference(x, ids, w, torch.cat(deq[:2], 1), deq[2])
    assert rel(out, ref) < 2e-2


def test_inputs_are_checked_before_kt_reads_them():
    w13, w2, x, ids, w = problem(T=20)
    with kt_peer.KtExperts(KT, "bf16", w13, w2, top_k=K, threads=THREADS, max_tokens=16) as kt:
        with pytest.raises(ValueError, match="KtExperts.prepare"):
            kt(x, ids, w)  # int32 ids
        with pytest.raises(ValueError, match=r"20 tokens, built for 1..16"):
            kt(*kt.prepare(x, ids, w))
    with pytest.raises(RuntimeError, match="closed"):
        kt(*kt.prepare(x[:2], ids[:2], w[:2]))


def test_close_joins_kt_threads_and_keeps_stdout_clean(capfd):
    def threads():
        return len(os.listdir("/proc/self/task"))

    w13, w2, x, ids, w = problem()
    before = threads()
    kt = kt_peer.KtExperts(KT, "bf16", w13, w2, top_k=K, threads=THREADS, max_tokens=16)
    kt(*kt.prepare(x, ids, w))
    assert threads() >= before + THREADS
    kt.close()
    assert threads() == before
    out, err = capfd.readouterr()
    assert "CPUInfer" not in out and "CPUInfer" in err  # kt's C++ progress lines went to stderr


def test_loads_the_extension_when_the_package_does_not_import(monkeypatch):
    monkeypatch.setattr(kt_peer, "_loaded", None)
    monkeypatch.setitem(sys.modules, "kt_kernel", None)  # `import kt_kernel` raises ImportError
    kt = kt_peer.load()
    assert kt.variant == KT.variant and "import kt_kernel failed: ModuleNotFoundError" in kt.how
    assert kt.ext.moe.MOEConfig is KT.ext.moe.MOEConfig
    # and without the extension module cached: kt's own detection, run from its file
    monkeypatch.setattr(kt_peer, "_loaded", None)
    monkeypatch.delitem(sys.modules, "kt_kernel_ext", raising=False)
    kt = kt_peer.load()
    assert kt.variant == KT.variant and "extension loaded from" in kt.how


def test_unavailable_says_every_reason(monkeypatch):
    monkeypatch.setattr(kt_peer, "_loaded", None)
    monkeypatch.setitem(sys.modules, "kt_kernel", None)
    monkeypatch.delitem(sys.modules, "kt_kernel_ext", raising=False)
    monkeypatch.setattr(sys, "path", [])
    with pytest.raises(kt_peer.KtUnavailable, match="import kt_kernel failed: ModuleNotFoundError.*no kt_kernel folder"):
        kt_peer.load()


def test_bench_rows_of_the_peer(tmp_path, capsys):
    path = tmp_path / "out.json"
    rc = bench.main(["--shape-custom", f"{H},{I},{E},{K}", "--quick", "--copy-mib", "16", "--no-flush",
                     "--idle-ms", "1", "--peer", "kt-kernel", "--peer-threads", str(THREADS), "--tokens", "1,3",
                     "--formats", "bf16,fp16,int8,int4,fp8", "--int4-group", "32", "--json", str(path)])
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert KT.describe() in out
    peer = data["meta"]["peer"]
    assert peer["variant"] == KT.variant and data["meta"]["threads_kt"] == THREADS
    kt_rows = [r for r in data["results"] if r["impl"].startswith("kt")]
    assert {(r["format"], r["T"]) for r in kt_rows} == {(f, T) for f in ("bf16", "fp16", "int8", "int4", "fp8")
                                                         for T in (1, 3)}
    for r in kt_rows:
        cls = offered(r["format"])
        if cls is None:
            assert r["unsupported"] == f"kt-kernel has no {r['format']} on {KT.variant}" and "ms" not in r
            assert f"n/a: kt-kernel has no {r['format']} on {KT.variant}" in out
            continue
        assert "error" not in r, r
        assert r["impl"] == f"kt {cls[0]}" == f"kt {peer['classes'][r['format']]}" and r["x_dtype"] == "bf16"
        assert r["threads"] == THREADS and r["repeats"] >= 1
        for key in ("ms", "b2b_ms", "gbps", "b2b_gbps", "read_frac", "bytes_hit_mean"):
            assert r[key] > 0, (key, r)
        assert 0 < r["err_fp64"] < (1e-2 if r["format"] == "bf16" else 0.35)
        assert r["vs_kt"] == 1.0
    # "n/a" rows are not failures; only hmoe's own errors and failed checks are
    failed = [r for r in data["results"] if not r["impl"].startswith("kt")
              and (r.get("error") or (r.get("check") or {}).get("ok") is False)]
    assert data["failures"] == len(failed) and rc == (1 if failed else 0)
    hmoe_bf16 = [r for r in data["results"] if r["format"] == "bf16" and r["impl"] == "CPUExperts"]
    assert all(r["vs_kt"] > 0 for r in hmoe_bf16)  # hmoe's rows relate to kt's of the same format and T
