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

hmoe.ops.mla_rope_append prepares a decode step's inputs of that cache in one kernel: the rotary
embedding of the query's rope part, and the step's latent (RMSNorm) and roped key appended to the pages.
"""
from __future__ import annotations

import collections
import dataclasses

from .. import _env, _native, backends, dispatch, validation as V
from .._native import spec
from . import _cuda, _pages

_C = spec.constants()
D_CKV, D_PE = _C["mla_dim_ckv"], _C["mla_dim_pe"]
MAX_HEADS, MAX_BATCH = _C["mla_max_heads"], _C["mla_max_batch"]
LOADERS = {_C["mla_loader_rows"]: "cp.async rows", _C["mla_loader_contig"]: "cp.async", _C["mla_loader_tma"]: "tma"}
FALLBACK = "portable"  # the family that serves every shape: it runs what another family declines
ROPE_LAYOUTS = ("interleaved", "half", "interleaved_to_half")  # mla_rope_append's rope_layout
_routes: dict = {}
_said: set = set()  # (device, family, why): the fallbacks logged
# Entries kept at most in _routes and _calls: both are keyed by the batch and the page table's width,
# which a server's calls vary without end; a full dict starts over (a call then takes the whole path).
CACHE_ENTRIES = 4096
# What an mla_decode call decides before the launch (the route, the module, the plan's overrides), per
# (q_nope's type and device, batch, heads, the page table's width, page size, variant= and the
# environment variables those read):
# (module, config, tma). Filled by a call that took the whole path and runs hmoe's own kernel; a
# call whose key is here goes straight to the module, whose entry point checks every argument.
_calls: dict = {}
_call_env = _env.reader("HMOE_CUDA_VARIANT", "HMOE_CHECK_INDICES", "HMOE_MLA_CONFIG", "HMOE_MLA_TMA")


class MlaPlan(collections.namedtuple(
        "MlaPlan", "num_splits config loader heads_per_cta tile_tokens smem_bytes cluster")):
    """How mla_decode runs one shape (MlaDecodePlan in include/hmoe/mla_decode.h): KV splits and
    where they merge (cluster 1: the combine pass; cluster = num_splits: in the kernel, the splits
    of a head group being one thread-block cluster), the tile configuration (heads per CTA, KV
    tokens per tile, shared memory) and the loader."""

    @property
    def loader_name(self) -> str:
        return LOADERS[self.loader]

    def describe(self) -> str:
        merge = ("" if self.num_splits == 1 else f" merged in {self.cluster}-CTA clusters" if self.cluster > 1
                 else " merged by the combine pass")
        return (f"{self.num_splits} KV split(s){merge}, {self.heads_per_cta} heads x {self.tile_tokens} tokens per "
                f"CTA tile (configuration {self.config}, {self.smem_bytes} B shared memory), {self.loader_name} loader")


def _overrides(config: int | None, tma: bool | None) -> tuple[int, bool]:
    """The plan's tuning knobs: arguments, else $HMOE_MLA_CONFIG (an index into the kernel's
    configuration table; -1: the best that fits) and $HMOE_MLA_TMA ("0": cp.async loads)."""
    if config is None:
        env = _env.get("HMOE_MLA_CONFIG")
        try:
            config = -1 if env is None else int(env)
        except ValueError:
            raise ValueError(f"HMOE_MLA_CONFIG={env!r} is not a configuration index") from None
    if tma is None:
        tma = _env.get("HMOE_MLA_TMA") != "0"
    return config, bool(tma)


def declines(sel: dispatch.Selection, sms: int, batch: int, heads: int, max_pages: int, page_size: int) -> str:
    """Why the family of `sel` does not serve mla_decode calls of this shape on a device of `sms` SMs
    (its module's mla_decode_declines: the sm90a family leaves page sizes its tiles do not fit, and
    calls of 16 heads or fewer where the portable kernel is faster, to the portable one), "" when it
    serves them; "" for an optional backend. max_pages: the page table's width."""
    if sel.backend:
        return ""
    return _native.load(sel.module).mla_decode_declines(sms, batch, heads, max_pages, page_size)


def shape_text(batch: int, heads: int, max_pages: int, page_size: int) -> str:
    """A call's shape as route() decides by it, in words."""
    return f"{batch} requests of up to {max_pages * page_size} tokens, {heads} heads, page size {page_size}"


def declined_reason(family: str, shape: str, why: str) -> str:
    """The reason a shape (shape_text) that `family` declines runs on FALLBACK (hmoe.compat prints it too)."""
    return f"fallback: {family} declines {shape}: {why}"


def forced_declined(variant: str, source: str, shape: str, device: str, why: str) -> str:
    """What forcing (`source`: "variant=" or "HMOE_CUDA_VARIANT=") a family on a shape it declines is."""
    return (f"mla_decode: {source}{variant!r} does not serve {shape} on {device}: {why}; the {FALLBACK!r} "
            "variant serves this shape (force it, or leave the choice to hmoe)")


