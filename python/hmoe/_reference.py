"""What every op is held to, in one place: its math in fp64 (no TF32, no intermediate rounding)
and one tolerance rule per op, derived from the dtype's unit roundoff and the points where the
op's precision contract rounds. The self-test, the benchmarks, the flashinfer backend's
self-check and the tests all use these."""
from __future__ import annotations

import math

# Unit roundoff u (half the spacing of numbers just above 1): a rounding to nearest of x errs by at
# most u * |x|.
_U = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def unit_roundoff(dtype) -> float:
    """u of a torch dtype or its name ("bfloat16")."""
    return _U[_name(dtype)]


# Normwise relative tolerance against the fp64 reference = rounding points x u(dtype):
#   mla_decode: P rounded to the input dtype before P V, the output rounded once, and the fp32
#   accumulation and softmax (below u of either 16-bit type): 3 u. Measured on random inputs the
#   error is about 0.5 u, so 3 u leaves room for long sequences without hiding a wrong kernel.
#   grouped_topk: the weights go through the scoring function (exp and a sum over E for softmax),
#   the renormalising sum and division and the scaling, each a few roundings of fp32: 16 u.
#   hybrid_model_logits: a small model (2-4 MoE layers) patched with hmoe.nn against the original
#   model in the same dtype: transformers rounds every expert's intermediate to the dtype, hmoe its
#   routed sum only; the differences pass through attention and the head (measured about 2 u on
#   DeepSeek-V2/V3 configurations with 2 MoE layers): 8 u.
#   prefill (ragged_prefill, paged_prefill): the same rounding points as mla_decode against the fp64
#   reference: 3 u. prefill_same_rounding: against prefill_rounded_p, which rounds P where the kernel
#   does (its tiles, its lazy running max): the output's rounding (1) and 1 for the P values that
#   land on the other side of a rounding boundary because the kernel's fp32 scores and exponentials
#   (another summation order, ex2.approx) differ from the reference's in their last bits.
#   absorbed_mla_logits: a small DeepSeek model decoding with hmoe's absorbed MLA attention
#   (GraphDecoder(attention="hmoe")) against the model's own attention in the same dtype: the absorbed
#   form rounds q_abs, the attention output and its W_UV product where transformers rounds the
#   expanded keys and values and the attention output; those differences pass through every layer
#   and the head, as the patched model's do: 8 u.
#   mla_rope_append: the rope outputs are rounded once (u); the latent's RMSNorm rounds its normalised
#   value and its product with the weight (2 u). mla_rope_append_same_rounding: against the reference
#   that rounds there too, what is left is the value that lands on the other side of a rounding
#   boundary because the kernel's fp32 sum of squares differs from fp64 in its last bits: 1 u.
_ROUNDINGS = {"mla_decode": 3, "mla_rope_append": 2, "mla_rope_append_same_rounding": 1, "grouped_topk": 16,
              "hybrid_model_logits": 8, "absorbed_mla_logits": 8, "prefill": 3,
              "prefill_same_rounding": 2}
