"""mla_rope_append on the GPU against hmoe._reference.mla_rope_append: in fp64 without rounding (the
dtype's tolerance) and rounding where the contract does (tight), with NaN-poisoned caches that show
every row the kernel writes; plus its checks, with and without a GPU."""
import pytest
import torch

import hmoe
from hmoe import _reference
from hmoe.ops import mla

R, D = mla.D_CKV, mla.D_PE


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rel(got, want):
    assert torch.isfinite(got).all(), "NaN or inf in the output"
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def inputs(B, H, nope, pages, page, dtype, cos_dtype, cos_rows, g, device="cuda"):
    q = torch.randn(B, H, nope + D, generator=g).to(dtype)
    kv = (torch.randn(B, R + D, generator=g) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(R, generator=g)).to(dtype)
    angle = torch.rand(cos_rows, D, generator=g) * 6.3
    cos, sin = angle.cos().to(cos_dtype), angle.sin().to(cos_dtype)
    ckv = torch.full((pages, page, R), float("nan"), dtype=dtype)
    kpe = torch.full((pages, page, D), float("nan"), dtype=dtype)
    pt = torch.randperm(pages, generator=g)[: B * 3].view(B, 3).int()
    return [t.to(device) for t in (q, kv, w, cos, sin, ckv, kpe, pt)]


