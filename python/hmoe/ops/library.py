"""hmoe's ops as torch custom ops (torch.library), for torch.compile(fullgraph=True) and export.

Importing this module registers, once (importing again, or importlib.reload, reuses the registration):

  hmoe::grouped_topk(Tensor router_logits, int top_k, int n_group, int topk_group, str scoring,
                     Tensor? bias, bool renormalize, float routed_scaling_factor) -> (Tensor, Tensor)
      weights fp32 [T, top_k], ids int32 [T, top_k] on router_logits' device (CPU and CUDA kernels)
  hmoe::moe_experts_cpu(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2,
                        str? isa) -> Tensor
      [T, H] in x.dtype (CPU kernel)
  hmoe::cpu_experts_packed(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed,
                           Tensor w2_packed, str layout, str? isa) -> Tensor
      what CPUExperts runs, layout = "format code,num_experts,hidden_size,intermediate_size,group13,
      group2" (CPUExperts._layout: six decimal integers; a str because torch's dispatcher boxes one
      faster than an int[] or six ints, about 0.5 us a call); [T, H] in x.dtype (CPU kernel);
      cpu_experts_op(experts, x, topk_ids, topk_weights) calls it for a CPUExperts
  hmoe::mla_decode(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor page_table,
                   Tensor seq_lens, float sm_scale, str? variant) -> Tensor
      out [B, H, 512] in q's dtype (CUDA kernel; CPU tensors get the eager op's error)
  hmoe::mla_decode_lse(the same arguments) -> (Tensor, Tensor)
      out as above and lse [B, H] fp32: hmoe.ops.mla_decode(..., return_lse=True) (as mla_decode)

Each kernel calls the eager op of hmoe.ops (same checks, same kernels, bit-identical results). Each op
has a fake (meta) implementation that derives the outputs' shapes, dtypes and devices only: it loads no
native module and reads no data, and refuses a tensor of the wrong rank, dtype or device, and (grouped_topk,
mla_decode) sizes and scalars the kernel refuses, with the eager op's TypeError/ValueError and message.
Custom ops are functional: there is no `out=` on this path (hmoe.ops' functions take it).

Not differentiable (inference only, like hmoe.ops): the ops register torch's fallthrough at the
Autograd key, as torch asks of non-differentiable ops, so their outputs never require grad, exactly
as the eager ops' outputs; no gradient reaches the router or the inputs through them (hmoe.nn's
HybridMoE warns when called with gradients enabled on inputs that require them).

They are defined with torch.library.Library and a kernel per device type rather than with
torch.library.custom_op, whose Python autograd wrapper costs about 20 us a call: this path adds the
dispatcher's round trip into Python (`python -m hmoe.bench overhead` measures it). The module
attributes (grouped_topk, ...) are the ops' default overloads. Importing hmoe or hmoe.ops does not
import this module; hmoe.nn does.
"""
from __future__ import annotations

import math

import torch

from .. import _native
from .._native import spec
from .._threads import get_num_threads
from . import _cuda
from . import experts as _experts
from .mla import D_CKV, D_PE, MAX_BATCH, MAX_HEADS
from .mla import mla_decode as _mla

_NS = "hmoe"
# A namespace is defined once per process: importlib.reload keeps the first import's library and kernels.
_reloaded = "_lib" in globals()
if not _reloaded:
    _lib = torch.library.Library(_NS, "DEF")


def _define(schema: str, kernels: dict, fake):
    name = schema.split("(", 1)[0]
    if not _reloaded:
        _lib.define(schema)
        for dev, fn in kernels.items():
            _lib.impl(name, fn, dev)
        _lib.impl(name, torch.library.fallthrough_kernel, "Autograd")  # not differentiable (docstring)
        torch.library.register_fake(f"{_NS}::{name}", fake, lib=_lib)
    return getattr(getattr(torch.ops, _NS), name).default