#   decode_linear: exact products summed in fp32 and one rounding to the output dtype: u for 16-bit
#   outputs, with room for the fp32 sums: 2 u. An fp32 output is the fp32 sum of K exact products (the
#   summation order's error, about sqrt(K) fp32 units, 3e-6 at K = 2048): _DECODE_LINEAR_FP32.
_ROUNDINGS["decode_linear"] = 2
#   rms_norm: the normalised row rounded, then its product with the weight (transformers' rounding
#   points): 2 u against fp64 without rounding; against the reference that rounds there too, the value
#   that lands on the other side of a boundary because the fp32 sum of squares differs from fp64: 1 u.
_ROUNDINGS["rms_norm"] = 2
_ROUNDINGS["rms_norm_same_rounding"] = 1
_DECODE_LINEAR_FP32 = 1e-5
#   hybrid_gpu_experts: hmoe.nn.HybridMoE's GPU-resident experts (torch matmuls in x's dtype) against the
#   fp64 routed sum over those experts: gate and up rounded (1), silu(gate) (1), h = silu(gate) * up
#   (1), h times its routing weight (1), the output (1); the matmuls' fp32 sums stay below u of either
#   16-bit type: 5 u. Measured about 1.1 u, at most 1.4 u, in fp16 and bf16 (100 random problems of the
#   test's size on the CPU). An fp32 x adds the error of the fp32 sums over H and G * I products
#   themselves, which grows with their length (about sqrt(n) fp32 units, as decode_linear's: 9e-6 at
#   G * I = 16 * 1408; measured 4.6e-7 at H = 2048, I = 1408, G = 3 on the CPU): 1e-5.
_ROUNDINGS["hybrid_gpu_experts"] = 5
_HYBRID_GPU_FP32 = 1e-5
# lse is computed in fp32 from exact products: an absolute bound (a base-2 lse read as natural is
# off by 30%, and lse here is 3 or more).
MLA_LSE_ATOL = 1e-2
# prefill's lse: fp32 scores of up to 192 exact products and an fp32 sum of up to ~10^5 terms
# (about 1e-5 here); a base-2 lse read as natural, or one of the wrong rows, is off by far more.
PREFILL_LSE_ATOL = 1e-3


#   moe_experts: the output rounded once to x's dtype plus fp32 accumulation over H and I (fp32: 2e-5,
#   fp16: 3 u, bf16: 2 u); bf16 weights add the bf16 rounding of the activations entering each matmul
#   (the contract). Against the reference that rounds there too (contract=True) that costs nothing
#   but the rare activation that lands on the other side of a bf16 rounding boundary (the kernel's h
#   is fp32, the reference's fp64): one such flip moves one activation by a bf16 step, up to 5.6e-4
#   of the output in the tests' small problems (48,000 random fp32-x problems on avx2: 45 above
#   2.2e-4, none above 6e-4), so 8e-4; a kernel that skips the rounding is off by 1.5e-3 or more
#   there (fp32 x). Against the reference that does not round (contract=False): about 3 u(bf16),
#   1.2e-2.
_EXPERTS_OUT = {"float32": 2e-5, "float16": 1.5e-3, "bfloat16": 8e-3}
#   moe_experts_vs_torch_loop: hmoe's experts against the torch per-expert loop (the benchmark's
#   check): the loop rounds every intermediate to the weights' dtype, so the two agree to a few units
#   of the coarser of x's and the weights' dtypes.
_EXPERTS_TORCH_LOOP = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
#   quantised weights (w_dtype "int8", "int4", "fp8"): against the reference that rounds where the
#   contract does (contract=True), the fp32 accumulation over groups and the rare activation that
#   lands on the other side of a rounding boundary by an ulp (h is fp32 in the kernel, fp64 rounded
#   to fp32 in the reference): fp8 as bf16 (8e-4); int8/int4 2e-3, for a flip there moves one
#   activation by a whole int8 step of its group (1/127 of the group's largest value), about
#   3e-4 of the output for one flip in 10^5 activations, which random tests see.
#   Against fp64 on the dequantised weights (contract=False): fp8 as bf16 (3 u(bf16)); int8 and int4
#   the int8 activations, quantised per group of k to a step of max|a| / 127, whose error (half a
#   step, u_i8 = 2^-8 of the group's largest value) enters x's two products and h's one; measured
#   about 4 u_i8 on Gaussian data (h has heavier tails than x): 8 u_i8.
_U_I8 = 2.0 ** -8


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tolerance(op: str, dtype, *, w_dtype=None, contract: bool = True) -> float:
    """The normwise relative error op's output may have in `dtype` against its fp64 reference
    (moe_experts: dtype is x's, w_dtype the weights' dtype or quantised format name ("int8", "int4",
    "fp8"); contract says whether the reference rounds where hmoe's precision contract does)."""
    if op == "moe_experts":
        tol = _EXPERTS_OUT[_name(dtype)]
        w = _name(w_dtype)
        if w in ("int8", "int4") and contract:
            tol += 2e-3
        elif w in ("bfloat16", "fp8"):
            tol += 8e-4 if contract else 1.2e-2
        elif w in ("int8", "int4"):
            tol += 8 * _U_I8
        return tol
    if op == "decode_linear" and _name(dtype) == "float32":
        return _DECODE_LINEAR_FP32
    if op == "hybrid_gpu_experts" and _name(dtype) == "float32":
        return _HYBRID_GPU_FP32
    if op == "moe_experts_vs_torch_loop":
        return max(_EXPERTS_TORCH_LOOP[_name(dtype)], _EXPERTS_TORCH_LOOP[_name(w_dtype)])
    return _ROUNDINGS[op] * unit_roundoff(dtype)


