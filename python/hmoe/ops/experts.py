"""hmoe.ops.moe_experts_cpu: routed MoE experts on the CPU, one native module per ISA level.

Precision contract (the same for every ISA variant; tests use a reference that rounds in
these places):
  * x is read exactly and converted to fp32; weights are read exactly in their own dtype.
  * With bf16 weights, the activations entering each matmul (x, and h = silu(gate) * up) are
    rounded to bf16 (nearest even); with fp16/fp32 weights they stay fp32.
  * Products are accumulated in fp32 (the order of the reduction depends on the ISA).
  * silu(g) * u is computed in fp32 (exp to within about 2 ulp).
  * The routed sum over k is fp32, in k order; the result is rounded once to x.dtype.
topk_weights are fp32 and used as given (no renormalisation).

Host cost: every call validates its tensors here (about a microsecond each); expert ids are
range-checked by the native routing pass, which reads each id before any weight is touched (an id
outside [0, E) is a ValueError naming the token), so that the check costs no extra pass.
"""
from __future__ import annotations

import threading

from .. import _dtypes, _env, dispatch, validation as V
from .._native import load
from .._native.signatures import EXPERTS
from .._threads import get_num_threads

_selections: dict = {}
_modules: dict = {}  # module name -> loaded module (load() is idempotent; this skips its lock)
_sel_lock = threading.Lock()


def select(isa: str | None = None) -> dispatch.Selection:
    """The CPU variant moe_experts_cpu uses for `isa` (None: best, or $HMOE_CPU_ISA)."""
    key = (isa, _env.get("HMOE_CPU_ISA"))
    sel = _selections.get(key)
    if sel is None:
        with _sel_lock:
            sel = _selections.get(key)
            if sel is None:
                sel = _selections[key] = dispatch.select_cpu("experts", EXPERTS, isa=isa)
    return sel


def module(sel: dispatch.Selection):
    mod = _modules.get(sel.module)
    if mod is None:
        mod = _modules[sel.module] = load(sel.module, EXPERTS)
    return mod


def check_weights(w13, w2):
    """Validates w13 [E, 2I, H] and w2 [E, H, I]; returns (E, H, I)."""
    fl = V.float_dtypes()
    V.tensor("w13", w13, ndim=3, dtypes=fl, device="cpu")
    V.tensor("w2", w2, ndim=3, dtypes=fl, device="cpu")
    if w2.dtype != w13.dtype:
        raise TypeError(f"w13 and w2 must share a dtype, got {w13.dtype} and {w2.dtype}")
    E, two_i, H = w13.shape
    if E < 1 or H < 1 or two_i < 2 or two_i % 2:
        raise ValueError(f"w13 has shape {tuple(w13.shape)}: expected [E, 2I, H] with E >= 1, "
                         "an even, non-zero 2I and H >= 1")
    I = two_i // 2
    V.dim("w2", w2, 0, E, "E (w13.shape[0])")
    V.dim("w2", w2, 1, H, "H (w13.shape[2])")
    V.dim("w2", w2, 2, I, "I (w13.shape[1] // 2)")
    return E, H, I


def check_tokens(x, topk_ids, topk_weights, E: int, H: int):
    """Validates x [T, H], topk_ids [T, K] and topk_weights [T, K]; returns (T, K). The ids'
    range is checked by the native routing pass (module docstring)."""
    V.tensor("x", x, ndim=2, dtypes=V.float_dtypes(), device="cpu")
    V.tensor("topk_ids", topk_ids, ndim=2, dtypes=V.int_dtypes(), device="cpu")
    V.tensor("topk_weights", topk_weights, ndim=2, dtypes=V.f32_dtype(), device="cpu")
    T, h = x.shape
    if h != H:
        V.dim("x", x, 1, H, "H (the experts' hidden size)")
    t, K = topk_ids.shape
    if t != T:
        raise ValueError(f"topk_ids has {t} rows, x has {T} tokens")
    if K < 1:
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}: top-k must be at least 1")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected {(T, K)} "
                         "like topk_ids")
    return T, K


def run(sel, x, topk_ids, topk_weights, w13, w2, packed: bool, E: int, H: int, I: int, w_dtype,
        out=None, mod=None):
    """Launches the native op (inputs already validated); returns the [T, H] result, written
    into `out` when given (contiguous, x's dtype and shape). `mod`: sel's module, when the caller
    holds it."""
    torch = V.torch_module()
    T, K = topk_ids.shape
    if out is None:
        out = torch.empty(T, H, dtype=x.dtype)  # separate ints: parsed faster than a tuple
    if T == 0:
        return out
    code = _dtypes.code
    (mod or module(sel)).moe_experts(
        x.data_ptr(), code(x.dtype), topk_ids.data_ptr(), code(topk_ids.dtype),
        topk_weights.data_ptr(), w13.data_ptr(), w2.data_ptr(), code(w_dtype), int(packed),
        out.data_ptr(), T, K, E, H, I, get_num_threads())
    return out


def moe_experts_cpu(x, topk_ids, topk_weights, w13, w2, *, isa: str | None = None):
    """y[t] = sum_k topk_weights[t, k] * (silu(x[t] Wg^T) * (x[t] Wu^T)) Wd^T for expert
    e = topk_ids[t, k], where w13[e] = [Wg; Wu] ([2I, H]) and w2[e] = Wd ([H, I]).

    x: [T, H] fp32/fp16/bf16; topk_ids: [T, K] int32/int64; topk_weights: [T, K] fp32;
    w13: [E, 2I, H], w2: [E, H, I] in fp32/fp16/bf16 (one dtype, independent of x's).
    Returns [T, H] in x.dtype. All tensors on the CPU and contiguous. `isa` forces an ISA
    level (see hmoe.compat); the default is the best this CPU runs. Inference only (no
    autograd). The module docstring gives the precision contract.
    For repeated calls with the same weights, hmoe.CPUExperts prepacks them and is faster.
    """
    E, H, I = check_weights(w13, w2)
    check_tokens(x, topk_ids, topk_weights, E, H)
    sel = select(isa)
    return run(sel, x, topk_ids, topk_weights, w13, w2, False, E, H, I, w13.dtype)