def route(device, batch: int, heads: int, max_pages: int, page_size: int, variant: str | None = None, *,
          own: bool = False) -> dispatch.Selection:
    """Which variant runs mla_decode calls of `batch` requests, `heads` heads and a page table of
    `max_pages` pages of `page_size` tokens a request on `device` (the CUDA ordinal, "cuda:N" or a
    torch.device): the device's selection (_cuda.select: forced by `variant` or HMOE_CUDA_VARIANT;
    own=True ignores the latter), unless its family declines the shape: then FALLBACK, with a reason
    that says why (logged once per reason). Forcing a family that declines the shape is a ValueError.
    Shapes only (never seq_lens), as plan(): decided once per (device, shape, variant,
    HMOE_CUDA_VARIANT) and cached: a call pays a dict lookup."""
    index = _cuda.ordinal(device)
    key = (index, batch, heads, max_pages, page_size, variant, None if own else _env.get("HMOE_CUDA_VARIANT"))
    sel = _routes.get(key)
    if sel is None:
        sel = _cuda.select("mla_decode", index, variant, own=own)
        why = declines(sel, _cuda.sm_count(index), batch, heads, max_pages, page_size)
        if why:
            shape = shape_text(batch, heads, max_pages, page_size)
            if sel.variant == (variant or key[-1]):
                raise ValueError(forced_declined(sel.variant, "variant=" if variant else "HMOE_CUDA_VARIANT=", shape,
                                                 sel.device, why))
            family = sel.variant
            sel = dataclasses.replace(_cuda.select("mla_decode", index, FALLBACK, own=True),
                                      reason=declined_reason(family, shape, why))
            if (index, family, why) not in _said:
                dispatch.log.info("hmoe: mla_decode on %s: %s", sel.device, sel.reason)
                _said.add((index, family, why))
        with _cuda._lock:
            if len(_routes) >= CACHE_ENTRIES:
                _routes.clear()
            _routes[key] = sel
    return sel


def family_modules(index: int) -> list:
    """The modules cuda:<index>'s mla_decode calls may run on: hmoe's selected family's and FALLBACK's
    (the route depends on the shape). Cached selections: dict lookups."""
    mods = []
    for variant in (None, FALLBACK):
        try:
            mods.append(_cuda.select("mla_decode", index, variant, own=True).module)
        except ValueError:  # the device runs no such family: its calls never route there
            pass
    return mods


def warm_families(index: int) -> None:
    """Prewarms family_modules at a call outside graph capture, as hmoe.prewarm does, so that a
    capture after one eager call finds the module of a shape routed to the other family ready."""
    mods = family_modules(index)
    if any((index, m) not in _cuda._warm for m in mods) and not _cuda.capturing(V.torch_module(), index):
        for m in mods:
            _cuda.prewarm(index, m)