def mla_decode(q_nope, q_pe, ckv, kpe, page_table, seq_lens, sm_scale):
    """(out fp32 [B, H, 512], lse fp32 [B, H], natural log) from the gathered pages, in fp64: the
    math of hmoe.ops.mla_decode's docstring, for small problems."""
    import torch

    d_ckv, d_pe = ckv.shape[-1], kpe.shape[-1]
    (B, H, _), page, dev = q_nope.shape, ckv.shape[1], q_nope.device
    out = torch.zeros(B, H, d_ckv, dtype=torch.float64, device=dev)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64, device=dev)
    for b, L in enumerate(seq_lens.tolist()):
        if L > 0:
            pages = page_table[b, : (L + page - 1) // page].long()
            kv, pe = ckv[pages].reshape(-1, d_ckv)[:L].double(), kpe[pages].reshape(-1, d_pe)[:L].double()
            s = (q_nope[b].double() @ kv.T + q_pe[b].double() @ pe.T) * sm_scale
            lse[b], out[b] = torch.logsumexp(s, -1), torch.softmax(s, -1) @ kv
    return out.float(), lse.float()


def rope_pairs(rope_layout: str, dim: int = 64):
    """(a, b, o1, o2): the input and output positions of the rotary pairs of hmoe.ops.mla_rope_append's
    rope_layout, as index lists of length dim / 2."""
    half, i = dim // 2, list(range(dim // 2))
    if rope_layout not in ("interleaved", "half", "interleaved_to_half"):
        raise ValueError(f"rope_layout must be 'interleaved', 'half' or 'interleaved_to_half', got {rope_layout!r}")
    a, b = ([2 * j for j in i], [2 * j + 1 for j in i]) if rope_layout != "half" else (i, [j + half for j in i])
    o1, o2 = (a, b) if rope_layout == "interleaved" else (i, [j + half for j in i])
    return a, b, o1, o2


def mla_rope_append(q, kv, norm_weight, cos, sin, eps: float, rope_layout: str, *, compute=None,
                    contract: bool = True):
    """(q_pe [B, H, 64], latent [B, 512], k_pe [B, 64]): what hmoe.ops.mla_rope_append computes and
    appends, in `compute` precision (default fp64). contract=True rounds to q's dtype where the op's
    precision contract does (and returns q's dtype); False rounds nowhere (returns `compute`)."""
    import torch

    compute = compute or torch.float64
    rnd = (lambda t: t.to(q.dtype).to(compute)) if contract else (lambda t: t)
    d = cos.shape[-1]
    a, b, o1, o2 = rope_pairs(rope_layout, d)
    c, s_ = cos.to(compute), sin.to(compute)

    def rope(x):  # x [..., d] in compute; cos/sin rows broadcast over the dims between
        shape = (c.shape[0],) + (1,) * (x.dim() - 2) + (d,)
        cc, ss = c.reshape(shape), s_.reshape(shape)
        out = torch.empty_like(x)
        out[..., o1] = x[..., a] * cc[..., o1] - x[..., b] * ss[..., o1]
        out[..., o2] = x[..., b] * cc[..., o2] + x[..., a] * ss[..., o2]
        return rnd(out)

    R = norm_weight.shape[0]
    latent = kv[:, :R].to(compute)
    n = rnd(latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps))
    out = (rope(q[..., q.shape[-1] - d:].to(compute)), rnd(norm_weight.to(compute) * n), rope(kv[:, R:].to(compute)))
    return tuple(t.to(q.dtype) for t in out) if contract else out


