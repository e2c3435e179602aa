"""mla_decode on the GPU against an fp32 reference from the gathered pages, each test once per variant
(family) forced with variant=: portable, and sm90a on compute capability 9.0. A shape the sm90a family
declines (mla.route) is checked there as the user meets it: the forced call is a ValueError, the
unforced one runs on portable and gives the right result."""

import pytest
import torch

import hmoe
from hmoe import _reference
from hmoe.ops import _cuda, mla as mla_mod

from .mla_reference import TOL, make_cache, mla_reference, rel_err
from .ptx_jit import run_forced_ptx
from .storage import in_storage

DTYPES = [torch.bfloat16, torch.float16]
SCALE = 1.0 / (192 ** 0.5)
VARIANT_OP = "mla_decode"  # the op of the variant fixture (conftest.py)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def serves(variant, index, B, H, max_pages, page):
    """Whether `variant`'s family serves mla_decode calls of this shape on cuda:<index> (mla.route)."""
    return not mla_mod.declines(_cuda.select("mla_decode", index, variant), _cuda.sm_count(index), B, H, max_pages,
                                page)


def variant_for(variant, args):
    """variant= for mla_decode calls on args (q_nope, q_pe, ckv, kpe, page_table, seq_lens): `variant`
    where its family serves the shape; else None (hmoe's choice), after checking that forcing it
    (mla_decode and plan) is a ValueError that names the portable variant and that hmoe's choice is
    the portable family."""
    q_nope, ckv, pt = args[0], args[2], args[4]
    index, B, H, max_pages, page = q_nope.get_device(), q_nope.shape[0], q_nope.shape[1], pt.shape[1], ckv.shape[1]
    if serves(variant, index, B, H, max_pages, page):
        return variant
    shape = mla_mod.shape_text(B, H, max_pages, page)
    refused = rf"'{variant}' does not serve {shape} .*the 'portable' variant serves"
    with pytest.raises(ValueError, match=refused):
        hmoe.ops.mla_decode(*args[:6], sm_scale=SCALE, variant=variant)
    with pytest.raises(ValueError, match=refused):
        mla_mod.plan(index, B, H, max_pages, page, variant=variant)
    routed = mla_mod.route(index, B, H, max_pages, page)
    assert routed.variant == "portable" and routed.reason.startswith(f"fallback: {variant} declines {shape}: ")
    return None


def run_and_check(B, H, lens, page, dtype, seed, variant, table_pages=1, **kw):
    args = make_cache(B, H, lens, page, dtype, "cuda", gen(seed), table_pages=table_pages)
    out = torch.full((B, H, 512), float("nan"), dtype=dtype, device="cuda")  # poisoned
    got, lse = hmoe.ops.mla_decode(*args, sm_scale=SCALE, return_lse=True, out=out,
                                   variant=variant_for(variant, args), **kw)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype and lse.dtype == torch.float32
    ref_o, ref_lse = mla_reference(*args, SCALE)
    zero = torch.tensor(lens) == 0
    assert (got[zero].float() == 0).all() and torch.isneginf(lse[zero].cpu()).all()
    if (~zero).any():
        assert rel_err(got[~zero], ref_o[~zero]) < TOL[dtype]
        assert (lse[~zero].cpu() - ref_lse[~zero]).abs().max() < _reference.MLA_LSE_ATOL
    return got, lse


