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
    return _U[str(dtype).removeprefix("torch.")]


# Normwise relative tolerance against the fp64 reference = rounding points x u(dtype):
#   mla_decode: P rounded to the input dtype before P V, the output rounded once, and the fp32
#   accumulation and softmax (below u of either 16-bit type): 3 u. Measured on random inputs the
#   error is about 0.5 u, so 3 u leaves room for long sequences without hiding a wrong kernel.
_ROUNDINGS = {"mla_decode": 3}
# lse is computed in fp32 from exact products: an absolute bound (a base-2 lse read as natural is
# off by 30%, and lse here is 3 or more).
MLA_LSE_ATOL = 1e-2


def tolerance(op: str, dtype) -> float:
    """The normwise relative error op's output may have in `dtype` against its fp64 reference."""
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
