"""hmoe.ops.moe_experts_cpu: routed MoE experts on the CPU, one native module per ISA level.

Precision contract (the same for every ISA variant; tests use a reference that rounds in
these places, hmoe._reference.moe_experts):
  * x is read exactly and converted to fp32; weights are read exactly in their own format.
  * With bf16 weights, the activations entering each matmul (x, and h = silu(gate) * up) are
    rounded to bf16 (nearest even); with fp16/fp32 weights they stay fp32.
  * Quantised weights (hmoe.quant.QuantizedWeights, through hmoe.CPUExperts), in k groups of the
    weights' kernel_group (their group size; for int8 per row the whole row; fp8's block columns):
      - int8 and int4 (w = q * s_w): the activations entering each matmul are quantised to int8 per
        (row, group): s_a = max|a| / 127 in fp32, q_a = round-half-even(a / s_a) (fp32 division),
        a group of zeros giving 0. Each group's dot product of q_a and q is exact (int32), then
        contributes float(dot) * (s_a * s_w) (that product in fp32; float(dot) exact for groups
        of up to 1024, rounded to fp32 beyond) to an fp32 sum over groups in group order.
      - fp8 (float8_e4m3fn, w = q * s_block): the activations are rounded to bf16 as for bf16
        weights; products are exact, each group's fp32 sum is multiplied by its scale and added to an
        fp32 sum over groups in group order.
  * Products are accumulated in fp32 (the order of the reduction depends on the ISA).
  * silu(g) * u is computed in fp32 (exp to within about 2 ulp).
  * The routed sum over k is fp32, in k order; the result is rounded once to x.dtype.
topk_weights are fp32 and used as given (no renormalisation).

Arguments are checked by the native entry point before any pointer is used (cpp/experts/
experts_entry.h; a tensor costs tens of nanoseconds there); expert ids are range-checked by the
routing pass, which reads each id before any weight is touched (an id outside [0, E) other than
-1, the empty slot, is a ValueError naming the token).
"""
from __future__ import annotations

import threading

from .. import _env, _native, dispatch
from .._threads import get_num_threads

_selections: dict = {}
_modules: dict = {}  # module name -> bound module
_sel_lock = threading.Lock()


def select(isa: str | None = None) -> dispatch.Selection:
    """The CPU variant moe_experts_cpu uses for `isa` (None: best, or $HMOE_CPU_ISA)."""
    key = (isa, _env.get("HMOE_CPU_ISA"))
    sel = _selections.get(key)
    if sel is None:
        with _sel_lock:
            sel = _selections.get(key)
            if sel is None:
                sel = _selections[key] = dispatch.select_cpu("experts", isa=isa)
    return sel


def module(sel: dispatch.Selection):
    """sel's module, loaded and bound to torch."""
    mod = _modules.get(sel.module)
    if mod is None:
        mod = _modules[sel.module] = _native.bind(sel.module)
    return mod


def moe_experts_cpu(x, topk_ids, topk_weights, w13, w2, *, isa: str | None = None, out=None):
    """y[t] = sum_k topk_weights[t, k] * (silu(x[t] Wg^T) * (x[t] Wu^T)) Wd^T for expert
    e = topk_ids[t, k], where w13[e] = [Wg; Wu] ([2I, H]) and w2[e] = Wd ([H, I]).

    x: [T, H] fp32/fp16/bf16; topk_ids: [T, K] int32/int64, each in [0, E) or -1 for an empty slot
    (one that adds nothing and whose weight is not read: a token's slots routed elsewhere, such as to
    experts on a GPU; a token with only empty slots gets zeros); topk_weights: [T, K] fp32;
    w13: [E, 2I, H], w2: [E, H, I] in fp32/fp16/bf16 (one dtype, independent of x's).
    Returns [T, H] in x.dtype (written into `out` when given: [T, H], x's dtype, sharing no
    memory with the inputs). All tensors on the CPU and contiguous. `isa` forces an ISA
    level (see hmoe.compat); the default is the best this CPU runs. Inference only (no
    autograd). The module docstring gives the precision contract.
    For repeated calls with the same weights, hmoe.CPUExperts prepacks them and is faster; it is
    also what takes quantised weights (hmoe.quant.QuantizedWeights).
    """
    try:
        return module(select(isa)).moe_experts(x, topk_ids, topk_weights, w13, w2, out, get_num_threads())
    except TypeError:
        from ..quant import QuantizedWeights

        if isinstance(w13, QuantizedWeights) or isinstance(w2, QuantizedWeights):
            raise TypeError("moe_experts_cpu takes float weights; quantised weights are packed once, by "
                            "hmoe.CPUExperts(w13, w2), and run from there") from None
        raise
