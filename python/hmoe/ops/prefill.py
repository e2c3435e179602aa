"""hmoe.ops.ragged_prefill and paged_prefill: batched causal (or full) attention over
variable-length, concatenated sequences, as a model's prefill runs it (DeepSeek MLA's prefill:
q/k head dim 192, v head dim 128).

For request b with lq queries (rows qo_indptr[b] .. qo_indptr[b+1] of q) and lk keys, query head h
and key/value head h // (H / Hkv) (grouped-query attention):
    s_ij = sm_scale * q_i . k_j               for the keys query i sees: every j < lk, or with
                                              causal=True j <= i + lk - lq (aligned to the end)
    out_i = sum_j softmax(s_i)_j * v_j        (Dv, q's dtype)
    lse_i = log(sum_j exp(s_ij))              (fp32, natural log; -inf for a query that sees no key)
A query that sees no key (lk = 0, or causal with i + lk - lq < 0) gets out = 0 and lse = -inf.

Precision contract: q, k and v are read exactly (bf16 or fp16); the Q K^T and P V products are exact
and accumulate in fp32; the scores and the softmax are fp32 (base 2: sm_scale * log2(e) is folded
into the scores, the running max moves lazily, by more than 2^8 only); the probabilities P are
rounded to q's dtype before P V (the tensor-core input format; the normaliser sums them unrounded,
in fp32); the output is rounded once to q's dtype. hmoe._reference.prefill is the same math in fp64,
hmoe._reference.prefill_rounded_p rounds where this contract does, and
hmoe._reference.tolerance("prefill", dtype) bounds the error.

Index arrays live on the GPU, so what their contents must satisfy is not checked by default
(checking reads them: a device synchronisation): qo_indptr (and kv_indptr) start at 0, never
decrease and end at the rows given; kv_lens lie in [0, max_pages * page_size]; the page-table
entries a request uses lie in [0, P); with causal=True no request has more queries than keys.
Whatever they hold, the kernels never read or write outside the tensors: entries are clamped into
range (a decreasing entry gives an empty request), page ids outside [0, P) read as zeros, and rows
beyond a request's keys are never read. check_indices=True (or HMOE_CHECK_INDICES=1) checks them and
raises ValueError naming the first bad entry. Everything else (dtypes, devices, shapes, head dims,
heads, alignment, out) is checked before any launch, without a synchronisation.
"""
from __future__ import annotations

import collections

from .. import _env, validation as V
from .._native import spec
from . import _cuda, _pages

_C = spec.constants()
# The (q/k, v) head dims the kernels are built for.
HEAD_DIMS = tuple((_C[f"prefill_dim_qk_{i}"], _C[f"prefill_dim_v_{i}"]) for i in range(3))


class PrefillPlan(collections.namedtuple(
        "PrefillPlan", "config tile_q tile_kv kv_stages max_items smem_bytes ctas_per_sm workspace")):
    """How a prefill call runs one shape (PrefillPlan in include/hmoe/prefill.h): the tile
    configuration (query rows and keys per step, K buffers, shared memory) and the work list's size
    (q tiles of all requests at most; the CTAs are max_items x heads)."""

    def describe(self) -> str:
        return (f"{self.tile_q} queries x {self.tile_kv} keys per step, {self.kv_stages} K buffer(s) "
                f"(configuration {self.config}, {self.smem_bytes} B shared memory, {self.ctas_per_sm} CTA/SM), "
                f"work list of {self.max_items} q tiles")


def _config(config: int | None) -> int:
    """The tile configuration: the argument, else $HMOE_PREFILL_CONFIG (an index into the kernel's
    table; -1: the best that fits)."""
    if config is not None:
        if not V.is_int(config):
            raise TypeError(f"prefill.plan: config must be an int (a configuration index; -1: the best that fits), "
                            f"got {config!r}")
        return int(config)
    env = _env.get("HMOE_PREFILL_CONFIG")
    try:
        return -1 if env is None else int(env)
    except ValueError:
        raise ValueError(f"HMOE_PREFILL_CONFIG={env!r} is not a configuration index") from None


