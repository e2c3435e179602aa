"""hmoe's ops as torch custom ops (torch.library), for torch.compile(fullgraph=True) and export.

Importing this module registers, once:

  hmoe::grouped_topk(Tensor router_logits, int top_k, int n_group, int topk_group, str scoring,
                     Tensor? bias, bool renormalize, float routed_scaling_factor) -> (Tensor, Tensor)
  hmoe::moe_experts_cpu(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2,
                        str? isa) -> Tensor
  hmoe::cpu_experts_packed(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed,
                           Tensor w2_packed, int[] dims, str? isa) -> Tensor
      (what CPUExperts runs; dims = [weight dtype code, num_experts, hidden_size, intermediate_size])
  hmoe::mla_decode(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor page_table,
                   Tensor seq_lens, float sm_scale, bool return_lse, str? variant) -> (Tensor, Tensor)

Each calls the eager op of hmoe.ops (same checks, same kernels, bit-identical results); each has a
fake (meta) implementation that only derives the outputs' shapes, dtypes and devices, so tracing
loads no native module. Custom ops are functional: there is no `out=` here, and mla_decode returns
an empty fp32 tensor of shape [0] as lse when return_lse is False. They have no autograd formula
(inference only; hmoe's ops have none either). They are defined through torch.library.Library with
a kernel per device type (the dispatcher calls the eager op directly; torch.library.custom_op's
autograd wrapper would add about 20 us a call). The module attributes (grouped_topk, ...) are the
ops' default overloads. Importing hmoe or hmoe.ops does not import this module; hmoe.nn imports it.
"""
from __future__ import annotations

import torch

from .. import _native
from .._threads import get_num_threads
from . import experts as _experts
from .mla import mla_decode as _mla
from .topk import grouped_topk as _topk

_NS = "hmoe"
# Defined with torch.library.Library and a kernel per device type rather than torch.library.custom_op,
# whose Python autograd wrapper costs about 20 us a call: this path adds a dispatcher round trip only.
_lib = torch.library.Library(_NS, "DEF")


def _define(schema: str, kernels: dict, fake):
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    for dev, fn in kernels.items():
        _lib.impl(name, fn, dev)
    torch.library.register_fake(f"{_NS}::{name}", fake, lib=_lib)
    return getattr(getattr(torch.ops, _NS), name).default


def _fake_check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _grouped_topk(router_logits, top_k, n_group, topk_group, scoring, bias, renormalize, routed_scaling_factor):
    return _topk(router_logits, top_k, n_group=n_group, topk_group=topk_group, scoring=scoring, bias=bias,
                 renormalize=renormalize, routed_scaling_factor=routed_scaling_factor)


def _grouped_topk_cpu(*args):
    """The CPU kernel: the dispatcher already chose the device, so straight to the CPU module (whose
    entry point takes the schema's arguments in the schema's order and checks them all)."""
    return _native.bind("cpu_core").grouped_topk(*args)


def _grouped_topk_fake(router_logits, top_k, n_group, topk_group, scoring, bias, renormalize, routed_scaling_factor):
    _fake_check(router_logits.dim() == 2, f"grouped_topk: router_logits must be [T, E], got {router_logits.dim()}-d")
    T = router_logits.shape[0]
    return (router_logits.new_empty((T, top_k), dtype=torch.float32),
            router_logits.new_empty((T, top_k), dtype=torch.int32))


grouped_topk = _define(
    "grouped_topk(Tensor router_logits, int top_k, int n_group, int topk_group, str scoring, Tensor? bias, "
    "bool renormalize, float routed_scaling_factor) -> (Tensor, Tensor)",
    {"CPU": _grouped_topk_cpu, "CUDA": _grouped_topk}, _grouped_topk_fake)


def _experts_out(x):
    _fake_check(x.dim() == 2, f"moe_experts: x must be [T, H], got {x.dim()}-d")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _moe_experts_cpu(x, topk_ids, topk_weights, w13, w2, isa):
    return _experts.moe_experts_cpu(x, topk_ids, topk_weights, w13, w2, isa=isa)


moe_experts_cpu = _define(
    "moe_experts_cpu(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, str? isa) -> Tensor",
    {"CPU": _moe_experts_cpu}, lambda x, topk_ids, topk_weights, w13, w2, isa: _experts_out(x))


def _cpu_experts_packed(x, topk_ids, topk_weights, w13_packed, w2_packed, dims, isa):
    mod = _experts.module(_experts.select(isa))  # both cached
    code, E, H, I = dims
    return mod.moe_experts_packed(x, topk_ids, topk_weights, w13_packed, w2_packed, code, E, H, I, None,
                                  get_num_threads())


def _cpu_experts_packed_fake(x, topk_ids, topk_weights, w13_packed, w2_packed, dims, isa):
    _fake_check(len(dims) == 4 and x.dim() == 2 and x.shape[1] == dims[2],
                f"CPUExperts: x must be [T, {dims[2] if len(dims) == 4 else 'H'}], got {tuple(x.shape)}")
    return _experts_out(x)


cpu_experts_packed = _define(
    "cpu_experts_packed(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, Tensor w2_packed, "
    "int[] dims, str? isa) -> Tensor",
    {"CPU": _cpu_experts_packed}, _cpu_experts_packed_fake)


def cpu_experts_op(experts, x, topk_ids, topk_weights):
    """CPUExperts `experts` applied through hmoe::cpu_experts_packed (what HybridMoE runs when compiled)."""
    return cpu_experts_packed(x, topk_ids, topk_weights, experts._w13, experts._w2, experts._dims,
                              experts._isa_request)


_no_lse: dict = {}  # device -> the empty fp32 tensor returned as lse without return_lse (nothing to mutate)


def _mla_decode_op(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, return_lse, variant):
    r = _mla(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale=sm_scale, return_lse=return_lse,
             variant=variant)
    if return_lse:
        return r
    empty = _no_lse.get(q_nope.device)
    if empty is None:
        empty = _no_lse[q_nope.device] = torch.empty(0, dtype=torch.float32, device=q_nope.device)
    return r, empty


def _mla_decode_fake(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, return_lse, variant):
    _fake_check(q_nope.dim() == 3, f"mla_decode: q_nope must be [B, H, 512], got {q_nope.dim()}-d")
    B, H, D = q_nope.shape
    return (q_nope.new_empty((B, H, D)), q_nope.new_empty((B, H) if return_lse else (0,), dtype=torch.float32))


mla_decode = _define(
    "mla_decode(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor page_table, "
    "Tensor seq_lens, float sm_scale, bool return_lse, str? variant) -> (Tensor, Tensor)",
    {"CUDA": _mla_decode_op}, _mla_decode_fake)