def rms_norm(x, weight, eps: float, *, contract: bool = True):
    """hmoe.ops.rms_norm in fp64: weight * (x * rsqrt(mean(x^2) + eps)), rounded to x's dtype where its
    contract (transformers' RMSNorm) rounds when contract=True (returned in x's dtype), nowhere otherwise
    (returned in fp64)."""
    import torch

    v = x.double()
    n = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    if not contract:
        return weight.double() * n
    return (weight.double() * n.to(x.dtype).double()).to(x.dtype)


def _quantise_act(v, group: int):
    """hmoe's int8 activation quantisation of fp32 rows v [..., K] per group (cpp/experts/act.h):
    (q [..., G, group] as fp64 integers, s fp32 [..., G]); K padded with zeros to G * group."""
    import torch

    K = v.shape[-1]
    G = -(-K // group)
    g = torch.nn.functional.pad(v.float(), (0, G * group - K)).reshape(*v.shape[:-1], G, group)
    s = g.abs().amax(-1) / 127
    s = torch.where(torch.isnan(g).any(-1), torch.nan, s)
    ok = (s > 0) & torch.isfinite(s)
    q = torch.round(g / torch.where(ok, s, 1.0).unsqueeze(-1)).clamp(-127, 127)
    return torch.where(ok.unsqueeze(-1), q, 0.0).double(), s


def _int_weights(qw):
    """int8/int4 QuantizedWeights [E, N, K] in the kernels' groups: (q fp64 [E, N, G, group], s fp32 [E, N, G])."""
    import torch

    from . import quant

    q = (quant._int4_values(qw.data) if qw.format == "int4" else qw.data).double()
    E, N, K = q.shape
    group = qw.kernel_group
    G = -(-K // group)
    q = torch.nn.functional.pad(q, (0, G * group - K)).reshape(E, N, G, group)
    s = qw.scales.float().expand(E, N, G) if qw.group_size is None else qw.scales.float()
    return q, s


def _int_matmul(v, w, group: int, e: int):
    """Rows v (fp32 [R, K]) times expert e of _int_weights w as hmoe's int8 kernels compute it: v
    quantised per group, exact integer dots, each group's dot times fp32(s_a * s_w), summed (fp64)."""
    import torch

    qa, sa = _quantise_act(v, group)  # [R, G, group], [R, G]
    qw, sw = w[0][e], w[1][e]  # [N, G, group], [N, G]
    dots = torch.einsum("rgk,ngk->rng", qa, qw)  # integers below 2^53: exact in any order
    return (dots * (sa.unsqueeze(1) * sw.unsqueeze(0)).double()).sum(-1)


def moe_experts(x, topk_ids, topk_weights, w13, w2, *, contract: bool = True):
    """fp64 [T, H]: the math of hmoe.ops.moe_experts_cpu's docstring, expert by expert, for small
    problems. w13/w2 are float tensors or hmoe.quant.QuantizedWeights. With contract=True the
    activations entering each matmul are rounded where hmoe's precision contract rounds them (bf16
    for bf16 and fp8 weights; int8 per group, with the kernels' scale products, for int8 and int4
    weights); otherwise nothing is rounded and quantised weights enter dequantised."""
    import torch
    import torch.nn.functional as F

    from . import quant

    T, H = x.shape
    quantised = isinstance(w13, quant.QuantizedWeights)
    fmt = w13.format if quantised else _name(w13.dtype)
    inter = w13.shape[1] // 2
    bf16_act = contract and fmt in ("bfloat16", "fp8")
    int_act = contract and fmt in ("int8", "int4")
    if int_act:
        W13, W2 = _int_weights(w13), _int_weights(w2)
    else:
        W13 = (quant.dequantize(w13) if quantised else w13).double()
        W2 = (quant.dequantize(w2) if quantised else w2).double()

    def matmul(v, w, qw, e):
        if int_act:
            return _int_matmul(v.float(), w, qw.kernel_group, e)
        return (v.to(torch.bfloat16).double() if bf16_act else v) @ w[e].T

    xd = x.double()
    out = torch.zeros(T, H, dtype=torch.float64)
    for e in torch.unique(topk_ids).tolist():
        if e == -1:  # empty slots add nothing
            continue
        t, k = torch.where(topk_ids == e)
        gu = matmul(xd[t], W13, w13, e)
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, t, topk_weights[t, k].double().unsqueeze(1) * matmul(h, W2, w2, e))
    return out


def _rank_desc(values, eligible=None):
    """Indices of the last dim by (eligible first, value descending, index ascending)."""
    import torch

    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    if eligible is not None:  # a second stable sort makes the key lexicographic
        elig = eligible.gather(-1, order).to(torch.int8)
        order = order.gather(-1, torch.sort(elig, dim=-1, descending=True, stable=True).indices)
    return order


def _gap(ranked, n: int, valid=None):
    """The gap between ranked[:, n-1] and ranked[:, n] relative to their size (scores are
    often << 1), where both are finite (and valid), else +inf."""
    import torch

    T, M = ranked.shape
    if n >= M:
        return torch.full((T,), float("inf"), dtype=ranked.dtype)
    a, b = ranked[:, n - 1], ranked[:, n]
    ok = torch.isfinite(a) & torch.isfinite(b)
    if valid is not None:
        ok &= valid[:, n]
    gap = (a - b) / (torch.maximum(a.abs(), b.abs()) + 0.01)
    return torch.where(ok, gap, torch.full_like(a, float("inf")))


def grouped_topk(logits, top_k, *, n_group=1, topk_group=1, scoring="softmax", bias=None, renormalize=True,
                 routed_scaling_factor=1.0, dtype=None):
    """hmoe.ops.grouped_topk in torch: same semantics, same rounding points, same tie and NaN rules
    (stable sorts give the lower index on ties), in `dtype` (default float32; float64 for the
    exact math). Returns (weights [T, K] in `dtype`, ids int64 [T, K], sel [T, E], margin [T]) with the K
    ids in the documented order. sel is the selection score used for ranking (NaN already
    -inf). margin is the smallest relative gap between the last value kept and the first one left out
    (experts, and groups when some are dropped) among finite values, +inf when none: a token
    whose margin is tiny but not 0 may legitimately route differently in another
    implementation (rounding), while exact ties are resolved identically (lower index)."""
    import torch

    x = logits.to(dtype or torch.float32)
    dtype = x.dtype
    T, E = x.shape
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=x.device)
    nan = torch.isnan(x)
    if scoring == "softmax":
        scores = torch.softmax(x.masked_fill(nan, float("-inf")), dim=-1)
        # No finite logit: softmax gives NaN where hmoe gives 0. +inf logits: softmax gives NaN
        # where hmoe takes its limit (the +inf experts share the row, the rest get 0).
        scores = torch.where(torch.isnan(scores), torch.zeros_like(scores), scores)
        pinf = x == float("inf")
        share = pinf.to(dtype) / pinf.sum(dim=-1, keepdim=True).clamp(min=1).to(dtype)
        scores = torch.where(pinf.any(dim=-1, keepdim=True), share, scores)
        sel = scores.masked_fill(nan, float("-inf"))
    else:
        scores = torch.sigmoid(x).masked_fill(nan, 0.0)
        sel = scores + bias.to(dtype) if bias is not None else scores.clone()
        sel = torch.where(nan | torch.isnan(sel), neg_inf, sel)

    S = E // n_group
    if topk_group < n_group:
        grouped = sel.view(T, n_group, S)
        if scoring == "softmax":
            gscore = grouped.max(dim=-1).values
        else:
            gscore = grouped.topk(2, dim=-1).values.sum(dim=-1)
            gscore = torch.where(torch.isnan(gscore), neg_inf, gscore)
        gorder = _rank_desc(gscore)
        margin = _gap(gscore.gather(1, gorder), topk_group)
        gmask = torch.zeros(T, n_group, dtype=torch.bool, device=x.device)
        gmask.scatter_(1, gorder[:, :topk_group], True)
        emask = gmask.repeat_interleave(S, dim=1)
        order = _rank_desc(sel, emask)
        margin = torch.minimum(margin, _gap(sel.gather(1, order), top_k, emask.gather(1, order)))
    else:
        order = _rank_desc(sel)
        margin = _gap(sel.gather(1, order), top_k)
    ids = order[:, :top_k]

    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights, ids, sel, margin