def plan(device, total_q: int, batch: int, heads: int, kv_heads: int, head_dim_qk: int, head_dim_v: int, *,
         config: int | None = None, variant: str | None = None) -> PrefillPlan:
    """The plan ragged_prefill and paged_prefill follow for this shape on `device` (the CUDA ordinal,
    "cuda:N" or a torch.device; computed once per shape by the selected variant's module and cached
    there). It depends on shapes only, never on the index arrays, so a captured graph replays with new
    ones. `config` overrides it for tests and tuning (default: $HMOE_PREFILL_CONFIG)."""
    config = _config(config)  # before the device: a bad value is the same error everywhere
    index = _cuda.ordinal(device)
    sel = _cuda.select("ragged_prefill", index, variant)
    mod = _cuda.module(index, "ragged_prefill", sel=sel)
    return PrefillPlan(*mod.ragged_prefill_plan(index, total_q, batch, heads, kv_heads, head_dim_qk, head_dim_v,
                                                config))


def _indptr_problem(indptr, name: str, rows: int):
    """What is wrong with an indptr (host tensor) for `rows` rows, or None."""
    values = indptr.tolist()
    if values[0] != 0:
        return f"{name}[0] = {values[0]}: it must be 0"
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            return f"{name}[{b + 1}] = {values[b + 1]} is below {name}[{b}] = {values[b]}: it must not decrease"
    if values[-1] != rows:
        return f"{name}[{len(values) - 1}] = {values[-1]}, expected {rows} (the rows given)"
    return None


def _causal_problem(q_lens, kv_lens, causal: bool):
    if not causal:
        return None
    bad = (q_lens > kv_lens).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        return (f"request {b} has {int(q_lens[b])} queries and {int(kv_lens[b])} keys: causal attention aligned to "
                "the end needs at least as many keys as queries")
    return None


def validate_ragged(q, k, qo_indptr, kv_indptr, causal: bool) -> None:
    """Raises ValueError unless both indptr start at 0, never decrease and end at the rows of q and
    k, and (causal) no request has more queries than keys. Reads device memory: synchronises."""
    qo, kvp = qo_indptr.cpu(), kv_indptr.cpu()
    why = _indptr_problem(qo, "qo_indptr", q.shape[0]) or _indptr_problem(kvp, "kv_indptr", k.shape[0]) or \
        _causal_problem(qo[1:] - qo[:-1], kvp[1:] - kvp[:-1], causal)
    if why:
        raise ValueError(why)


def validate_paged(q, k_cache, page_table, kv_lens, qo_indptr, causal: bool) -> None:
    """Raises ValueError unless qo_indptr is valid for q's rows, 0 <= kv_lens[b] <= max_pages *
    page_size, every page-table entry a request uses lies in [0, P) and (causal) no request has more
    queries than keys. Reads device memory: synchronises."""
    torch = V.torch_module()
    qo, lens, pt = qo_indptr.cpu(), kv_lens.cpu(), page_table.cpu()
    P, page = k_cache.shape[0], k_cache.shape[1]
    cap = pt.shape[1] * page
    why = _indptr_problem(qo, "qo_indptr", q.shape[0])
    bad = ((lens < 0) | (lens > cap)).nonzero()
    if not why and bad.numel():
        b = int(bad[0, 0])
        why = f"kv_lens[{b}] = {int(lens[b])} is outside [0, {cap}] (max_pages {pt.shape[1]} x page size {page})"
    if not why:
        where = _pages.bad_entry(pt, _pages.used_pages(torch, pt, lens.to(torch.int64), page)[1], P)
        if where is not None:
            why = f"page_table[{where[0]}, {where[1]}] = {int(pt[where])} is outside [0, {P}) (a page the request uses)"
    why = why or _causal_problem(qo[1:] - qo[:-1], lens, causal)
    if why:
        raise ValueError(why)