@pytest.mark.gpu
def test_which_shapes_each_variant_serves(variant):
    idx = torch.cuda.current_device()
    # 4 x 4096 tokens (16384, the least cache sm90a takes at 16 heads or fewer): its CTAs walk at most
    # 16 tiles (its plan splits each request at least 8 ways where the device has 32 SMs or more);
    # 256 x 1024: more CTAs than an H100 or H200 has SMs
    shapes = [(B, H, -(-S // page), page) for B, S in ((4, 4096), (256, 1024)) for H in (1, 16, 17, 32, 33, 64, 128)
              for page in (1, 8, 16, 24, 32, 64, 128)]
    declined = {shape for shape in shapes if not serves(variant, idx, *shape)}
    if variant == "portable":  # every shape
        assert declined == set()
    else:  # page sizes that are not a multiple of 16, and 16 heads or fewer on two waves
        assert declined == {(B, H, P, page) for B, H, P, page in shapes if page % 16 or (H <= 16 and B == 256)}
        assert mla_mod.route(idx, 1, 128, 1, 64).variant == mla_mod.route(idx, 256, 17, 64, 16).variant == "sm90a"
        assert mla_mod.route(idx, 4, 16, 64, 64).variant == "sm90a"
        routed = mla_mod.route(idx, 256, 16, 16, 64)
        assert routed.variant == "portable" and "16 heads or fewer on more requests than" in routed.reason
        routed = mla_mod.route(idx, 4, 16, 2048, 64)
        assert routed.variant == "portable" and "16 heads or fewer, with more than 32 KV tiles" in routed.reason
        routed = mla_mod.route(idx, 3, 16, 11, 64)
        assert routed.variant == "portable" and "on a cache of fewer than 16384 tokens" in routed.reason
        assert mla_mod.route(idx, 1, 16, 2048, 64).variant == "sm90a"  # split 64 ways: as many CTAs as portable


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [1, 3, 16, 17, 33, 64, 128])
def test_heads_and_lengths(dtype, H, variant):
    lens = [0, 1, 63, 64, 65, 700, 2, 129]
    run_and_check(len(lens), H, lens, 64, dtype, seed=H, variant=variant)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_capture_after_one_eager_call_of_another_shape(monkeypatch):
    # The route depends on the shape: on compute capability 9.0 this small 16-head call runs on the
    # portable family and the large one on sm90a. One eager call warms both families' modules, so the
    # capture of the other shape needs no lazy setup (hmoe.ops.mla.warm_families).
    for mod, attr, empty in ((_cuda, "_warm", set()), (mla_mod, "_calls", {})):
        monkeypatch.setattr(mod, attr, empty)
    small = make_cache(2, 16, [5, 70], 64, torch.bfloat16, "cuda", gen(21))
    hmoe.ops.mla_decode(*small, sm_scale=SCALE)
    q_nope, q_pe, ckv, kpe, pt, lens = make_cache(4, 16, [4500, 1, 0, 3001], 64, torch.bfloat16, "cuda", gen(22))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = hmoe.ops.mla_decode(q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE)
    g.replay()
    torch.cuda.synchronize()
    ref_o, _ = mla_reference(q_nope, q_pe, ckv, kpe, pt, lens, SCALE)
    nz = lens.cpu() > 0
    assert rel_err(out[nz], ref_o[nz]) < TOL[torch.bfloat16] and (out[~nz] == 0).all()


@pytest.mark.gpu
def test_plans_past_the_plan_cache(variant):
    # The module keeps 4096 plans (cpp/bind/plan_cache.h) and starts over when full: the plans of
    # 5000 shapes later, the first shapes' plans are the same
    idx = torch.cuda.current_device()
    first = [mla_mod.plan(idx, B, 128, 64, 64, variant=variant) for B in (1, 7, 64)]
    for max_pages in range(100, 5100):
        mla_mod.plan(idx, 3, 128, max_pages, 16, variant=variant)
    assert [mla_mod.plan(idx, B, 128, 64, 64, variant=variant) for B in (1, 7, 64)] == first


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [1, 8, 16])
def test_few_heads_on_a_large_cache(dtype, H, variant):
    # 4 requests with room for 16000 tokens each: sm90a serves it (32 splits of 16 tiles on an H100 or
    # H200); lengths 0, 1, a page boundary plus 3 and the whole table
    run_and_check(4, H, [16000, 1, 0, 4099], 64, dtype, seed=13, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16])