# --- prefill (ragged_prefill, paged_prefill) -----------------------------------------------------
def _visible(lq: int, lk: int, causal: bool, device):
    """[lq, lk] bool: the keys each query sees (causal: j <= i + lk - lq, aligned to the end)."""
    import torch

    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device)
    i = torch.arange(lq, device=device)[:, None]
    return torch.arange(lk, device=device)[None, :] <= i + (lk - lq)


def _requests(qo_indptr, kv_indptr):
    """(b, q0, q1, k0, k1) of every request with queries and keys."""
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    return [(b, qo[b], qo[b + 1], kv[b], kv[b + 1]) for b in range(len(qo) - 1)
            if qo[b + 1] > qo[b] and kv[b + 1] > kv[b]]


def prefill(q, k, v, qo_indptr, kv_indptr, sm_scale, causal=True, heads=None):
    """(out fp64 [Tq, len(heads), Dv], lse fp64 [Tq, len(heads)], natural log): the math of
    hmoe.ops.ragged_prefill's docstring in fp64, nothing rounded, request by request and head by head
    on the tensors' device (a GPU computes it in fp64 too). `heads`: the query heads to compute
    (default all). Rows that see no key: out 0, lse -inf."""
    import torch

    H, Hkv, Dv, dev = q.shape[1], k.shape[1], v.shape[2], q.device
    heads = list(range(H)) if heads is None else list(heads)
    out = torch.zeros(q.shape[0], len(heads), Dv, dtype=torch.float64, device=dev)
    lse = torch.full((q.shape[0], len(heads)), -math.inf, dtype=torch.float64, device=dev)
    for _, q0, q1, k0, k1 in _requests(qo_indptr, kv_indptr):
        seen = _visible(q1 - q0, k1 - k0, causal, dev)
        for i, h in enumerate(heads):
            kvh = h // (H // Hkv)
            s = (q[q0:q1, h].double() @ k[k0:k1, kvh].double().T) * sm_scale
            s = s.masked_fill(~seen, -math.inf)
            lse_h = torch.logsumexp(s, -1)
            p = torch.exp(s - lse_h[:, None].clamp_min(-1e300)).nan_to_num(0.0)  # rows that see nothing: 0
            out[q0:q1, i], lse[q0:q1, i] = p @ v[k0:k1, kvh].double(), lse_h
    return out, lse