def _module(q, op: str, variant):
    index = _cuda.cuda_index(q)
    if index < 0:  # not a plain CUDA tensor: say what is wrong with it
        V.tensor("q", q, ndim=3, dtypes=V.half_dtypes(), device="cuda")
        raise AssertionError("unreachable: q passed the checks of a CUDA tensor")
    return _cuda.module(index, op, sel=_cuda.select(op, index, variant))


def ragged_prefill(q, k, v, qo_indptr, kv_indptr, *, causal=True, sm_scale, return_lse=False, variant=None,
                   check_indices=False, out=None):
    """Prefill attention over ragged (concatenated) sequences; see the module docstring for the
    math, the precision contract and the index rules.

    q [total_q, H, Dqk], k [total_kv, Hkv, Dqk], v [total_kv, Hkv, Dv]: bf16 or fp16, one dtype,
    (Dqk, Dv) one of HEAD_DIMS ((192, 128), (128, 128), (64, 64)), H a multiple of Hkv;
    qo_indptr and kv_indptr int32 [B + 1] (request b: q rows qo_indptr[b] .. qo_indptr[b+1], k/v
    rows kv_indptr[b] .. kv_indptr[b+1]; empty requests allowed). All on one CUDA device and
    contiguous. Returns out [total_q, H, Dv] in q's dtype, and lse [total_q, H] fp32 (natural log)
    when return_lse. Runs asynchronously on the current stream; can be captured in a CUDA graph
    (after hmoe.prewarm or one eager call) and replayed with new index values of the same sizes.
    `check_indices` (or HMOE_CHECK_INDICES=1): check the index arrays' contents first (synchronises).
    `variant` (or HMOE_CUDA_VARIANT) forces a variant; `out` (optional) receives the result.
    """
    mod = _module(q, "ragged_prefill", variant)
    if check_indices or _env.get("HMOE_CHECK_INDICES") == "1":
        mod.ragged_prefill_check(q, k, v, qo_indptr, kv_indptr, sm_scale, causal, out)
        validate_ragged(q, k, qo_indptr, kv_indptr, causal)
    return mod.ragged_prefill(q, k, v, qo_indptr, kv_indptr, sm_scale, causal, out, return_lse, _config(None))


def paged_prefill(q, k_cache, v_cache, page_table, kv_lens, qo_indptr, *, causal=True, sm_scale, return_lse=False,
                  variant=None, check_indices=False, out=None):
    """Prefill attention of ragged queries over a paged KV cache (chunked prefill); see the module
    docstring for the math, the precision contract and the index rules.

    q [total_q, H, Dqk]; k_cache [P, page_size, Hkv, Dqk], v_cache [P, page_size, Hkv, Dv] in q's
    dtype; page_table [B, max_pages] int32 (request b's token j lives in page page_table[b, j //
    page_size], slot j % page_size; any page order); kv_lens [B] int32 (keys of request b, the
    queries' own included); qo_indptr [B + 1] int32. The same page walk and bounds rules as
    mla_decode: the cache is never read outside, lengths are clamped to max_pages * page_size and
    page ids outside [0, P) read as zeros. Returns, runs and checks as ragged_prefill does.
    """
    mod = _module(q, "paged_prefill", variant)
    if check_indices or _env.get("HMOE_CHECK_INDICES") == "1":
        mod.paged_prefill_check(q, k_cache, v_cache, page_table, kv_lens, qo_indptr, sm_scale, causal, out)
        validate_paged(q, k_cache, page_table, kv_lens, qo_indptr, causal)
    return mod.paged_prefill(q, k_cache, v_cache, page_table, kv_lens, qo_indptr, sm_scale, causal, out, return_lse,
                             _config(None))
