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


def _validate(torch, router_logits, top_k, n_group, topk_group, scoring, bias, renormalize,
              routed_scaling_factor):
    floats = V.float_dtypes()
    V.tensor("grouped_topk: router_logits", router_logits, ndim=2, dtypes=floats, device=("cpu", "cuda"))
    E = router_logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"grouped_topk: router_logits has {E} experts (dim 1); supported: "
                         f"1..{MAX_EXPERTS}")
    if router_logits.shape[0] > V.INT32_MAX:
        raise ValueError(f"grouped_topk: router_logits has {router_logits.shape[0]} tokens; "
                         f"supported: up to {V.INT32_MAX}")
    if not isinstance(scoring, str) or scoring not in _SCORING_CODES:
        raise ValueError(f"grouped_topk: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    n_group = V.int_arg("grouped_topk: n_group", n_group, hi=MAX_EXPERTS)
    topk_group = V.int_arg("grouped_topk: topk_group", topk_group, hi=MAX_EXPERTS)
    top_k = V.int_arg("grouped_topk: top_k", top_k, hi=MAX_EXPERTS)
    if n_group < 1 or E % n_group:
        raise ValueError(f"grouped_topk: n_group={n_group} must be >= 1 and divide the number "
                         f"of experts {E}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"grouped_topk: topk_group={topk_group} must be in 1..n_group={n_group}")
    group_size = E // n_group
    if scoring == "sigmoid" and n_group > 1 and group_size < 2:
        raise ValueError(f"grouped_topk: sigmoid scoring ranks groups by their two best experts, "
                         f"so n_group={n_group} must leave >= 2 experts per group (E={E})")
    if not 1 <= top_k <= topk_group * group_size:
        raise ValueError(f"grouped_topk: top_k={top_k} must be in 1..{topk_group * group_size} "
                         f"(topk_group * experts per group; E={E}, n_group={n_group})")
    if bias is not None:
        if scoring != "sigmoid":
            # As in transformers: only DeepseekV3's sigmoid router has a correction bias.
            raise ValueError("grouped_topk: bias (e_score_correction_bias) is only used with "
                             "scoring='sigmoid'")
        V.tensor("grouped_topk: bias", bias, dtypes=floats)
        if tuple(bias.shape) != (E,):
            raise ValueError(f"grouped_topk: bias must have shape ({E},), got {tuple(bias.shape)}")
        if bias.device != router_logits.device:
            raise ValueError(f"grouped_topk: bias is on {bias.device}, router_logits on "
                             f"{router_logits.device}; they must be on the same device")
    if not isinstance(renormalize, bool):
        raise TypeError(f"grouped_topk: renormalize must be a bool, got "
                        f"{type(renormalize).__name__}")
    rsf = V.f32_arg("grouped_topk: routed_scaling_factor", routed_scaling_factor)
    return top_k, n_group, topk_group, rsf


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
    top_k, n_group, topk_group, rsf = _validate(torch, router_logits, top_k, n_group, topk_group,
                                                scoring, bias, renormalize,
                                                routed_scaling_factor)
    T, E = router_logits.shape
    dev = router_logits.device
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=dev)
    if T == 0:
        return weights, ids
    args = (router_logits.data_ptr(), _dtypes.code(router_logits.dtype),
            0 if bias is None else bias.data_ptr(),
            _dtypes.code(bias.dtype) if bias is not None else 0,
            weights.data_ptr(), ids.data_ptr(), T, E, top_k, n_group, topk_group,
            _SCORING_CODES[scoring], renormalize, rsf)
    if dev.type == "cpu":
        load("cpu_core", CPU_CORE).grouped_topk(*args)
    else:
        index = _cuda.device_index(torch, dev)
        mod = _cuda.module(torch, index, "grouped_topk")
        stream = torch.cuda.current_stream(index).cuda_stream
        mod.grouped_topk(*args, index, stream)
    return weights, ids