# The fake implementations' checks: the native entry points' checks of rank, dtype and device
# (cpp/bind/tensors.cpp), which need neither data nor a native module, with the same types and messages.
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_HALVES = (torch.float16, torch.bfloat16)
_IDS = (torch.int32, torch.int64)
_WHERE = {"CPU": ("cpu",), "CUDA": ("cuda",), "CPU or CUDA": ("cpu", "cuda")}


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check(t, name: str, ndim: int, dtypes: tuple, where: str) -> None:
    if ndim >= 0 and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {', '.join(map(_name, dtypes))}; got {_name(t.dtype)}")
    if t.device.type not in _WHERE[where]:
        raise ValueError(f"{name} must be on the {where}, got device {t.device}")


def _finite(x: float, name: str) -> None:
    """The entry points' check of a float argument (cpp/bind/scalars.h float_arg): the kernels take fp32."""
    if not math.isfinite(x) or abs(x) > 3.4028234663852886e38:
        raise ValueError(f"{name} must be finite in float32 (|x| <= 3.4e38), got {x!r}")


def _grouped_topk_cpu(*args):
    """The CPU kernel: the dispatcher already chose the device, so straight to the CPU module (whose
    entry point takes the schema's arguments in the schema's order and checks them all)."""
    return _native.bind("cpu_core").grouped_topk(*args)


def _grouped_topk_cuda(*args):
    """The CUDA kernel: straight to the module hmoe.ops.grouped_topk selects for router_logits' device."""
    return _cuda.module(args[0].get_device(), "grouped_topk").grouped_topk(*args)


_TOPK_MAX = spec.constants()["grouped_topk_max_experts"]


