"""hmoe.ops.decode_linear: y = x W^T for the few token rows of a decode step on a CUDA device, the
matmul-vector shape whose library kernels leave most of a large GPU idle (a decode step runs several
per layer, one after the other)."""
from __future__ import annotations

from .. import validation as V
from .._native import spec
from . import _cuda

__all__ = ["decode_linear"]

MAX_ROWS = spec.constants()["decode_linear_max_rows"]


def applies(x, weight) -> bool:
    """Whether decode_linear takes x and weight as they are (the callers that fall back to a library
    matmul otherwise ask this): x on a CUDA device (weight's device is the op's check: a mismatch is its
    ValueError, as it would be the matmul's error), both in one 16-bit dtype, x [M <= MAX_ROWS, K] and
    weight [N, K] contiguous and 16-byte aligned, K a multiple of 8; never under torch.compile, which
    traces the library matmul instead."""
    torch = V.torch_module()
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.dim() == 2 and weight.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] % 8 == 0
            and weight.shape[1] == x.shape[1] and x.is_contiguous() and weight.is_contiguous()
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0 and not torch.compiler.is_compiling())


def decode_linear(x, weight, *, out_dtype=None):
    """x [M, K] @ weight[N, K]^T -> [M, N] for 0 <= M <= MAX_ROWS (16) rows: weight in nn.Linear's
    layout, x and weight both bf16 or both fp16, contiguous, on one CUDA device, K a multiple of 8.
    out_dtype: None (x's dtype) or torch.float32. Precision contract: the products are exact, summed in
    fp32 (in an order of the kernel's choosing) and rounded once to out_dtype. Runs asynchronously on
    the current stream and can be captured in a CUDA graph (after hmoe.prewarm or one eager call).
    More rows than MAX_ROWS is a ValueError: a matmul serves those."""
    index = _cuda.cuda_index(x)
    if index < 0:  # not a plain CUDA tensor: say what is wrong with it
        V.tensor("x", x, ndim=2, dtypes=V.half_dtypes(), device="cuda")
        raise AssertionError("unreachable: x passed the checks of a CUDA tensor")
    torch = V.torch_module()
    if out_dtype is not None and out_dtype not in (x.dtype, torch.float32):
        raise TypeError(f"decode_linear: out_dtype must be None, x's dtype or torch.float32, got {out_dtype}")
    return _cuda.module(index, "decode_linear").decode_linear(x, weight, out_dtype == torch.float32)