def prefill_rounded_p(q, k, v, qo_indptr, kv_indptr, sm_scale, causal=True, *, tile_kv, heads=None):
    """(out fp32 before its final rounding, lse fp32): hmoe's prefill kernels' arithmetic, rounding P
    where they do (tile_kv: the plan's keys per step, hmoe.ops.prefill.plan). In fp32: the scores
    q.k times c = sm_scale * log2(e); per tile of tile_kv keys (from each request's first key) the
    running max m moves only when the tile's max exceeds it by more than 2^8 (0 while nothing was
    seen), p = 2^(s - m) is summed unrounded into l and rounded to q's dtype for P V, O (fp32) is
    rescaled by 2^(m_old - m_new) when m moves; out = O / l (0 where l = 0)."""
    import torch

    f32 = torch.float32
    H, Hkv, Dv, dev = q.shape[1], k.shape[1], v.shape[2], q.device
    heads = list(range(H)) if heads is None else list(heads)
    c = (torch.tensor(sm_scale, dtype=f32) * torch.tensor(1.4426950408889634, dtype=f32)).to(dev)
    out = torch.zeros(q.shape[0], len(heads), Dv, dtype=f32, device=dev)
    lse = torch.full((q.shape[0], len(heads)), -math.inf, dtype=f32, device=dev)
    for _, q0, q1, k0, k1 in _requests(qo_indptr, kv_indptr):
        lq = q1 - q0
        seen = _visible(lq, k1 - k0, causal, dev)
        for i, h in enumerate(heads):
            kvh = h // (H // Hkv)
            s = q[q0:q1, h].to(f32) @ k[k0:k1, kvh].to(f32).T
            m = torch.full((lq,), -math.inf, dtype=f32, device=dev)
            l = torch.zeros(lq, dtype=f32, device=dev)
            acc = torch.zeros(lq, Dv, dtype=f32, device=dev)
            for t0 in range(0, k1 - k0, tile_kv):
                x = torch.where(seen[:, t0:t0 + tile_kv], s[:, t0:t0 + tile_kv] * c, -math.inf)
                mx = x.max(-1).values
                m_new = torch.where(mx > m + 8, mx, torch.where(m == -math.inf, torch.zeros_like(m), m))
                alpha = torch.where(m == m_new, torch.ones_like(m),
                                    torch.where(m == -math.inf, torch.zeros_like(m), torch.exp2(m - m_new)))
                p = torch.exp2(x - m_new[:, None])
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[:, None] + p.to(q.dtype).to(f32) @ v[k0 + t0:min(k1, k0 + t0 + tile_kv), kvh].to(f32)
                m = m_new
            has = l > 0
            out[q0:q1, i] = torch.where(has[:, None], acc / l.clamp_min(1e-38)[:, None], torch.zeros_like(acc))
            lse[q0:q1, i] = torch.where(has, (m + torch.log2(l.clamp_min(1e-38))) * math.log(2.0),
                                        torch.full_like(m, -math.inf))
    return out, lse


def paged_as_ragged(k_cache, v_cache, page_table, kv_lens):
    """(k, v, kv_indptr): a paged cache's requests gathered into ragged k/v the prefill references
    take, under paged_prefill's rules: lengths clamped to [0, max_pages * page_size], page ids
    outside [0, P) read as zeros."""
    import torch

    P, page = k_cache.shape[0], k_cache.shape[1]
    lens = kv_lens.long().clamp(0, page_table.shape[1] * page).tolist()
    ks, vs, indptr = [], [], [0]
    for b, L in enumerate(lens):
        j = torch.arange(L, device=k_cache.device)
        ids = page_table[b].long()[j // page]
        ok = (ids >= 0) & (ids < P)
        rows = ids.clamp(0, P - 1) * page + j % page
        for cache, dst in ((k_cache, ks), (v_cache, vs)):
            flat = cache.reshape(P * page, *cache.shape[2:])[rows]
            dst.append(torch.where(ok[:, None, None], flat, torch.zeros_like(flat)))
        indptr.append(indptr[-1] + L)
    return torch.cat(ks), torch.cat(vs), torch.tensor(indptr, dtype=torch.int32)