def _grouped_topk_fake(router_logits, top_k, n_group, topk_group, scoring, bias, renormalize, routed_scaling_factor):
    """The entry point's checks (cpp/topk/grouped_topk_entry.h), those of the sizes included: top_k shapes
    the outputs, so a fake must not return [T, top_k] for a top_k the kernel refuses."""
    op = "grouped_topk: "
    _check(router_logits, op + "router_logits", 2, _FLOATS, "CPU or CUDA")
    T, E = router_logits.shape
    if not 1 <= E <= _TOPK_MAX:
        raise ValueError(f"{op}router_logits has {E} experts (dim 1); supported: 1..{_TOPK_MAX}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"{op}scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    for name, v in (("n_group", n_group), ("topk_group", topk_group), ("top_k", top_k)):
        if not 1 <= v <= _TOPK_MAX:
            raise ValueError(f"{op}{name} = {v} is outside the supported range [1, {_TOPK_MAX}]")
    if n_group < 1 or E % n_group:
        raise ValueError(f"{op}n_group={n_group} must be >= 1 and divide the number of experts {E}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"{op}topk_group={topk_group} must be in 1..n_group={n_group}")
    group_size = E // n_group
    if scoring == "sigmoid" and n_group > 1 and group_size < 2:
        raise ValueError(f"{op}sigmoid scoring ranks groups by their two best experts, so n_group={n_group} must "
                         f"leave >= 2 experts per group (E={E})")
    if not 1 <= top_k <= topk_group * group_size:
        raise ValueError(f"{op}top_k={top_k} must be in 1..{topk_group * group_size} (topk_group * experts per "
                         f"group; E={E}, n_group={n_group})")
    if bias is not None:
        if scoring != "sigmoid":
            raise ValueError(f"{op}bias (e_score_correction_bias) is only used with scoring='sigmoid'")
        _check(bias, op + "bias", -1, _FLOATS, "CPU or CUDA")
        if bias.dim() != 1 or bias.shape[0] != E:
            raise ValueError(f"{op}bias must have shape ({E},), got {tuple(bias.shape)}")
        if bias.device != router_logits.device:
            raise ValueError(f"{op}bias is on {bias.device}, router_logits on {router_logits.device}; they must be "
                             "on the same device")
    _finite(routed_scaling_factor, op + "routed_scaling_factor")
    return (router_logits.new_empty((T, top_k), dtype=torch.float32),
            router_logits.new_empty((T, top_k), dtype=torch.int32))


_TOPK_ARGS = ("(Tensor router_logits, int top_k, int n_group, int topk_group, str scoring, Tensor? bias, "
              "bool renormalize, float routed_scaling_factor)")
grouped_topk = _define("grouped_topk" + _TOPK_ARGS + " -> (Tensor, Tensor)",
                       {"CPU": _grouped_topk_cpu, "CUDA": _grouped_topk_cuda}, _grouped_topk_fake)


def _experts_out(x, topk_ids, topk_weights, H):
    """The fake result [T, H] in x.dtype, after the checks of the tokens (cpp/experts/experts_entry.h)."""
    _check(x, "x", 2, _FLOATS, "CPU")
    _check(topk_ids, "topk_ids", 2, _IDS, "CPU")
    _check(topk_weights, "topk_weights", 2, (torch.float32,), "CPU")
    if x.shape[1] != H:
        raise ValueError(f"x has shape {tuple(x.shape)}: dimension 1 must be H (the experts' hidden size) = {H}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _moe_experts_cpu(x, topk_ids, topk_weights, w13, w2, isa):
    return _experts.moe_experts_cpu(x, topk_ids, topk_weights, w13, w2, isa=isa)


def _moe_experts_cpu_fake(x, topk_ids, topk_weights, w13, w2, isa):
    _check(w13, "w13", 3, _FLOATS, "CPU")
    _check(w2, "w2", 3, _FLOATS, "CPU")
    if w13.dtype != w2.dtype:
        raise TypeError(f"w13 and w2 must share a dtype, got {_name(w13.dtype)} and {_name(w2.dtype)}")
    return _experts_out(x, topk_ids, topk_weights, w13.shape[2])


moe_experts_cpu = _define(
    "moe_experts_cpu(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, str? isa) -> Tensor",
    {"CPU": _moe_experts_cpu}, _moe_experts_cpu_fake)


_LAYOUT_FIELDS = 6  # format code, E, H, I, group13, group2
_layouts: dict = {}  # layout string -> its six ints (one entry per distinct CPUExperts configuration)


def _layout_dims(layout: str) -> tuple:
    """The six ints of a cpu_experts_packed layout string, or ValueError."""
    dims = _layouts.get(layout)
    if dims is None:
        try:
            dims = tuple(int(v) for v in layout.split(","))
        except ValueError:
            dims = ()
        if len(dims) != _LAYOUT_FIELDS:
            raise ValueError("cpu_experts_packed: layout must be 'weight format code,num_experts,hidden_size,"
                             f"intermediate_size,group13,group2' (CPUExperts._layout), got {layout!r}")
        if len(_layouts) < 4096:
            _layouts[layout] = dims
    return dims


def _cpu_experts_packed(x, topk_ids, topk_weights, w13_packed, w2_packed, layout, isa):
    mod = _experts.module(_experts.select(isa))  # both cached
    return mod.moe_experts_packed(x, topk_ids, topk_weights, w13_packed, w2_packed, *_layout_dims(layout), None,
                                  get_num_threads())


def _cpu_experts_packed_fake(x, topk_ids, topk_weights, w13_packed, w2_packed, layout, isa):
    H = _layout_dims(layout)[2]
    _check(w13_packed, "w13 (packed)", 1, (torch.uint8,), "CPU")
    _check(w2_packed, "w2 (packed)", 1, (torch.uint8,), "CPU")
    return _experts_out(x, topk_ids, topk_weights, H)


cpu_experts_packed = _define(
    "cpu_experts_packed(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, Tensor w2_packed, "
    "str layout, str? isa) -> Tensor",
    {"CPU": _cpu_experts_packed}, _cpu_experts_packed_fake)


def cpu_experts_op(experts, x, topk_ids, topk_weights):
    """CPUExperts `experts` applied through hmoe::cpu_experts_packed (what HybridMoE runs when compiled)."""
    return cpu_experts_packed(x, topk_ids, topk_weights, experts._w13, experts._w2, experts._layout,
                              experts._isa_request)


def _mla_decode_op(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, variant):
    return _mla(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale=sm_scale, variant=variant)


def _mla_decode_lse_op(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, variant):
    return _mla(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale=sm_scale, return_lse=True,
                variant=variant)


def _like_q(q_nope, t, name: str, dtype: bool) -> None:
    """mla_decode's agreement of `t` with q_nope: its device (and its dtype)."""
    if t.device != q_nope.device:
        raise ValueError(f"{name} is on {t.device}, q_nope on {q_nope.device}: all inputs must share a device")
    if dtype and t.dtype != q_nope.dtype:
        raise TypeError(f"{name} has dtype {_name(t.dtype)}, q_nope {_name(q_nope.dtype)}: they must match")


def _mla_decode_fake(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, variant):
    """The entry point's checks that need no data (cuda/mla/mla_decode_entry.h), in its order: ranks, dtypes,
    devices, the sizes that shape the outputs and those that must agree (not the 2^31 limits on a cache)."""
    _check(q_nope, "q_nope", 3, _HALVES, "CUDA")
    _check(q_pe, "q_pe", 3, _HALVES, "CUDA")
    _like_q(q_nope, q_pe, "q_pe", True)
    B, H, D = q_nope.shape
    if D != D_CKV:
        raise ValueError(f"q_nope has shape {tuple(q_nope.shape)}: the last dimension must be {D_CKV}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q_nope has {H} heads; mla_decode supports 1 to {MAX_HEADS}")
    if tuple(q_pe.shape) != (B, H, D_PE):
        raise ValueError(f"q_pe has shape {tuple(q_pe.shape)}, expected ({B}, {H}, {D_PE})")
    for t, name, ndim, dtypes in ((ckv_cache, "ckv_cache", 3, _HALVES), (kpe_cache, "kpe_cache", 3, _HALVES),
                                  (page_table, "page_table", 2, (torch.int32,)), (seq_lens, "seq_lens", 1, (torch.int32,))):
        _check(t, name, ndim, dtypes, "CUDA")
        _like_q(q_nope, t, name, False)
    _like_q(q_nope, ckv_cache, "ckv_cache", True)
    _like_q(q_nope, kpe_cache, "kpe_cache", True)
    P, page, D = ckv_cache.shape
    if D != D_CKV:
        raise ValueError(f"ckv_cache has shape {tuple(ckv_cache.shape)}: the last dimension must be {D_CKV}")
    if page < 1 or P < 1:
        raise ValueError(f"ckv_cache has shape {tuple(ckv_cache.shape)}: no pages")
    if tuple(kpe_cache.shape) != (P, page, D_PE):
        raise ValueError(f"kpe_cache has shape {tuple(kpe_cache.shape)}, expected ({P}, {page}, {D_PE})")
    if page_table.shape[0] != B or page_table.shape[1] < 1:
        raise ValueError(f"page_table has shape {tuple(page_table.shape)}, expected [{B}, max_pages >= 1]")
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}, expected ({B},)")
    if B > MAX_BATCH:
        raise ValueError(f"q_nope has batch {B}; the MLA kernels run at most {MAX_BATCH} requests a call (the CUDA "
                         "grid's limit): split the batch")
    _finite(sm_scale, "sm_scale")
    return q_nope.new_empty(q_nope.shape)


def _mla_decode_lse_fake(*args):
    out = _mla_decode_fake(*args)
    return out, out.new_empty(out.shape[:2], dtype=torch.float32)


# Two ops rather than one with return_lse: a second output and one more argument through the
# dispatcher cost about a microsecond a call.
_MLA_ARGS = ("(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor page_table, Tensor seq_lens, "
             "float sm_scale, str? variant)")
# CUDA kernels; at the CPU key too, where the eager op's checks name the argument that is not on a CUDA
# device (torch's dispatcher would say only that the op has no CPU kernel).
mla_decode = _define("mla_decode" + _MLA_ARGS + " -> Tensor", {"CUDA": _mla_decode_op, "CPU": _mla_decode_op},
                     _mla_decode_fake)
mla_decode_lse = _define("mla_decode_lse" + _MLA_ARGS + " -> (Tensor, Tensor)",
                         {"CUDA": _mla_decode_lse_op, "CPU": _mla_decode_lse_op}, _mla_decode_lse_fake)
