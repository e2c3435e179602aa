"""hmoe.ops.rms_norm: transformers' RMSNorm (DeepSeek's, Llama's) in one kernel on a CUDA device, where
torch runs the weight's product as a second kernel after its fused rms_norm."""
from __future__ import annotations

from .. import validation as V
from .._native import spec
from . import _cuda

__all__ = ["rms_norm"]

MAX_DIM = spec.constants()["rms_norm_max_dim"]


def applies(x, weight) -> bool:
    """Whether rms_norm takes x and weight as they are (the callers that fall back to torch otherwise ask
    this): x on a CUDA device (weight's device is the op's check: a mismatch is its ValueError, as it
    would be torch's error), both in one 16-bit dtype, x contiguous with a last dimension that is a
    multiple of 8 up to MAX_DIM, both 16-byte aligned; never under torch.compile, which traces torch's
    rms_norm instead."""
    torch = V.torch_module()
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.is_contiguous() and x.dim() >= 1 and x.shape[-1] % 8 == 0 and x.shape[-1] <= MAX_DIM
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0 and not torch.compiler.is_compiling())


def rms_norm(x, weight, *, eps):
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension: x [..., D] and weight [D] both
    bf16 or both fp16, contiguous, on one CUDA device, D a multiple of 8 up to MAX_DIM (8192). Returns
    [..., D] in x's dtype. Precision contract (transformers' RMSNorm): the mean of squares in fp32, the
    normalised row rounded to x's dtype, its product with the weight rounded again. Runs asynchronously
    on the current stream and can be captured in a CUDA graph (after hmoe.prewarm or one eager call)."""
    index = _cuda.cuda_index(x)
    if index < 0:  # not a plain CUDA tensor: say what is wrong with it
        V.tensor("x", x, dtypes=V.half_dtypes(), device="cuda")
        raise AssertionError("unreachable: x passed the checks of a CUDA tensor")
    if x.dim() < 1 or not x.is_contiguous():
        V.tensor("x", x, dtypes=V.half_dtypes(), device="cuda")  # says what is wrong with a non-contiguous x
        raise ValueError(f"rms_norm: x has shape {tuple(x.shape)}: it needs a last dimension to normalise")
    y = _cuda.module(index, "rms_norm").rms_norm(x.view(-1, x.shape[-1]), weight, eps)
    return y.view(x.shape)
