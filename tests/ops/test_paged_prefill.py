"""paged_prefill: the paged cache's gathering and index checks on the CPU; on the GPU against the
references on the gathered requests, with mla_decode's page walk and bounds rules."""
import pytest
import torch

import hmoe
from hmoe import _reference
from hmoe.ops import prefill as prefill_mod

from .prefill_reference import DTYPES, HEAD_DIMS, indptr, make_paged, make_ragged, rel_err, tol

SCALE = 192 ** -0.5


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_paged_as_ragged_gathers_in_page_order():
    q, kc, vc, pt, lens, qo = make_paged([3, 0, 5], [10, 4, 37], 2, 1, (64, 64), 8, torch.bfloat16, "cpu", gen(1))
    k, v, kv = _reference.paged_as_ragged(kc, vc, pt, lens)
    assert kv.tolist() == [0, 10, 14, 51] and k.shape == (51, 1, 64) and v.shape == (51, 1, 64)
    for b, n in enumerate([10, 4, 37]):
        for j in range(n):
            assert torch.equal(k[kv[b] + j], kc[pt[b, j // 8], j % 8])
    assert torch.isfinite(k.float()).all()  # no NaN slot of the cache was gathered
    # lengths past the table's capacity are clamped; bad page ids read as zeros
    pt[2, 1] = 10 ** 6
    lens[2] = 10 ** 4
    k2, _, kv2 = _reference.paged_as_ragged(kc, vc, pt, lens)
    assert kv2[-1] - kv2[-2] == pt.shape[1] * 8 and (k2[kv2[2] + 8:kv2[2] + 16] == 0).all()


def test_validate_paged_names_the_bad_entry():
    q, kc, vc, pt, lens, qo = make_paged([3, 5], [10, 37], 2, 1, (64, 64), 8, torch.bfloat16, "cpu", gen(2))
    prefill_mod.validate_paged(q, kc, pt, lens, qo, True)
    bad_lens = lens.clone()
    bad_lens[1] = 41
    with pytest.raises(ValueError, match=r"kv_lens\[1\] = 41 is outside \[0, 40\]"):
        prefill_mod.validate_paged(q, kc, pt, bad_lens, qo, True)
    bad_pt = pt.clone()
    bad_pt[1, 2] = kc.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[1, 2\]"):
        prefill_mod.validate_paged(q, kc, bad_pt, lens, qo, True)
    bad_pt[0, 3] = 10 ** 6  # past request 0's pages (10 tokens: 2 pages): unused, not an error
    bad_pt[1, 2] = pt[1, 2]
    prefill_mod.validate_paged(q, kc, bad_pt, lens, qo, True)
    with pytest.raises(ValueError, match=r"qo_indptr\[2\] = 8, expected 9"):
        prefill_mod.validate_paged(torch.zeros(9, 2, 64), kc, pt, lens, qo, True)
    with pytest.raises(ValueError, match="request 1 has 5 queries and 4 keys"):
        prefill_mod.validate_paged(q, kc, pt, torch.tensor([10, 4], dtype=torch.int32), qo, True)


def test_bad_input_without_gpu():
    q, kc, vc, pt, lens, qo = make_paged([3], [10], 2, 1, (64, 64), 8, torch.bfloat16, "cpu", gen(3))
    with pytest.raises(ValueError, match="must be on the CUDA"):
        hmoe.ops.paged_prefill(q, kc, vc, pt, lens, qo, sm_scale=1.0)
    with pytest.raises(TypeError, match="q must have dtype"):
        hmoe.ops.paged_prefill(q.float(), kc, vc, pt, lens, qo, sm_scale=1.0)


# --- GPU ----------------------------------------------------------------------------------------

def run_and_check(q, kc, vc, pt, lens, qo, *, causal=True):
    H, dv = q.shape[1], vc.shape[3]
    out = torch.full((q.shape[0], H, dv), float("nan"), dtype=q.dtype, device="cuda")
    got, lse = hmoe.ops.paged_prefill(q, kc, vc, pt, lens, qo, causal=causal, sm_scale=SCALE, return_lse=True,
                                      out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    k, v, kv = _reference.paged_as_ragged(kc, vc, pt, lens)
    kv = kv.cuda()
    ref, ref_lse = _reference.prefill(q, k, v, qo, kv, SCALE, causal)
    seen = torch.isfinite(ref_lse)
    assert (got[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()
    assert rel_err(got, ref) < tol(q.dtype)
    if seen.any():
        assert float((lse[seen].double() - ref_lse[seen]).abs().max()) < _reference.PREFILL_LSE_ATOL
    p = prefill_mod.plan(q.get_device(), q.shape[0], pt.shape[0], H, kc.shape[2], q.shape[2], dv)
    near, _ = _reference.prefill_rounded_p(q, k, v, qo, kv, SCALE, causal, tile_kv=p.tile_kv)
    assert rel_err(got, near) < tol(q.dtype, same_rounding=True)
    return got, lse


@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 4, 8, 16, 24, 32, 33, 64, 128, 192])
def test_page_sizes(page):
    # on sm_90 and newer the whole 64-key tiles of pages 8, 16, 32 (192 x 128: a box a page and block),
    # 64 and 128 (a box a tile) come by TMA; pages 1, 4, 24, 33 and 192 (not powers of two) by cp.async
    run_and_check(*make_paged([1, 70, 0, 130], [200, 70, 9, 300], 4, 2, (192, 128), page, torch.bfloat16, "cuda",
                              gen(page)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"{d[0]}x{d[1]}")
def test_head_dims_and_dtypes(dtype, dims):
    run_and_check(*make_paged([0, 1, 7, 128, 129, 40], [5, 1, 7, 128, 257, 1000], 5, 1, dims, 16, dtype, "cuda",
                              gen(dims[0])))


@pytest.mark.gpu
def test_non_causal():
    run_and_check(*make_paged([50, 300], [20, 129], 2, 2, (128, 128), 32, torch.float16, "cuda", gen(4)),
                  causal=False)


@pytest.mark.gpu
def test_same_result_as_ragged():
    # the same requests through both KV sources of the portable family: one kernel body, so the same
    # values bit for bit
    q_lens, kv_lens = [70, 0, 300], [100, 5, 300]
    q, k, v, qo, kv = make_ragged(q_lens, kv_lens, 4, 4, (192, 128), torch.bfloat16, "cuda", gen(5))
    page = 16
    need = [(n + page - 1) // page for n in kv_lens]
    pt = torch.full((3, max(need)), -1, dtype=torch.int32)
    kc = torch.zeros(sum(need), page, 4, 192, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros(sum(need), page, 4, 128, dtype=torch.bfloat16, device="cuda")
    nxt = 0
    for b, n in enumerate(kv_lens):
        for i in range(need[b]):
            rows = slice(kv[b] + i * page, kv[b] + min(n, (i + 1) * page))
            kc[nxt, : rows.stop - rows.start], vc[nxt, : rows.stop - rows.start] = k[rows], v[rows]
            pt[b, i] = nxt
            nxt += 1
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    a = hmoe.ops.ragged_prefill(q, k, v, qo, kv, sm_scale=SCALE, variant="portable")  # paged's family
    b = hmoe.ops.paged_prefill(q, kc, vc, pt.cuda(), lens, qo, sm_scale=SCALE)
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_nan_in_unused_slots_bad_pages_and_lengths_do_not_leak():
    q, kc, vc, pt, lens, qo = make_paged([5, 64, 70], [5, 64, 70], 2, 2, (128, 128), 16, torch.bfloat16, "cuda",
                                         gen(6))
    run_and_check(q, kc, vc, pt, lens, qo)  # every unused slot holds NaN
    pt[2, 1] = 10 ** 6  # a wild page id in a used entry reads zeros
    out = hmoe.ops.paged_prefill(q, kc, vc, pt, lens, qo, sm_scale=SCALE)
    assert torch.isfinite(out.float()).all()
    run_and_check(q, kc, vc, pt, lens, qo)
    with pytest.raises(ValueError, match=r"page_table\[2, 1\]"):
        hmoe.ops.paged_prefill(q, kc, vc, pt, lens, qo, sm_scale=SCALE, check_indices=True)
    # A length past the table's capacity is clamped to it: request 0 then reads the rest of its one
    # page (made finite here) and zeros for its -7 entries.
    kc[pt[0, 0], 5:], vc[pt[0, 0], 5:] = 0.5, -0.25
    lens[0] = 10 ** 5
    run_and_check(q, kc, vc, pt, lens, qo, causal=False)
    with pytest.raises(ValueError, match=r"kv_lens\[0\]"):
        hmoe.ops.paged_prefill(q, kc, vc, pt, lens, qo, sm_scale=SCALE, check_indices=True)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [8, 16, 32, 64])
@pytest.mark.parametrize("dims", [(192, 128), (128, 128)], ids=lambda d: f"{d[0]}x{d[1]}")
def test_tma_pages_with_bad_ids_and_nan(dims, page):
    # The whole 64-key tiles of a request come by TMA on sm_90 and newer: a box of the tile where a
    # page holds it, at 192 x 128 a box a page and block where pages of 8-32 keys make it (a bad page
    # id a box before the cache: zeros); 128 x 128 takes those pages, and every partial last tile, by
    # cp.async; unused slots hold NaN. A wild id in a whole tile's entry (key 70 of request 0) and a
    # negative one in a partial tile's (key 195 of request 2) read zeros.
    q, kc, vc, pt, lens, qo = make_paged([64, 1, 100, 0], [128, 64, 200, 70], 4, 2, dims, page, torch.bfloat16,
                                         "cuda", gen(8))
    run_and_check(q, kc, vc, pt, lens, qo)
    pt[0, 70 // page], pt[2, 195 // page] = 10 ** 6, -3
    run_and_check(q, kc, vc, pt, lens, qo)
    run_and_check(q, kc, vc, pt, lens, qo, causal=False)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
@pytest.mark.parametrize("page", [16, 32, 64])
def test_cuda_graph_replay_with_new_lengths_and_pages(page):
    q, kc, vc, pt, lens, qo = make_paged([100, 156], [400, 600], 2, 1, (192, 128), page, torch.bfloat16, "cuda",
                                         gen(7))
    hmoe.prewarm()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        hmoe.ops.paged_prefill(q, kc, vc, pt, lens, qo, sm_scale=SCALE)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = hmoe.ops.paged_prefill(q, kc, vc, pt, lens, qo, sm_scale=SCALE)
    for q_lens, kv_lens in (([256, 0], [300, 9]), ([1, 255], [1, 590])):
        qo.copy_(indptr(q_lens))
        lens.copy_(torch.tensor(kv_lens, dtype=torch.int32))
        pt.copy_(pt.flip(0))  # the requests swap pages
        g.replay()
        torch.cuda.synchronize()
        k, v, kv = _reference.paged_as_ragged(kc, vc, pt, lens)
        ref, _ = _reference.prefill(q, k, v, qo, kv.cuda(), SCALE)
        assert rel_err(out, ref) < tol(torch.bfloat16)


@pytest.mark.gpu
def test_bad_input_on_gpu():
    q, kc, vc, pt, lens, qo = make_paged([3, 4], [10, 20], 4, 2, (128, 128), 16, torch.bfloat16, "cuda", gen(8))
    call = lambda **kw: hmoe.ops.paged_prefill(**{**dict(q=q, k_cache=kc, v_cache=vc, page_table=pt,  # noqa: E731
                                                         kv_lens=lens, qo_indptr=qo, sm_scale=SCALE), **kw})
    with pytest.raises(ValueError, match="k_cache must be 4-D"):
        call(k_cache=kc[0])
    with pytest.raises(ValueError, match="v_cache has shape"):
        call(v_cache=vc[:, :8].contiguous())
    with pytest.raises(TypeError, match="v_cache has dtype float16"):
        call(v_cache=vc.half())
    with pytest.raises(ValueError, match=r"qo_indptr has shape \(2,\), expected \(3,\)"):
        call(qo_indptr=qo[:2])
    with pytest.raises(ValueError, match=r"kv_lens has shape \(1,\), expected \(2,\)"):
        call(kv_lens=lens[:1])
    with pytest.raises(TypeError, match="page_table must have dtype int32"):
        call(page_table=pt.long())
    with pytest.raises(ValueError, match="below 2\\^31"):  # 2^24 pages of 128 tokens a request
        big = make_paged([3], [10], 4, 2, (128, 128), 128, torch.bfloat16, "cuda", gen(9))
        hmoe.ops.paged_prefill(big[0], big[1], big[2], torch.zeros(1, 2 ** 24, dtype=torch.int32, device="cuda"),
                               big[4], big[5], sm_scale=SCALE)
    with pytest.raises(ValueError, match=r"head dims \(q/k 128, v 64\)"):
        call(v_cache=vc[..., :64].contiguous())
