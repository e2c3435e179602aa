"""hmoe.ops.mla_decode: DeepSeek MLA decode (absorbed form) over a paged latent KV cache.

For request b and head h, with L = seq_lens[b] cached tokens j (token j lives in page
page_table[b, j // page_size], slot j % page_size):
    s_j = sm_scale * (q_nope[b, h] . ckv[j] + q_pe[b, h] . kpe[j])
    out[b, h] = sum_j softmax(s)_j * ckv[j]            (512-d, q's dtype)
    lse[b, h] = log(sum_j exp(s_j))                       (fp32, natural log; -inf when L = 0)
Precision contract: q and the cache are read exactly (bf16 or fp16); Q K^T and P V products
are exact and accumulate in fp32; the softmax runs in fp32 (base 2, with sm_scale * log2(e)
folded into the scores); the probabilities P are rounded to q's dtype before P V (the
tensor-core input format); splits of a long sequence are merged in fp32; the output is
rounded once to q's dtype. L = 0 gives out = 0 and lse = -inf.
"""
from __future__ import annotations

import os
import threading

from .. import _dtypes, validation as V
from . import _cuda, _pages, mla_flashinfer  # importing mla_flashinfer registers "flashinfer-fa2"/"-fa3"

D_CKV, D_PE = 512, 64
MAX_HEADS = 128
MAX_BATCH = 65535  # the CUDA grid's z dimension

_lock = threading.Lock()
_plans: dict = {}


def plan(mod, index: int, batch: int, heads: int, max_pages: int, page_size: int) -> tuple:
    """(num_splits, heads_per_cta, tile_tokens, smem_bytes) for this shape on cuda:<index>."""
    key = (index, batch, heads, max_pages, page_size)
    with _lock:
        got = _plans.get(key)
    if got is None:
        got = tuple(mod.mla_decode_plan(index, batch, heads, max_pages, page_size))
        with _lock:
            _plans[key] = got
    return got


def _validate(torch, q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale):
    dt = (torch.bfloat16, torch.float16)
    V.tensor("q_nope", q_nope, ndim=3, dtypes=dt, device="cuda")
    dev = q_nope.device
    for name, t, nd, dts in (("q_pe", q_pe, 3, dt), ("ckv_cache", ckv_cache, 3, dt),
                             ("kpe_cache", kpe_cache, 3, dt),
                             ("page_table", page_table, 2, (torch.int32,)),
                             ("seq_lens", seq_lens, 1, (torch.int32,))):
        V.tensor(name, t, ndim=nd, dtypes=dts, device="cuda")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, q_nope on {dev}: all inputs must share a device")
    for name, t in (("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if t.dtype != q_nope.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, q_nope {q_nope.dtype}: they must match")
    B, H, d = q_nope.shape
    if d != D_CKV:
        raise ValueError(f"q_nope has shape {tuple(q_nope.shape)}: the last dimension must be {D_CKV}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q_nope has {H} heads; mla_decode supports 1 to {MAX_HEADS}")
    if tuple(q_pe.shape) != (B, H, D_PE):
        raise ValueError(f"q_pe has shape {tuple(q_pe.shape)}, expected {(B, H, D_PE)}")
    P, page, d = ckv_cache.shape
    if d != D_CKV:
        raise ValueError(f"ckv_cache has shape {tuple(ckv_cache.shape)}: the last dimension must be {D_CKV}")
    if page < 1 or P < 1:
        raise ValueError(f"ckv_cache has shape {tuple(ckv_cache.shape)}: no pages")
    if P * page > V.INT32_MAX:  # the kernel indexes cache rows with int32 (2.4 TB of bf16 latents)
        raise ValueError(f"ckv_cache has {P * page} token rows; mla_decode supports fewer than 2^31")
    if tuple(kpe_cache.shape) != (P, page, D_PE):
        raise ValueError(f"kpe_cache has shape {tuple(kpe_cache.shape)}, expected {(P, page, D_PE)}")
    if page_table.shape[0] != B or page_table.shape[1] < 1:
        raise ValueError(f"page_table has shape {tuple(page_table.shape)}, expected [{B}, max_pages >= 1]")
    if tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}, expected ({B},)")
    check_sizes(B, H, page_table.shape[1], page)
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary (it is a view at an odd offset)")
    return V.f32_arg("sm_scale", sm_scale)


def check_sizes(B: int, H: int, max_pages: int, page_size: int) -> None:
    """The limits of the kernels' 32-bit arguments and of the CUDA grid (B is a grid dimension)."""
    if B > MAX_BATCH:
        raise ValueError(f"q_nope has batch {B}; mla_decode runs at most {MAX_BATCH} requests a call "
                         "(the CUDA grid's limit): split the batch")
    if max_pages * page_size > V.INT32_MAX or B * max_pages > V.INT32_MAX:
        raise ValueError(f"page_table [{B}, {max_pages}] with page size {page_size}: a request's "
                         "capacity (max_pages * page_size) and the table (batch * max_pages) must "
                         "stay below 2^31")