def check(q, kv, w, cos, sin, ckv, kpe, pt, lens, layout, eps=1e-6):
    """Runs the op and checks q_pe, the appended rows and that no other cache row changed."""
    before_ckv, before_kpe = ckv.clone(), kpe.clone()
    q_pe = hmoe.ops.mla_rope_append(q, kv, w, cos, sin, ckv, kpe, pt, lens, eps=eps, rope_layout=layout)
    torch.cuda.synchronize()
    dtype = q.dtype
    assert q_pe.shape == (q.shape[0], q.shape[1], D) and q_pe.dtype == dtype and q_pe.is_contiguous()
    exact = _reference.mla_rope_append(q.cpu(), kv.cpu(), w.cpu(), cos.cpu(), sin.cpu(), eps, layout, contract=False)
    same = _reference.mla_rope_append(q.cpu(), kv.cpu(), w.cpu(), cos.cpu(), sin.cpu(), eps, layout)
    tol, tight = (_reference.tolerance(op, dtype) for op in ("mla_rope_append", "mla_rope_append_same_rounding"))
    assert rel(q_pe.cpu(), exact[0]) <= tol and rel(q_pe.cpu(), same[0]) <= tight
    page = ckv.shape[1]
    written = torch.zeros(ckv.shape[0] * page, dtype=torch.bool)
    for b, L in enumerate(lens.tolist()):
        if not 1 <= L <= pt.shape[1] * page or not 0 <= int(pt[b, (L - 1) // page]) < ckv.shape[0]:
            continue  # the contract writes nothing for this request
        row = int(pt[b, (L - 1) // page]) * page + (L - 1) % page
        written[row] = True
        got_ckv, got_kpe = ckv.view(-1, R)[row].cpu(), kpe.view(-1, D)[row].cpu()
        assert rel(got_ckv, exact[1][b]) <= tol and rel(got_ckv, same[1][b]) <= tight
        assert rel(got_kpe, exact[2][b]) <= tol and rel(got_kpe, same[2][b]) <= tight
    untouched = ~written.to(ckv.device)
    assert torch.equal(ckv.view(-1, R)[untouched].isnan(), before_ckv.view(-1, R)[untouched].isnan())
    assert torch.equal(kpe.view(-1, D)[untouched].isnan(), before_kpe.view(-1, D)[untouched].isnan())
    return q_pe, written


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", mla.ROPE_LAYOUTS)
@pytest.mark.parametrize("cos_dtype", [torch.float32, "same"])
def test_layouts_and_dtypes(dtype, layout, cos_dtype):
    cos_dtype = dtype if cos_dtype == "same" else cos_dtype
    for B, H, nope, cos_rows, seed in ((1, 16, 128, 1, 1), (5, 128, 128, 5, 2), (3, 3, 0, 1, 3), (2, 9, 64, 2, 4)):
        args = inputs(B, H, nope, 40, 64, dtype, cos_dtype, cos_rows, gen(seed))
        lens = torch.tensor([1 + 37 * b for b in range(B)], dtype=torch.int32, device="cuda")  # 1, 38, 75, ... <= 192
        _, written = check(*args, lens, layout)
        assert written.sum() == B


@pytest.mark.gpu
def test_lengths_and_pages_outside_the_cache_write_nothing():
    q, kv, w, cos, sin, ckv, kpe, pt = inputs(6, 16, 128, 20, 16, torch.bfloat16, torch.float32, 1, gen(5))
    pt[3, 1] = 20  # a page id past the cache (request 3 appends into its second page)
    pt[4, 0] = -1
    lens = torch.tensor([0, 48, 49, 17, 3, 16], dtype=torch.int32, device="cuda")  # 0 and past capacity: nothing
    _, written = check(q, kv, w, cos, sin, ckv, kpe, pt, lens, "half")
    assert written.sum() == 2  # requests 1 (the last slot of its last page) and 5 (a page boundary)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay_with_new_lengths():
    B, H = 3, 16
    q, kv, w, cos, sin, ckv, kpe, pt = inputs(B, H, 128, 12, 64, torch.bfloat16, torch.bfloat16, 1, gen(6))
    lens = torch.tensor([1, 2, 3], dtype=torch.int32, device="cuda")
    hmoe.prewarm()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q_pe = hmoe.ops.mla_rope_append(q, kv, w, cos, sin, ckv, kpe, pt, lens, eps=1e-6, rope_layout="interleaved")
    for new in ([64, 100, 7], [130, 1, 192]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        kv.copy_(torch.randn_like(kv))
        g.replay()
        torch.cuda.synchronize()
        want = _reference.mla_rope_append(q.cpu(), kv.cpu(), w.cpu(), cos.cpu(), sin.cpu(), 1e-6, "interleaved")
        assert rel(q_pe.cpu(), want[0]) <= _reference.tolerance("mla_rope_append_same_rounding", torch.bfloat16)
        for b, L in enumerate(new):
            row = int(pt[b, (L - 1) // 64]) * 64 + (L - 1) % 64
            assert rel(ckv.view(-1, R)[row].cpu(), want[1][b]) <= \
                _reference.tolerance("mla_rope_append_same_rounding", torch.bfloat16)


@pytest.mark.gpu
def test_bad_input_on_gpu():
    q, kv, w, cos, sin, ckv, kpe, pt = inputs(2, 4, 128, 8, 64, torch.bfloat16, torch.float32, 1, gen(7))
    lens = torch.tensor([5, 6], dtype=torch.int32, device="cuda")
    args = dict(q=q, kv=kv, norm_weight=w, cos=cos, sin=sin, ckv_cache=ckv, kpe_cache=kpe, page_table=pt,
                seq_lens=lens, eps=1e-6, rope_layout="half")
    call = lambda **kw: hmoe.ops.mla_rope_append(**{**args, **kw})
    with pytest.raises(TypeError, match="kv must have dtype"):
        call(kv=kv.half())
    with pytest.raises(ValueError, match=r"kv has shape \(2, 512\), expected \(2, 576\)"):
        call(kv=kv[:, :512].contiguous())
    with pytest.raises(ValueError, match="norm_weight has shape"):
        call(norm_weight=w[:256])
    with pytest.raises(ValueError, match=r"cos has shape \(3, 64\)"):
        call(cos=cos.expand(3, 64).contiguous(), sin=sin.expand(3, 64).contiguous())
    with pytest.raises(TypeError, match="sin must have dtype"):
        call(sin=sin.half())
    with pytest.raises(ValueError, match="at least 64"):
        call(q=q[..., :32].contiguous())
    with pytest.raises(TypeError, match="ckv_cache has dtype"):
        call(ckv_cache=ckv.half())
    with pytest.raises(ValueError, match="page_table has shape"):
        call(page_table=pt[:1])
    with pytest.raises(ValueError, match="rope_layout must be 'interleaved', 'half' or 'interleaved_to_half'"):
        call(rope_layout="neox")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        call(eps=-1.0)
    with pytest.raises(ValueError, match="contiguous"):
        call(q=q.transpose(0, 1))
    with pytest.raises(ValueError, match="ckv_cache overlaps kv"):
        call(kv=ckv.view(-1)[: 2 * 576].view(2, 576))
    with pytest.raises(ValueError, match="must be on the CUDA"):
        call(seq_lens=lens.cpu())
    empty = hmoe.ops.mla_rope_append(**{**args, "q": q[:0], "kv": kv[:0], "page_table": pt[:0], "seq_lens": lens[:0]})
    assert empty.shape == (0, 4, D)


def test_bad_input_without_gpu():
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        hmoe.ops.mla_rope_append([1], None, None, None, None, None, None, None, None, eps=1e-6, rope_layout="half")
    with pytest.raises(ValueError, match="must be on the CUDA"):
        hmoe.ops.mla_rope_append(torch.zeros(1, 1, 192, dtype=torch.bfloat16), None, None, None, None, None, None,
                                 None, None, eps=1e-6, rope_layout="half")


@pytest.mark.parametrize("layout", mla.ROPE_LAYOUTS)
def test_reference_rope_is_the_rotation_transformers_applies(layout):
    # The reference's layouts against transformers' own functions, in fp64, on the CPU.
    pytest.importorskip("transformers")
    g = gen(8)
    q, k = torch.randn(2, 3, 1, 64, generator=g, dtype=torch.float64), torch.randn(2, 1, 1, 64, generator=g,
                                                                                   dtype=torch.float64)
    angle = torch.rand(1, 1, 32, generator=g, dtype=torch.float64) * 6.3
    if layout == "interleaved":
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2

        freqs = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)
        want_q, want_k = v2.apply_rotary_emb(q.float(), k.float(), freqs)
        cos, sin = freqs.real.repeat_interleave(2, -1)[0], freqs.imag.repeat_interleave(2, -1)[0]
    else:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

        emb = torch.cat((angle, angle), -1)
        cos, sin = emb.cos(), emb.sin()
        f = v3.apply_rotary_pos_emb_interleave if layout == "interleaved_to_half" else v3.apply_rotary_pos_emb
        want_q, want_k = f(q, k, cos, sin)
        cos, sin = cos[0], sin[0]
    kv = torch.cat((torch.randn(2, 16, generator=g, dtype=torch.float64), k.view(2, 64)), -1)
    got_q, _, got_k = _reference.mla_rope_append(q.view(2, 3, 64), kv, torch.ones(16, dtype=torch.float64), cos, sin,
                                                  1e-6, layout, contract=False)
    assert rel(got_q, want_q.view(2, 3, 64)) < 1e-6 and rel(got_k, want_k.view(2, 64)) < 1e-6