def test_few_heads_where_the_portable_kernel_is_faster(H, variant):
    # The shapes sm90a leaves to the portable family (mla_decode_declines; variant_for checks the forced
    # call's error and the route): 4 requests with room for 131072 tokens each (the table's width, as
    # the plan sizes it: 4096 KV tiles a request, over 32 a CTA in a split of fewer than 64 ways), more
    # requests than an H100 or H200 has SMs (two waves of its CTAs), and a small call.
    run_and_check(4, H, [3000, 0, 1, 70], 64, torch.bfloat16, seed=11, variant=variant, table_pages=2048)
    run_and_check(200, H, [(37 * b) % 300 for b in range(200)], 64, torch.float16, seed=12, variant=variant)
    run_and_check(3, H, [5, 64, 700], 64, torch.bfloat16, seed=14, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("H", [16, 64])
def test_page_sizes(page, H, variant):
    run_and_check(5, H, [1, 100, 257, 0, 511], page, torch.bfloat16, seed=page, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [16, 128])
def test_long_context_splits(dtype, H, variant):
    # small batch, long sequence: the KV is split across CTAs and merged by the combine kernel
    idx = torch.cuda.current_device()
    run_and_check(2, H, [9000, 33], 64, dtype, seed=7, variant=variant)
    v = variant if serves(variant, idx, 2, H, 141, 64) else None  # run_and_check has checked the forced call
    assert mla_mod.plan(idx, 2, H, 141, 64, variant=v)[0] > 1


def pair_batch(idx, H):
    """A batch whose sm90a plan splits the KV in two (as many CTAs as fill a third to a half of the
    SMs: mla_splits.h), which that family merges in the kernel, the two splits a cluster."""
    return torch.cuda.get_device_properties(idx).multi_processor_count // (2 * -(-H // 64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, page", [(100, 64), (128, 64), (40, 16)])
def test_two_splits_merged_in_a_cluster(dtype, H, page, variant):
    # Lengths that leave the second split empty (1, 32, 64), end on its first token or inside it,
    # and 0; 100 and 40 heads: rows of the last head group past the last head; page 16: boxes of
    # 16 rows.
    idx = torch.cuda.current_device()
    B = pair_batch(idx, H)
    lens = [[0, 1, 32, 64, 65, 97, 700, 1999, 2048, 129][i % 10] for i in range(B)]
    run_and_check(B, H, lens, page, dtype, seed=H, variant=variant)
    # captured with pages for 2048 tokens a request, replayed with other lengths
    args = make_cache(B, H, [2048] * B, page, dtype, "cuda", gen(H + 1))
    v = variant_for(variant, args)
    plan = mla_mod.plan(idx, B, H, args[4].shape[1], page, variant=v)
    if variant == "sm90a":
        assert plan.num_splits == plan.cluster == 2 and "merged in 2-CTA clusters" in plan.describe()
    else:
        assert plan.cluster == 1
    hmoe.prewarm()
    hmoe.ops.mla_decode(*args, sm_scale=SCALE, variant=v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = hmoe.ops.mla_decode(*args, sm_scale=SCALE, return_lse=True, variant=v)
    for new in (lens, [[2048, 31, 0, 1000, 33][i % 5] for i in range(B)]):
        args[5].copy_(torch.tensor(new, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = mla_reference(*args, SCALE)
        nz = torch.tensor(new) > 0
        assert rel_err(out[nz], ref_o[nz]) < TOL[dtype] and (lse[nz].cpu() - ref_lse[nz]).abs().max() < _reference.MLA_LSE_ATOL
        assert (out[~nz] == 0).all() and torch.isneginf(lse[~nz].cpu()).all()


@pytest.mark.gpu
def test_random_cases(variant):
    g = gen(1234)
    for i in range(8):
        B = int(torch.randint(1, 9, (1,), generator=g))
        H = int(torch.randint(1, 129, (1,), generator=g))
        lens = torch.randint(0, 1500, (B,), generator=g).tolist()
        page = [16, 32, 64, 128][i % 4]
        run_and_check(B, H, lens, page, DTYPES[i % 2], seed=100 + i, variant=variant)


@pytest.fixture(params=[None, "0"], ids=["default-loader", "cp.async"])
def loader(request, monkeypatch):
    """The KV loader: the default (the TMA on sm_90+ for CTAs of 32 heads and page sizes that are
    multiples of 32), or HMOE_MLA_TMA=0: cp.async everywhere, what sm_80 and sm_89 run."""
    if request.param is not None:
        monkeypatch.setenv("HMOE_MLA_TMA", request.param)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("page", [32, 64, 128])
@pytest.mark.parametrize("H", [33, 128])
def test_loaders_for_32_head_ctas(loader, page, H, variant):
    run_and_check(4, H, [1, 95, 600, 31], page, torch.float16, seed=page + H, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 128])
def test_nan_in_unused_pages_and_bad_entries_do_not_leak(loader, H, variant):
    # make_cache fills every unused slot with NaN and unused table entries with -7; a wild
    # page id in a used entry reads zeros instead of memory outside the cache.
    q_nope, q_pe, ckv, kpe, pt, lens = args = make_cache(3, H, [5, 64, 70], 64, torch.bfloat16, "cuda", gen(5))
    v = variant_for(variant, args)
    out = hmoe.ops.mla_decode(q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE, variant=v)
    assert rel_err(out, mla_reference(*args, SCALE)[0]) < TOL[torch.bfloat16]  # finite, and the right values
    pt[2, 1] = 10**6
    out = hmoe.ops.mla_decode(q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE, variant=v)
    # the wild entry's page reads as zeros (mla_decode's docstring): the reference with a zero page there
    zero_page = lambda c: torch.cat([c.cpu(), torch.zeros_like(c[:1]).cpu()])  # noqa: E731
    pt_ref = pt.cpu().clone()
    pt_ref[2, 1] = ckv.shape[0]
    want = mla_reference(q_nope, q_pe, zero_page(ckv), zero_page(kpe), pt_ref, lens, SCALE)[0]
    assert rel_err(out, want) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match=r"page_table\[2, 1\]"):
        hmoe.ops.mla_decode(q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE, check_indices=True, variant=v)
    lens[0] = 10**5
    with pytest.raises(ValueError, match=r"seq_lens\[0\]"):
        hmoe.ops.mla_decode(q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE, check_indices=True, variant=v)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
@pytest.mark.parametrize("H", [16, 128])
def test_cuda_graph_capture_and_replay_with_new_lengths(monkeypatch, H, variant):
    B, page = 4, 64
    # every request owns pages for 4500 tokens (16 heads: enough cache for sm90a to serve them); the
    # replays use other lengths within them
    q_nope, q_pe, ckv, kpe, pt, lens = args = make_cache(B, H, [4500] * B, page, torch.bfloat16, "cuda", gen(9))
    v = variant_for(variant, args)  # outside the capture: a forced variant that declines raises before it
    hmoe.prewarm()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        hmoe.ops.mla_decode(q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE, return_lse=True, variant=v)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out, lse = hmoe.ops.mla_decode(q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE, return_lse=True, variant=v)
    for new in ([2500, 0, 1, 64], [17, 3000, 640, 5]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        q_nope.copy_(torch.randn_like(q_nope))
        g.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = mla_reference(q_nope, q_pe, ckv, kpe, pt, lens, SCALE)
        nz = torch.tensor(new) > 0
        assert rel_err(out[nz], ref_o[nz]) < TOL[torch.bfloat16]
        assert torch.isneginf(lse[~nz].cpu()).all() and (out[~nz] == 0).all()
    monkeypatch.setattr(_cuda, "_warm", set())  # as before any call on the device: no module prewarmed,
    monkeypatch.setattr(mla_mod, "_calls", {})  # and no call's decisions remembered
    with pytest.raises(RuntimeError, match="prewarm"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            hmoe.ops.mla_decode(q_nope, q_pe, ckv, kpe, pt, lens, sm_scale=SCALE, variant=v)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 128])
def test_threads_sharing_a_stream_and_the_split_buffer(H, variant):
    # Long sequences: every call splits the KV and uses the stream's partials buffer; calls from
    # several threads on one stream must not interleave their decode and combine kernels on it.
    import threading

    B, lens = 2, [6000, 4100]
    cases = [make_cache(B, H, lens, 64, torch.bfloat16, "cuda", gen(40 + i)) for i in range(4)]
    refs = [mla_reference(*c, SCALE)[0] for c in cases]
    v = variant_for(variant, cases[0])
    hmoe.ops.mla_decode(*cases[0], sm_scale=SCALE, variant=v)
    results, errors = {}, []

    def work(i):
        try:
            for r in range(6):
                results[i, r] = hmoe.ops.mla_decode(*cases[i], sm_scale=SCALE, variant=v)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors and len(results) == 24
    for (i, _), got in results.items():
        assert rel_err(got, refs[i]) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_eager_calls_changing_kernel_grid_and_dtype_on_one_stream(variant):
    # Eager calls that split launch their decode and combine kernels through the stream's graph
    # (cuda/common/launch.h), whose nodes' kernel, grid and arguments change from call to call here;
    # out= and fresh outputs alike, lse too, each checked against the reference.
    shapes = [(2, 128, [6000, 4100], 64, torch.bfloat16), (1, 16, [900], 32, torch.float16),
              (3, 40, [3000, 0, 2500], 64, torch.float16), (1, 128, [20000], 64, torch.bfloat16)]
    cases = [make_cache(B, H, lens, page, dtype, "cuda", gen(70 + i)) for i, (B, H, lens, page, dtype) in
             enumerate(shapes)]
    refs = [mla_reference(*c, SCALE) for c in cases]
    vs = [variant_for(variant, c) for c in cases]
    for _ in range(2):
        for c, (ref_o, ref_lse), v, (B, H, lens, page, dtype) in zip(cases, refs, vs, shapes):
            out = torch.full_like(c[0], float("nan"))
            got, lse = hmoe.ops.mla_decode(*c, sm_scale=SCALE, variant=v, return_lse=True, out=out)
            fresh = hmoe.ops.mla_decode(*c, sm_scale=SCALE, variant=v)
            torch.cuda.synchronize()
            nz = torch.tensor(lens) > 0
            assert got is out and rel_err(got[nz], ref_o[nz]) < TOL[dtype] and torch.equal(fresh, got)
            assert (lse[nz].cpu() - ref_lse[nz]).abs().max() < _reference.MLA_LSE_ATOL
            assert (got[~nz] == 0).all() and torch.isneginf(lse[~nz].cpu()).all()


@pytest.mark.gpu
def test_tensors_taking_turns_in_one_storage(variant):
    # The TMA's tensor maps (sm90a, and the portable kernel's TMA loader) are kept per thread for a
    # tensor at the same address with the same shape and box (cuda/common/tma_host.h): q and the
    # cache here take turns in one storage with other head counts, page sizes (boxes of 32 or 16 rows)
    # and page counts, twice over, each call against its reference.
    shapes = [(2, 128, [3000, 1000], 64), (2, 128, [3000, 1000], 16), (3, 64, [700, 0, 2200], 64),
              (1, 33, [5000], 32), (4, 128, [64, 129, 31, 2048], 16)]
    cases = [make_cache(B, H, lens, page, torch.bfloat16, "cuda", gen(90 + i)) for i, (B, H, lens, page) in
             enumerate(shapes)]
    refs = [mla_reference(*c, SCALE) for c in cases]
    storages = [torch.empty(max(c[j].numel() for c in cases), dtype=torch.bfloat16, device="cuda") for j in range(4)]
    for _ in range(2):
        for c, (ref_o, ref_lse), (_, _, lens, _) in zip(cases, refs, shapes):
            q_nope, q_pe, ckv, kpe = in_storage(c[:4], storages)
            args = (q_nope, q_pe, ckv, kpe, c[4], c[5])
            out, lse = hmoe.ops.mla_decode(*args, sm_scale=SCALE, return_lse=True, variant=variant_for(variant, args))
            torch.cuda.synchronize()
            nz = torch.tensor(lens) > 0
            assert rel_err(out[nz], ref_o[nz]) < TOL[torch.bfloat16]
            assert (lse[nz].cpu() - ref_lse[nz]).abs().max() < _reference.MLA_LSE_ATOL
            assert (out[~nz] == 0).all()


PTX_CHECK = """
import sys, torch, hmoe
from tests.ops.mla_reference import TOL, make_cache, mla_reference, rel_err
# Under CUDA_FORCE_PTX_JIT torch's own kernels may have no PTX: only copies touch the GPU here.
# The portable family forced: the only one with PTX (sm90a is arch-specific SASS alone).
for B, H, lens, page, dtype in [(3, 20, [0, 300, 5000], 64, torch.bfloat16), (2, 128, [77, 1], 32, torch.float16)]:
    cpu = make_cache(B, H, lens, page, dtype, "cpu", torch.Generator().manual_seed(B))
    out, lse = hmoe.ops.mla_decode(*[t.to("cuda") for t in cpu], sm_scale=0.07, return_lse=True, variant="portable")
    ref_o, ref_lse = mla_reference(*cpu, 0.07)
    nz = torch.tensor(lens) > 0
    assert rel_err(out.cpu()[nz], ref_o[nz]) < TOL[dtype], "PTX result differs"
print("PTX-OK")
"""


@pytest.mark.gpu
def test_ptx_path_in_a_subprocess():
    r = run_forced_ptx(PTX_CHECK, timeout=600)
    assert r.returncode == 0 and "PTX-OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("H", [4, 64])
def test_bad_input_on_gpu(H, variant):
    # Each family's module checks the calls it runs (forced: both head counts on sm90a too).
    q_nope, q_pe, ckv, kpe, pt, lens = args = make_cache(2, H, [5, 6], 64, torch.bfloat16, "cuda", gen(2))
    v = variant_for(variant, args)
    call = lambda **kw: hmoe.ops.mla_decode(**{**dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe,
                                                      page_table=pt, seq_lens=lens, sm_scale=SCALE, variant=v), **kw})
    with pytest.raises(TypeError, match="q_pe has dtype"):
        call(q_pe=q_pe.half())
    with pytest.raises(ValueError, match="q_pe has shape"):
        call(q_pe=q_pe[:, :3].contiguous())
    with pytest.raises(ValueError, match="kpe_cache has shape"):
        call(kpe_cache=kpe[:, :32].contiguous())
    with pytest.raises(ValueError, match="page_table has shape"):
        call(page_table=pt[:1])
    with pytest.raises(TypeError, match="seq_lens must have dtype"):
        call(seq_lens=lens.long())
    with pytest.raises(ValueError, match="contiguous"):
        call(ckv_cache=ckv.transpose(0, 1))
    with pytest.raises(ValueError, match="129 heads"):
        call(q_nope=torch.zeros(2, 129, 512, dtype=torch.bfloat16, device="cuda"),
             q_pe=torch.zeros(2, 129, 64, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="sm_scale"):
        call(sm_scale=float("nan"))
    with pytest.raises(ValueError, match="must be on the CUDA"):
        call(seq_lens=lens.cpu())
    out = hmoe.ops.mla_decode(q_nope[:0], q_pe[:0], ckv, kpe, pt[:0], lens[:0], sm_scale=SCALE, variant=v)
    assert out.shape == (0, H, 512)


def test_bad_input_without_gpu():
    x = torch.zeros(1, 1, 512, dtype=torch.bfloat16)
    pe = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    args = (x, pe, torch.zeros(1, 64, 512, dtype=torch.bfloat16), torch.zeros(1, 64, 64, dtype=torch.bfloat16),
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="q_nope must be a torch.Tensor"):
        hmoe.ops.mla_decode([1], *args[1:], sm_scale=1.0)
    with pytest.raises(TypeError, match="q_nope must have dtype"):
        hmoe.ops.mla_decode(x.float(), *args[1:], sm_scale=1.0)
    with pytest.raises(ValueError, match="must be on the CUDA"):
        hmoe.ops.mla_decode(*args, sm_scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [4, 64])
def test_misuse_refused_before_launch(H, variant):
    q_nope, q_pe, ckv, kpe, pt, lens = make_cache(2, H, [5, 6], 64, torch.bfloat16, "cuda", gen(3))
    args = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, page_table=pt, seq_lens=lens)
    args["variant"] = variant_for(variant, tuple(args.values()))
    for scale in (1e39, -1e39, float("inf")):
        with pytest.raises(ValueError, match="sm_scale must be finite in float32"):
            hmoe.ops.mla_decode(**args, sm_scale=scale)
    with pytest.raises(TypeError, match="sm_scale must be a float"):
        hmoe.ops.mla_decode(**args, sm_scale="0.1")
    # out aliasing an input: the kernel would overwrite what it still reads.
    alias = q_nope.view(-1)[: 2 * H * 512].view(2, H, 512)
    with pytest.raises(ValueError, match="out overlaps q_nope"):
        hmoe.ops.mla_decode(**args, sm_scale=SCALE, out=alias)
    big = ckv.view(-1)[: 2 * H * 512].view(2, H, 512)
    with pytest.raises(ValueError, match="out overlaps ckv_cache"):
        hmoe.ops.mla_decode(**args, sm_scale=SCALE, out=big)
    # A batch past the CUDA grid's limit.
    B = mla_mod.MAX_BATCH + 1
    many = make_cache(1, H, [5], 64, torch.bfloat16, "cuda", gen(4))
    with pytest.raises(ValueError, match="at most 65535 requests"):
        hmoe.ops.mla_decode(many[0].expand(B, H, 512).contiguous(), many[1].expand(B, H, 64).contiguous(),
                            many[2], many[3], many[4].expand(B, -1).contiguous(),
                            many[5].expand(B).contiguous(), sm_scale=SCALE, variant=args["variant"])
    # A request whose capacity (max_pages * page_size) an int32 cannot hold.
    wide = torch.zeros(1, 2 ** 25, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="below 2\\^31"):
        hmoe.ops.mla_decode(many[0], many[1], many[2], many[3], wide, many[5], sm_scale=SCALE, variant=args["variant"])