def validate_indices(page_table, seq_lens, page_size: int, num_pages: int) -> None:
    """Raises ValueError unless 0 <= seq_lens[b] <= max_pages * page_size and every page-table
    entry a request uses lies in [0, num_pages). Reads device memory: synchronises."""
    torch = V.torch_module()
    lens = seq_lens.cpu()
    max_pages = page_table.shape[1]
    cap = max_pages * page_size
    bad = ((lens < 0) | (lens > cap)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} is outside [0, {cap}] "
                         f"(max_pages {max_pages} x page size {page_size})")
    pt = page_table.cpu()
    where = _pages.bad_entry(pt, _pages.used_pages(torch, pt, lens.to(torch.int64), page_size)[1], num_pages)
    if where is not None:
        raise ValueError(f"page_table[{where[0]}, {where[1]}] = {int(pt[where])} is "
                         f"outside [0, {num_pages}) (a page the request uses)")


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, *, sm_scale,
               return_lse=False, variant=None, check_indices=False, out=None):
    """DeepSeek MLA decode over a paged cache; see the module docstring for the math and the
    precision contract.

    q_nope [B, H, 512] and q_pe [B, H, 64] (bf16 or fp16, 1 <= H <= 128); ckv_cache
    [P, page_size, 512] and kpe_cache [P, page_size, 64] in q's dtype; page_table
    [B, max_pages] int32 (any page order); seq_lens [B] int32. All on one CUDA device and
    contiguous. Returns out [B, H, 512] in q's dtype, and lse [B, H] fp32 (natural log) when
    return_lse. Runs asynchronously on the current stream, can be captured in a CUDA graph
    (after hmoe.prewarm or one eager call) and replayed with new seq_lens / page_table values.

    Index safety: the kernel never reads outside the cache; seq_lens are clamped to
    [0, max_pages * page_size] and page ids outside [0, P) read as zeros. Checking them costs
    a device synchronisation, so it happens only with check_indices=True (or
    HMOE_CHECK_INDICES=1), which raises ValueError for a bad entry.
    `variant` (or HMOE_CUDA_VARIANT) forces a variant; see hmoe.compat for what is available.
    `out` (optional) receives the result: [B, H, 512], q's dtype and device, contiguous.
    """
    torch = V.torch_module()
    sm_scale = _validate(torch, q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale)
    B, H, _ = q_nope.shape
    P, page_size, _ = ckv_cache.shape
    max_pages = page_table.shape[1]
    dev = q_nope.device
    if out is None:
        out = torch.empty((B, H, D_CKV), dtype=q_nope.dtype, device=dev)
    else:
        V.tensor("out", out, ndim=3, dtypes=(q_nope.dtype,), device="cuda")
        if tuple(out.shape) != (B, H, D_CKV) or out.device != dev or out.data_ptr() % 16:
            raise ValueError(f"out must be a 16-byte aligned [{B}, {H}, {D_CKV}] tensor on {dev}")
        V.disjoint("out", out, {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache,
                                "kpe_cache": kpe_cache, "page_table": page_table, "seq_lens": seq_lens})
    lse = torch.empty((B, H), dtype=torch.float32, device=dev) if return_lse else None
    if B == 0:
        return (out, lse) if return_lse else out
    if check_indices or os.environ.get("HMOE_CHECK_INDICES") == "1":
        validate_indices(page_table, seq_lens, page_size, P)
    index = _cuda.device_index(torch, dev)
    sel = _cuda.select("mla_decode", index, variant)
    if sel.variant.startswith("flashinfer"):
        return mla_flashinfer.run(sel.variant, q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens,
                                  sm_scale=sm_scale, return_lse=return_lse, out=out)
    mod = _cuda.module(torch, index, "mla_decode", sel=sel)
    splits = plan(mod, index, B, H, max_pages, page_size)[0]
    part_o = part_lse = None
    if splits > 1:
        part_o = torch.empty((splits, B, H, D_CKV), dtype=torch.float32, device=dev)
        part_lse = torch.empty((splits, B, H), dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream(index).cuda_stream
    mod.mla_decode(q_nope.data_ptr(), q_pe.data_ptr(), ckv_cache.data_ptr(), kpe_cache.data_ptr(),
                   page_table.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
                   0 if lse is None else lse.data_ptr(), 0 if part_o is None else part_o.data_ptr(),
                   0 if part_lse is None else part_lse.data_ptr(), B, H, page_size, max_pages, P,
                   splits, _dtypes.code(q_nope.dtype), float(sm_scale), index, stream)
    return (out, lse) if return_lse else out
