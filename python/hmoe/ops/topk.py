"""hmoe.ops.grouped_topk: DeepseekV2/V3 group-limited expert routing, run by the C++ CPU variant
(hmoe._native.cpu_core) or the CUDA family modules; the native entry point checks every argument
(cpp/topk/grouped_topk_entry.h) before it reads a tensor."""
from __future__ import annotations

from .. import _native
from . import _cuda

__all__ = ["grouped_topk"]


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
    scores (hence zero weights). +inf logits (an fp16 router that overflowed): softmax takes its
    limit, the +inf experts share the row's probability equally and every other expert scores 0;
    sigmoid scores them 1. Ids are always top_k distinct experts of kept groups.
    On CUDA the kernel runs asynchronously on the current stream.
    """
    index = _cuda.cuda_index(router_logits)
    if index < 0:  # CPU tensors, and anything else: the CPU module's checks say what is wrong
        mod = _native.bind("cpu_core")
    else:
        mod = _cuda.module(index, "grouped_topk")
    return mod.grouped_topk(router_logits, top_k, n_group, topk_group, scoring, bias, renormalize,
                            routed_scaling_factor)