def plan(device, batch: int, heads: int, max_pages: int, page_size: int, *, config: int | None = None,
         tma: bool | None = None, variant: str | None = None) -> MlaPlan:
    """The plan mla_decode follows for this shape on `device` (the CUDA ordinal, "cuda:N" or a
    torch.device): computed once per shape by the module of the variant that runs it (route()) and
    cached there. It depends on shapes only (never on seq_lens), so a captured graph replays with new
    lengths. `config` and `tma` override it for tests and tuning (default: $HMOE_MLA_CONFIG,
    $HMOE_MLA_TMA; see _overrides). Where HMOE_CUDA_VARIANT names an optional backend, the plan is
    that of hmoe's own choice."""
    config, tma = _overrides(config, tma)
    index = _cuda.ordinal(device)
    sel = route(index, batch, heads, max_pages, page_size, variant)
    if sel.backend:
        if variant:
            raise ValueError(f"mla_decode variant {sel.variant} is not hmoe's: it has no hmoe plan")
        sel = route(index, batch, heads, max_pages, page_size, own=True)
    mod = _cuda.module(index, "mla_decode", sel=sel)
    return MlaPlan(*mod.mla_decode_plan(index, batch, heads, max_pages, page_size, config, tma))


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
    `variant` (or HMOE_CUDA_VARIANT) forces a variant; see hmoe.compat for what is available. A
    variant whose family declines the shape (sm90a: some page sizes, and some calls of 16 heads or
    fewer) leaves the call to the portable one when it was hmoe's choice, and is a ValueError when
    forced; see route().
    `out` (optional) receives the result: [B, H, 512], q's dtype and device, contiguous.
    """
    try:
        key = (type(q_nope), q_nope.get_device(), *q_nope.shape[:2], page_table.shape[1], ckv_cache.shape[1], variant,
               _call_env())
        known = None if check_indices else _calls.get(key)
    except Exception:  # not tensors of the op's shapes (or unhashable): the whole path says what is wrong
        key = known = None
    if known is not None:
        mod, config, tma = known
        return mod.mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, out, return_lse,
                              config, tma)
    index = _cuda.cuda_index(q_nope)
    if index < 0:  # not a plain CUDA tensor: say what is wrong with it
        V.tensor("q_nope", q_nope, ndim=3, dtypes=V.half_dtypes(), device="cuda")
        raise AssertionError("unreachable: q_nope passed the checks of a CUDA tensor")
    try:
        batch, heads, max_pages, page_size = (int(q_nope.shape[0]), int(q_nope.shape[1]), int(page_table.shape[1]),
                                              int(ckv_cache.shape[1]))  # what route() decides by
    except (AttributeError, IndexError, TypeError, ValueError):
        heads = None
    if heads is None:  # not shaped like the op's tensors: hmoe's module says what is wrong
        mod = _cuda.module(index, "mla_decode", sel=_cuda.select("mla_decode", index, own=True))
        mod.mla_decode_check(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, out)
        raise AssertionError("unreachable: the arguments passed the checks of mla_decode")
    try:
        sel = route(index, batch, heads, max_pages, page_size, variant)
    except ValueError:  # a forced family declines the shape: unless the arguments are what is wrong
        mod = _cuda.module(index, "mla_decode", sel=_cuda.select("mla_decode", index, own=True))
        mod.mla_decode_check(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, out)
        raise
    fi = sel.backend  # an optional backend (flashinfer); hmoe's own module still checks the arguments
    warm_families(index)
    mod = _cuda.module(index, "mla_decode", sel=_cuda.select("mla_decode", index, own=True) if fi else sel)
    check_indices = check_indices or _env.get("HMOE_CHECK_INDICES") == "1"
    if fi or check_indices:
        mod.mla_decode_check(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, out)
        if check_indices:
            validate_indices(page_table, seq_lens, page_size, ckv_cache.shape[0])
        if fi:
            return backends.run(sel.variant, "mla_decode", q_nope, q_pe, ckv_cache, kpe_cache, page_table,
                                seq_lens, sm_scale=float(sm_scale), return_lse=return_lse, out=out)
    config, tma = _overrides(None, None)
    result = mod.mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, out, return_lse,
                            config, tma)
    if key is not None and not check_indices:  # the same key takes the same path: remember where it led
        if len(_calls) >= CACHE_ENTRIES:
            _calls.clear()
        _calls[key] = (mod, config, tma)
    return result


def mla_rope_append(q, kv, norm_weight, cos, sin, ckv_cache, kpe_cache, page_table, seq_lens, *, eps, rope_layout):
    """One MLA decode step's inputs in one kernel: returns q_pe [B, H, 64], the rotary embedding of
    q's rope part, and appends the step's token to the paged cache mla_decode reads.

    q [B, H, nope + 64] (the query projection per head: nope dims, then the rope part), kv [B, 512 + 64]
    (the compressed latent, then k_pe), norm_weight [512], all bf16 or fp16 alike; cos and sin [1, 64] or
    [B, 64] (float32, float16 or bfloat16, both alike), the factor of each output position;
    ckv_cache, kpe_cache, page_table and seq_lens as mla_decode takes them (seq_lens[b] counts this
    step's token). All on one CUDA device and contiguous. Runs asynchronously on the current stream and
    can be captured in a CUDA graph (after hmoe.prewarm or one eager call).

    rope_layout (ROPE_LAYOUTS) says where a rotary pair (a, b) of the input lies and where it goes:
    "interleaved" a = 2i, b = 2i + 1, written there (DeepSeek-V2's complex rotation); "half" a = i,
    b = i + 32, written there (rotate_half); "interleaved_to_half" a = 2i, b = 2i + 1, written to
    i and i + 32 (DeepSeek-V3 with rope_interleave). out[o1] = x[a] cos[o1] - x[b] sin[o1] and
    out[o2] = x[b] cos[o2] + x[a] sin[o2].

    Precision contract: fp32 math. The rope outputs are rounded once to q's dtype. The latent is
    transformers' DeepSeek RMSNorm: latent * rsqrt(mean(latent^2) + eps) with an fp32 mean, rounded to
    the dtype, times norm_weight, rounded again. Written at token L - 1 (L = seq_lens[b]) of request b:
    row (L - 1) % page_size of page page_table[b, (L - 1) // page_size] of ckv_cache (the latent) and
    kpe_cache (k_pe). Index safety as mla_decode's: nothing is written for a request with L < 1,
    L > max_pages * page_size, or a page id outside [0, P) (the kernel never writes outside the cache).
    """
    index = _cuda.cuda_index(q)
    if index < 0:  # not a plain CUDA tensor: say what is wrong with it
        V.tensor("q", q, ndim=3, dtypes=V.half_dtypes(), device="cuda")
        raise AssertionError("unreachable: q passed the checks of a CUDA tensor")
    return _cuda.module(index, "mla_rope_append").mla_rope_append(
        q, kv, norm_weight, cos, sin, ckv_cache, kpe_cache, page_table, seq_lens, eps, rope_layout)
