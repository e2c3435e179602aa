"""Pure-torch reference of hmoe.ops.grouped_topk: same semantics, same rounding points, same
tie and NaN rules (stable sorts give the lower index on ties), any compute dtype."""
from __future__ import annotations

import torch


def _rank_desc(values: torch.Tensor, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the last dim by (eligible first, value descending, index ascending)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    if eligible is not None:  # a second stable sort makes the key lexicographic
        elig = eligible.gather(-1, order).to(torch.int8)
        order = order.gather(-1, torch.sort(elig, dim=-1, descending=True, stable=True).indices)
    return order


def _gap(ranked: torch.Tensor, n: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The gap between ranked[:, n-1] and ranked[:, n] relative to their size (scores are
    often << 1), where both are finite (and valid), else +inf."""
    T, M = ranked.shape
    if n >= M:
        return torch.full((T,), float("inf"), dtype=ranked.dtype)
    a, b = ranked[:, n - 1], ranked[:, n]
    ok = torch.isfinite(a) & torch.isfinite(b)
    if valid is not None:
        ok &= valid[:, n]
    gap = (a - b) / (torch.maximum(a.abs(), b.abs()) + 0.01)
    return torch.where(ok, gap, torch.full_like(a, float("inf")))


def grouped_topk_reference(logits, top_k, *, n_group=1, topk_group=1, scoring="softmax",
                           bias=None, renormalize=True, routed_scaling_factor=1.0,
                           dtype=torch.float32):
    """Returns (weights [T, K] in `dtype`, ids int64 [T, K], sel [T, E], margin [T]) with the K
    ids in the documented order. sel is the selection score used for ranking (NaN already
    -inf). margin is the smallest relative gap between the last value kept and the first one left out
    (experts, and groups when some are dropped) among finite values, +inf when none: a token
    whose margin is tiny but not 0 may legitimately route differently in another
    implementation (rounding), while exact ties are resolved identically (lower index)."""
    x = logits.to(dtype)
    T, E = x.shape
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=x.device)
    nan = torch.isnan(x)
    if scoring == "softmax":
        scores = torch.softmax(x.masked_fill(nan, float("-inf")), dim=-1)
        # No finite logit (or +inf ones): softmax gives NaN where hmoe gives 0.
        scores = torch.where(torch.isnan(scores), torch.zeros_like(scores), scores)
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
