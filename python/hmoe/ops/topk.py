"""hmoe.ops.grouped_topk: DeepseekV2/V3 group-limited expert routing, validated here and run by
the C++ CPU variant (hmoe._native.cpu_core) or the CUDA kernel (hmoe._native.cuda_ops)."""
from __future__ import annotations

from .. import _dtypes, validation as V
from . import _cuda
from .._native import load
from .._native.signatures import CPU_CORE

__all__ = ["grouped_topk"]

# TopkScoring in cpp/topk/grouped_topk.h.
_SCORING_CODES = {"softmax": 0, "sigmoid": 1}
# kGroupedTopkMaxExperts in cpp/topk/grouped_topk.h: the same limit on every device.
MAX_EXPERTS = 4096


def _count(name: str, value) -> int:
    """An int argument of grouped_topk (bools and floats refused; ranges checked by the caller)."""
    return value if type(value) is int else V.int_arg(f"grouped_topk: {name}", value, hi=MAX_EXPERTS)


def _validate(router_logits, top_k, n_group, topk_group, scoring, bias, renormalize,
              routed_scaling_factor):
    """The checked (top_k, n_group, topk_group, scoring code, bias dtype code, scale)."""
    floats = V.float_dtypes()
    V.tensor("grouped_topk: router_logits", router_logits, ndim=2, dtypes=floats, device=("cpu", "cuda"))
    T, E = router_logits.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"grouped_topk: router_logits has {E} experts (dim 1); supported: "
                         f"1..{MAX_EXPERTS}")
    if T > V.INT32_MAX:
        raise ValueError(f"grouped_topk: router_logits has {T} tokens; supported: up to {V.INT32_MAX}")
    scoring_code = _SCORING_CODES.get(scoring) if isinstance(scoring, str) else None
    if scoring_code is None:
        raise ValueError(f"grouped_topk: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    n_group, topk_group = _count("n_group", n_group), _count("topk_group", topk_group)
    top_k = _count("top_k", top_k)
    if n_group < 1 or E % n_group:
        raise ValueError(f"grouped_topk: n_group={n_group} must be >= 1 and divide the number "
                         f"of experts {E}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"grouped_topk: topk_group={topk_group} must be in 1..n_group={n_group}")
    group_size = E // n_group
    if scoring_code == 1 and n_group > 1 and group_size < 2:
        raise ValueError(f"grouped_topk: sigmoid scoring ranks groups by their two best experts, "
                         f"so n_group={n_group} must leave >= 2 experts per group (E={E})")
    if not 1 <= top_k <= topk_group * group_size:
        raise ValueError(f"grouped_topk: top_k={top_k} must be in 1..{topk_group * group_size} "
                         f"(topk_group * experts per group; E={E}, n_group={n_group})")
    bias_code = 0
    if bias is not None:
        if scoring_code != 1:
            # As in transformers: only DeepseekV3's sigmoid router has a correction bias.
            raise ValueError("grouped_topk: bias (e_score_correction_bias) is only used with "
                             "scoring='sigmoid'")
        V.tensor("grouped_topk: bias", bias, dtypes=floats)
        if bias.shape != (E,):
            raise ValueError(f"grouped_topk: bias must have shape ({E},), got {tuple(bias.shape)}")
        if bias.get_device() != router_logits.get_device():  # -1 for the CPU, else the ordinal
            raise ValueError(f"grouped_topk: bias is on {bias.device}, router_logits on "
                             f"{router_logits.device}; they must be on the same device")
        bias_code = _dtypes.code(bias.dtype)
    if renormalize is not True and renormalize is not False:
        raise TypeError(f"grouped_topk: renormalize must be a bool, got "
                        f"{type(renormalize).__name__}")
    rsf = V.f32_arg("grouped_topk: routed_scaling_factor", routed_scaling_factor)
    return top_k, n_group, topk_group, scoring_code, bias_code, rsf


def grouped_topk(router_logits, top_k, *, n_group=1, topk_group=1, scoring="softmax",
                 bias=None, renormalize=True, routed_scaling_factor=1.0):
    """Group-limited top-k routing of DeepseekV2 (scoring="softmax") and DeepseekV3
    (scoring="sigmoid", bias = e_score_correction_bias), as transformers computes it.

    router_logits [T, E] float32/float16/bfloat16 (contiguous, cpu or cuda). All math is fp32:
    scores = softmax or sigmoid of the logits; selection scores = scores (+ bias for sigmoid);
    each of n_group groups is ranked by its best (softmax) or two best (sigmoid) selection
    scores, the topk_group best groups are kept and the top_k best experts among them chosen.
    Weights are the unbiased scores of the chosen experts, divided by (their sum + 1e-20) if
    renormalize, then multiplied by routed_scaling_factor.

    Returns (weights float32 [T, top_k], ids int32 [T, top_k]) on router_logits' device. The
    K outputs of a token are in descending selection score, ties to the lower expert index
    (groups likewise); torch.topk(sorted=False) promises no order, so compare as sets.

    NaN: a NaN logit makes its expert unusable: score 0, selection score -inf, so it is chosen
    only when fewer than top_k other experts remain in the kept groups (then with weight 0);
    softmax leaves it out like a -inf logit, and a row without any finite logit gets all-zero
    scores (hence zero weights). Ids are always top_k distinct experts of kept groups.
    On CUDA the kernel runs asynchronously on the current stream.
    """
    torch = V.torch_module()
    top_k, n_group, topk_group, scoring_code, bias_code, rsf = _validate(
        router_logits, top_k, n_group, topk_group, scoring, bias, renormalize, routed_scaling_factor)
    T, E = router_logits.shape
    index = router_logits.get_device()  # -1: the CPU
    # Sizes as separate ints: torch parses them faster than a tuple (~1.4 vs ~2.1 us a call).
    if index < 0:
        weights = torch.empty(T, top_k, dtype=torch.float32)
        ids = torch.empty(T, top_k, dtype=torch.int32)
    else:
        weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
        ids = torch.empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    if T == 0:
        return weights, ids
    args = (router_logits.data_ptr(), _dtypes.code(router_logits.dtype),
            0 if bias is None else bias.data_ptr(), bias_code, weights.data_ptr(), ids.data_ptr(),
            T, E, top_k, n_group, topk_group, scoring_code, renormalize, rsf)
    if index < 0:
        _cpu_core().grouped_topk(*args)
    else:
        mod = _cuda.module(torch, index, "grouped_topk")
        mod.grouped_topk(*args, index, _cuda.stream_handle(torch, index))
    return weights, ids


_core = None


def _cpu_core():
    global _core
    if _core is None:
        _core = load("cpu_core", CPU_CORE)
    return _core
