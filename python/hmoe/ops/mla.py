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

import collections
import threading

from .. import _dtypes, _env, validation as V
from . import _cuda, _pages, mla_flashinfer  # importing mla_flashinfer registers "flashinfer-fa2"/"-fa3"

D_CKV, D_PE = 512, 64
MAX_HEADS = 128
MAX_BATCH = 65535  # the CUDA grid's z dimension
LOADERS = ("cp.async rows", "cp.async", "tma")  # MlaLoader in cuda/mla/mla_params.h

_lock = threading.Lock()
_plans: dict = {}


class MlaPlan(collections.namedtuple(
        "MlaPlan", "num_splits config loader heads_per_cta tile_tokens smem_bytes")):
    """How mla_decode runs one shape (MlaDecodePlan in cuda/mla/mla_params.h): KV splits, the tile
    configuration (heads per CTA, KV tokens per tile, shared memory) and the loader."""

    @property
    def loader_name(self) -> str:
        return LOADERS[self.loader]

    def describe(self) -> str:
        return (f"{self.num_splits} KV split(s), {self.heads_per_cta} heads x {self.tile_tokens} tokens per "
                f"CTA tile (configuration {self.config}, {self.smem_bytes} B shared memory), {self.loader_name} loader")


def plan(index: int, batch: int, heads: int, max_pages: int, page_size: int, *, config: int | None = None,
         tma: bool | None = None, variant: str | None = None) -> MlaPlan:
    """The plan mla_decode follows for this shape on cuda:<index>, computed once and cached. It
    depends on shapes only (never on seq_lens), so a captured graph replays with new lengths.
    Overrides for tests and tuning: `config` (an index into the kernel's configuration table;
    default $HMOE_MLA_CONFIG, else the best that fits) and `tma` (False keeps the cache loads on
    cp.async where the TMA would be used; default: False when $HMOE_MLA_TMA is "0")."""
    if config is None:
        env = _env.get("HMOE_MLA_CONFIG")
        try:
            config = -1 if env is None else int(env)
        except ValueError:
            raise ValueError(f"HMOE_MLA_CONFIG={env!r} is not a configuration index") from None
    if tma is None:
        tma = _env.get("HMOE_MLA_TMA") != "0"
    key = (index, batch, heads, max_pages, page_size, config, tma, variant)
    got = _plans.get(key)
    if got is None:
        torch = V.torch_module()
        mod = _cuda.module(torch, index, "mla_decode", variant)
        got = MlaPlan(*mod.mla_decode_plan(index, batch, heads, max_pages, page_size, config, bool(tma)))
        with _lock:
            _plans[key] = got
    return got


def _validate(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale) -> float:
    """Checks every argument (module docstring); returns sm_scale as a float."""
    dt = V.half_dtypes()
    V.tensor("q_nope", q_nope, ndim=3, dtypes=dt, device="cuda")
    index, dtype = q_nope.get_device(), q_nope.dtype
    for name, t, nd, dts in (("q_pe", q_pe, 3, dt), ("ckv_cache", ckv_cache, 3, dt),
                             ("kpe_cache", kpe_cache, 3, dt), ("page_table", page_table, 2, V.i32_dtype()),
                             ("seq_lens", seq_lens, 1, V.i32_dtype())):
        V.tensor(name, t, ndim=nd, dtypes=dts, device="cuda")
        if t.get_device() != index:
            raise ValueError(f"{name} is on {t.device}, q_nope on {q_nope.device}: all inputs must share a device")
    for name, t in (("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if t.dtype is not dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, q_nope {dtype}: they must match")
    B, H, d = q_nope.shape
    if d != D_CKV:
        raise ValueError(f"q_nope has shape {tuple(q_nope.shape)}: the last dimension must be {D_CKV}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q_nope has {H} heads; mla_decode supports 1 to {MAX_HEADS}")
    if q_pe.shape != (B, H, D_PE):
        raise ValueError(f"q_pe has shape {tuple(q_pe.shape)}, expected {(B, H, D_PE)}")
    P, page, d = ckv_cache.shape
    if d != D_CKV:
        raise ValueError(f"ckv_cache has shape {tuple(ckv_cache.shape)}: the last dimension must be {D_CKV}")
    if page < 1 or P < 1:
        raise ValueError(f"ckv_cache has shape {tuple(ckv_cache.shape)}: no pages")
    if P * page > V.INT32_MAX:  # the kernel indexes cache rows with int32 (2.4 TB of bf16 latents)
        raise ValueError(f"ckv_cache has {P * page} token rows; mla_decode supports fewer than 2^31")
    if kpe_cache.shape != (P, page, D_PE):
        raise ValueError(f"kpe_cache has shape {tuple(kpe_cache.shape)}, expected {(P, page, D_PE)}")
    b, max_pages = page_table.shape
    if b != B or max_pages < 1:
        raise ValueError(f"page_table has shape {tuple(page_table.shape)}, expected [{B}, max_pages >= 1]")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}, expected ({B},)")
    check_sizes(B, H, max_pages, page)
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
    sm_scale = _validate(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale)
    B, H, _ = q_nope.shape
    P, page_size, _ = ckv_cache.shape
    max_pages = page_table.shape[1]
    if out is None:
        out = torch.empty(B, H, D_CKV, dtype=q_nope.dtype, device=q_nope.device)
    else:
        V.tensor("out", out, ndim=3, dtypes=(q_nope.dtype,), device="cuda")
        if out.shape != (B, H, D_CKV) or out.get_device() != q_nope.get_device() or out.data_ptr() % 16:
            raise ValueError(f"out must be a 16-byte aligned [{B}, {H}, {D_CKV}] tensor on {q_nope.device}")
        V.disjoint("out", out, {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache,
                                "kpe_cache": kpe_cache, "page_table": page_table, "seq_lens": seq_lens})
    lse = torch.empty(B, H, dtype=torch.float32, device=q_nope.device) if return_lse else None
    if B == 0:
        return (out, lse) if return_lse else out
    if check_indices or _env.get("HMOE_CHECK_INDICES") == "1":
        validate_indices(page_table, seq_lens, page_size, P)
    index = q_nope.get_device()
    sel = _cuda.select("mla_decode", index, variant)
    if not sel.module:  # a flashinfer backend
        return mla_flashinfer.run(sel.variant, q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens,
                                  sm_scale=sm_scale, return_lse=return_lse, out=out)
    mod = _cuda.module(torch, index, "mla_decode", sel=sel)
    pl = plan(index, B, H, max_pages, page_size, variant=variant)
    part_o = part_lse = 0
    if pl.num_splits > 1:  # one buffer for the fp32 partials: [splits, B, H, 512] then [splits, B, H]
        n = pl.num_splits * B * H
        work = torch.empty(n * (D_CKV + 1), dtype=torch.float32, device=q_nope.device)
        part_o = work.data_ptr()
        part_lse = part_o + 4 * n * D_CKV
    mod.mla_decode(q_nope.data_ptr(), q_pe.data_ptr(), ckv_cache.data_ptr(), kpe_cache.data_ptr(),
                   page_table.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
                   0 if lse is None else lse.data_ptr(), part_o, part_lse, B, H, page_size, max_pages, P,
                   pl.num_splits, pl.config, pl.loader, _dtypes.code(q_nope.dtype), sm_scale, index,
                   _cuda.stream_handle(torch, index))
    return (out, lse) if return_lse else out
