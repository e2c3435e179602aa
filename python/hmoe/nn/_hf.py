"""transformers' DeepSeek MoE blocks read into HybridMoE arguments, and patch_model."""
from __future__ import annotations

import dataclasses
import sys
import warnings

import torch

from .. import quant as _quant
from .._dtypes import code, name as dtype_name
from .._units import size_text as _size
from ..hardware import cpu as _cpu
from ..ops import experts as _experts
from ..ops import norm
from ..validation import is_int


def _is_linear_mlp(m) -> bool:
    return all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


# transformers' DeepSeek routers, whose routing router_options reproduces. Other MoE blocks of the same
# shape (Mixtral, Qwen2/3-MoE, ...) route differently (softmax over the top k, a gated shared expert, ...).
_HF_ROUTERS = ("DeepseekV2TopkRouter", "DeepseekV3TopkRouter", "DeepseekV32TopkRouter")


def _is_deepseek_router(gate) -> bool:
    return type(gate).__name__ in _HF_ROUTERS or hasattr(gate, "scoring_func")  # or the remote-code MoEGate


def _has_moe_shape(module) -> bool:
    """A router `gate` with a weight [E, H] and routed `experts` (fused gate_up_proj / down_proj, or a list
    of MLPs), whoever's routing it is."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    if not isinstance(getattr(gate, "weight", None), torch.Tensor) or experts is None:
        return False
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return True
    return isinstance(experts, torch.nn.ModuleList) and len(experts) > 0 and all(
        e is None or _is_linear_mlp(e) for e in experts)


def is_moe_block(module) -> bool:
    """A DeepSeek-V2/V3 MoE block of transformers or of the remote-code checkpoints: an MoE block whose
    router is transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter (DeepseekV32TopkRouter: the same code) or
    the remote-code MoEGate."""
    return _has_moe_shape(module) and _is_deepseek_router(module.gate)


def _not_deepseek(module) -> str:
    """Why `module` (None: nothing MoE-like was found) is not a DeepSeek MoE block, for the messages."""
    if module is None or not _has_moe_shape(module):
        return "a module with a router `gate` and routed `experts`"
    return (f"its router {type(module.gate).__name__} routes differently from DeepSeek's ({', '.join(_HF_ROUTERS)} or "
            "the remote-code MoEGate), and hmoe computes DeepSeek's routing only")


def _check_silu(module, experts, who: str) -> None:
    """Raises unless the experts compute silu(gate) * up, as hmoe's do: the activation the config names,
    else the experts' own act_fn (transformers 5's fused experts keep no config)."""
    cfg = getattr(module, "config", None) or getattr(experts, "config", None)
    act, fn = getattr(cfg, "hidden_act", None), getattr(experts, "act_fn", None)
    if act is None and isinstance(fn, torch.nn.Module):
        act = "silu" if isinstance(fn, torch.nn.SiLU) or type(fn).__name__ == "SiLUActivation" else type(fn).__name__
    if act not in (None, "silu", "swish"):
        raise ValueError(f"{who}: the experts use {act!r}; hmoe's experts compute silu(gate) * up")


def expert_weights(experts):
    """(w13 [E, 2I, H], w2 [E, H, I]) of a fused or per-expert experts module, on their own device."""
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        if getattr(experts, "has_bias", False):
            raise ValueError("HybridMoE: experts with biases are not supported (DeepSeek's have none)")
        if getattr(experts, "has_gate", True) is False:
            raise ValueError("HybridMoE: experts without a gate projection are not supported")
        w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
        if getattr(experts, "is_transposed", False):  # [E, H, 2I] and [E, I, H]
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        if getattr(experts, "is_concatenated", True) is False:  # interleaved gate/up rows
            w13 = torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)
        return w13, w2
    if any(e is None for e in experts):
        raise ValueError("HybridMoE: this block holds only some of its experts (expert-parallel shard); load the "
                         "model with all experts in one process")
    w13 = torch.stack([torch.cat([e.gate_proj.weight.detach(), e.up_proj.weight.detach()]) for e in experts])
    w2 = torch.stack([e.down_proj.weight.detach() for e in experts])
    for e in experts:
        if e.gate_proj.bias is not None or e.up_proj.bias is not None or e.down_proj.bias is not None:
            raise ValueError("HybridMoE: experts with biases are not supported (DeepSeek's have none)")
    return w13, w2


def expert_dims(experts) -> tuple:
    """(E, H, I, dtype, device) of a fused or per-expert experts module (expert_weights' layouts), read from
    its parameters' shapes: nothing is copied."""
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        d = experts.down_proj  # [E, H, I], or [E, I, H] transposed
        H, inter = (d.shape[2], d.shape[1]) if getattr(experts, "is_transposed", False) else (d.shape[1], d.shape[2])
        return d.shape[0], H, inter, d.dtype, d.device
    w = next(e for e in experts if e is not None).gate_proj.weight  # [I, H]
    return len(experts), w.shape[1], w.shape[0], w.dtype, w.device


def router_options(gate) -> dict:
    """grouped_topk's options for a DeepSeek router: transformers' DeepseekV2TopkRouter (softmax,
    greedy or group-limited by the group's best score, no renormalisation), DeepseekV3TopkRouter
    (sigmoid + e_score_correction_bias, groups by their two best, norm_topk_prob) or the remote-code
    MoEGate (scoring_func, topk_method, n_group, norm_topk_prob)."""
    top_k = int(getattr(gate, "top_k"))
    remote = hasattr(gate, "scoring_func")
    scoring = gate.scoring_func if remote else (
        "sigmoid" if isinstance(getattr(gate, "e_score_correction_bias", None), torch.Tensor) else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"HybridMoE: router scoring {scoring!r} is not supported (softmax or sigmoid)")
    method = getattr(gate, "topk_method", None)
    n_group = getattr(gate, "num_group", None) or getattr(gate, "n_group", None) or 1
    topk_group = getattr(gate, "topk_group", None) or 1
    if method == "greedy" or method is None and scoring == "softmax" and n_group == 1:
        n_group = topk_group = 1
    elif method not in (None, "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"HybridMoE: router topk_method {method!r} is not supported")
    bias = getattr(gate, "e_score_correction_bias", None) if scoring == "sigmoid" else None
    scale = float(getattr(gate, "routed_scaling_factor", 1.0) or 1.0)
    if scoring == "sigmoid":
        renormalize = bool(getattr(gate, "norm_topk_prob", False))
    elif remote:  # DeepSeek-V2's own code: normalised weights (top_k > 1) are not scaled
        renormalize = bool(getattr(gate, "norm_topk_prob", False)) and top_k > 1
        if renormalize:
            scale = 1.0
    else:  # transformers' DeepseekV2TopkRouter never renormalises
        renormalize = False
    return dict(top_k=top_k, n_group=int(n_group), topk_group=int(topk_group), scoring=scoring,
                e_score_correction_bias=bias, renormalize=renormalize, routed_scaling_factor=scale)


def block_arguments(module) -> dict:
    """HybridMoE's arguments (without the placement options) for a DeepSeek MoE block."""
    if not is_moe_block(module):
        raise TypeError(f"HybridMoE.from_hf: {type(module).__name__} is not a DeepSeek-V2/V3 MoE block "
                        f"({_not_deepseek(module)})")
    _check_silu(module, module.experts, "HybridMoE.from_hf")
    w13, w2 = expert_weights(module.experts)
    return dict(gate_weight=module.gate.weight.detach(), w13=w13, w2=w2,
                shared_experts=getattr(module, "shared_experts", None), **router_options(module.gate))


@dataclasses.dataclass
class BlockReport:
    name: str
    experts: int
    gpu_experts: list
    dtype: torch.dtype
    moved_from: str
    packed_bytes: int
    format: str = ""  # the CPU experts' weight format (CPUExperts.format)


@dataclasses.dataclass
class PatchReport:
    """What hmoe.nn.patch_model did; str() is the human-readable summary."""
    blocks: list
    already_patched: int
    isa: str | None
    device: str
    freed_bytes: int
    norms: int = 0  # RMSNorms swapped for FusedRMSNorm
    who: str = "hmoe.nn.patch_model"
    unread: int = 0  # checkpoint tensors hmoe.nn.load_model left unread (the model has no place for them)

    @property
    def swapped(self) -> int:
        return len(self.blocks)

    def __str__(self) -> str:
        if not self.blocks:
            return (f"{self.who}: nothing to do: the model's {self.already_patched} MoE blocks are already "
                    "HybridMoE")
        packed = sum(b.packed_bytes for b in self.blocks)
        n_gpu = sum(len(b.gpu_experts) for b in self.blocks)
        n_all = sum(b.experts for b in self.blocks)
        dtypes = sorted({dtype_name(b.dtype) + (f" as {b.format}" if b.format in ("int8", "int4", "fp8")
                                                               else "") for b in self.blocks})
        sources = ', '.join(sorted({b.moved_from for b in self.blocks}))
        lines = [f"{self.who}: swapped {self.swapped} MoE blocks for HybridMoE"
                 + (f" ({self.already_patched} were already)" if self.already_patched else ""),
                 f"  router, shared experts: stay on {self.device}",
                 f"  routed experts: {n_all - n_gpu} of {n_all} on the CPU ({_size(packed)} packed, "
                 f"{', '.join(dtypes)}, isa {self.isa}), {n_gpu} kept on {self.device}",
                 f"  routed expert weights taken from {sources}: {_size(self.freed_bytes)} freed there"
                 if self.freed_bytes else f"  routed expert weights read from {sources} one expert at a time"]
        if self.unread:
            lines.append(f"  {self.unread} tensors of the checkpoint left unread: the model has no place for them "
                         "(DeepSeek-V3's multi-token-prediction layer has none)")
        if self.norms:
            lines.append(f"  RMSNorms: {self.norms} fused (1 hmoe.ops.rms_norm kernel each on CUDA, torch's rms_norm "
                         "and the weight elsewhere: 2 ops; the original runs 7)")
        return "\n".join(lines)


# transformers' DeepSeek RMSNorms: weight * (x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype).
_HF_RMSNORMS = ("DeepseekV2RMSNorm", "DeepseekV3RMSNorm")


class FusedRMSNorm(torch.nn.Module):
    """transformers' DeepSeek RMSNorm in fewer kernels: the mean of squares and the scaling in fp32,
    rounded once to x's dtype, then times the weight, rounded again, as the original computes it. On a
    CUDA device with x and the weight in one 16-bit dtype, one hmoe.ops.rms_norm kernel; elsewhere (and
    under torch.compile) torch's fused rms_norm and the product: two kernels where the original launches
    seven. Takes over the original's weight."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = float(eps)

    def forward(self, hidden_states):
        x, w = hidden_states, self.weight
        if norm.applies(x, w):
            return norm.rms_norm(x, w, eps=self.variance_epsilon)
        return w * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _fuse_norms(model) -> int:
    """Swaps transformers' DeepSeek RMSNorms for FusedRMSNorm; returns how many."""
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in _HF_RMSNORMS
             and isinstance(getattr(m, "weight", None), torch.nn.Parameter) and hasattr(m, "variance_epsilon")]
    for name, m in found:
        _set_submodule(model, name, FusedRMSNorm(m.weight, m.variance_epsilon))
    return len(found)



def _expert_bytes(quant, group_size, dtype, block, H: int, I: int, mod) -> int:
    """One expert's packed bytes (w13 and w2, scales included) in the CPU experts' format: quant None keeps
    the float dtype; fp8 in `block`s (rows, columns)."""
    from .experts import _format_code

    if quant is None:
        fcode, g13, g2 = code(dtype), 0, 0
    else:
        gs = [None if quant == "fp8" else _quant._group(quant, K, group_size) for K in (H, I)]
        fcode = _format_code(quant)
        g13, g2 = (_quant._kernel_group(quant, K, g, block) for K, g in zip((H, I), gs))
    b13, b2 = mod.packed_bytes(fcode, H, I, g13, g2)
    return b13 + b2


def _format_totals(formats, dtype, block, shapes, mod) -> dict:
    """Per CPU-experts format of `formats` (None: the float dtype; groups and blocks by default): (the packed
    bytes of the experts of `shapes`, per block (experts, H, I), the largest block's), or None where the
    kernels cannot take the shapes (int4 groups of 128 need K a multiple of 128; fp8 blocks 32-128 columns)."""
    out = {}
    for q in formats:
        try:
            per = [E * _expert_bytes(q, None, dtype, block, H, I, mod) for E, H, I in shapes]
            out[q] = (sum(per), max(per))
        except ValueError:
            out[q] = None
    return out


def _host_memory_error(what: str, avail: int, quant, dtype, block, shapes, mod) -> MemoryError:
    """check_memory's MemoryError: `what` the load or swap needs, the host's available bytes, and the size of
    the CPU experts (shapes: per block (experts, H, I)) in the other formats."""
    names = {None: "in " + dtype_name(dtype), "int8": "as int8 (per row)",
             "int4": "as int4 (groups of 128)"}
    totals = _format_totals([q for q in names if q != quant], dtype, block, shapes, mod)
    alt = [f"{names[q]} {_size(t[0])}" for q, t in totals.items() if t is not None]
    return MemoryError(f"{what}, and {_size(avail)} is available (MemAvailable, or the memory cgroup's limit "
                       "where that leaves less). "
                       + (f"The experts would take {', '.join(alt)} (quant=); or pass" if alt else "Pass")
                       + " check_memory=False to go ahead anyway")


def _check_swap_memory(blocks, gpu_experts, isa, quant, group_size) -> None:
    """patch_model's check_memory: the host bytes its swap needs at most (per block, in order: the CPU experts'
    float copy on the host and the quantised stack beside their packed copy, then the originals freed where
    they were on the CPU), against hardware.cpu.mem_available_bytes."""
    mod = _experts.module(_experts.select(isa))  # an isa this CPU cannot run is refused here, before any copy
    shapes, total, peak, packed_all = [], 0, 0, 0
    for _, block in blocks:
        E, H, inter, dtype, device = expert_dims(block.experts)
        if isinstance(gpu_experts, (list, tuple, torch.Tensor)):
            G = len(gpu_experts)
        else:  # a count, or None (a bad value is refused by HybridMoE with its reason)
            G = int(gpu_experts) if is_int(gpu_experts) and 0 < gpu_experts < E else 0
        try:
            packed = (E - G) * _expert_bytes(quant, group_size, dtype, (128, 128), H, inter, mod)
        except ValueError:
            return  # a group size or shape the format cannot take: HybridMoE says so in its words
        copy = (E - G) * 3 * H * inter * dtype.itemsize
        peak = max(peak, total + copy + (packed if quant else 0) + packed)
        total += packed - (E * 3 * H * inter * dtype.itemsize if device.type == "cpu" else 0)
        shapes.append((E - G, H, inter))
        packed_all += packed
    avail = _cpu.mem_available_bytes()
    if avail and peak > avail:
        fmt = quant or dtype_name(dtype)
        raise _host_memory_error(
            f"hmoe.nn.patch_model: not enough host memory: the CPU experts take {_size(packed_all)} packed as {fmt} "
            f"({len(blocks)} MoE blocks), {_size(peak)} at the swap's peak (a block's experts copied to the host "
            "and packed before the originals are freed)", avail, quant, dtype, (128, 128), shapes, mod)


def _check_calibration(calibration, who: str) -> None:
    if isinstance(calibration, torch.Tensor):
        if calibration.is_floating_point() or calibration.is_complex() or calibration.numel() == 0:
            raise ValueError(f"{who}: calibration must be input ids (an integer tensor with some tokens) or "
                             f"a dict of model inputs, got a {calibration.dtype} tensor of shape "
                             f"{tuple(calibration.shape)}")
    elif not isinstance(calibration, dict):
        raise TypeError(f"{who}: calibration must be input ids (an integer tensor) or a dict of model "
                        f"inputs, got {type(calibration).__name__}")


def _calibrate(model, calibration) -> None:
    """One forward of model on `calibration` (checked by _check_calibration)."""
    with torch.no_grad():
        if isinstance(calibration, dict):
            model(**calibration)
        else:
            model(calibration)


def _count_routing(model, blocks, calibration):
    """Routing counts per block from one forward of the original model on `calibration`."""
    from .. import ops

    _check_calibration(calibration, "hmoe.nn.patch_model")
    counts, hooks = {}, []
    for name, block in blocks:
        opts = router_options(block.gate)
        E = block.gate.weight.shape[0]
        counts[name] = torch.zeros(E, dtype=torch.int64)

        def hook(mod, args, name=name, opts=opts):
            x = args[0].reshape(-1, args[0].shape[-1])
            logits = torch.nn.functional.linear(x.float(), mod.gate.weight.float())
            _, ids = ops.grouped_topk(logits, opts["top_k"], n_group=opts["n_group"], topk_group=opts["topk_group"],
                                      scoring=opts["scoring"], bias=opts["e_score_correction_bias"],
                                      renormalize=opts["renormalize"],
                                      routed_scaling_factor=opts["routed_scaling_factor"])
            counts[name] += torch.bincount(ids.flatten().long().cpu(), minlength=counts[name].numel())

        hooks.append(block.register_forward_pre_hook(hook))
    try:
        _calibrate(model, calibration)
    finally:
        for h in hooks:
            h.remove()
    return counts


def _progress(iterable, total: int, enabled: bool):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc="hmoe: packing MoE blocks", unit="block", file=sys.stderr)


def patch_model(model, *, gpu_experts=None, calibration=None, isa: str | None = None, quant: str | None = None,
                group_size: int | None = None, fuse_norms: bool = True, check_memory: bool = True,
                progress: bool = True) -> PatchReport:
    """Swaps every DeepSeek-V2/V3 MoE block of `model` for a HybridMoE in place (router and shared
    experts stay where they are; routed expert weights go to host memory, packed for this CPU, and
    their copies on the model's device are freed). Returns a PatchReport (print it).

    gpu_experts: per block, expert ids to keep on the device, or a count chosen from routing
    statistics: the busiest experts of one forward of the original model on `calibration` (input
    ids, or a dict of model inputs). isa forces a CPU ISA level (see hmoe.compat). quant ("int8",
    "int4", "fp8"; group_size) quantises the CPU experts' weights as they are packed (HybridMoE).
    fuse_norms swaps the model's DeepSeek RMSNorms for FusedRMSNorm (same result, the mean and the
    scaling in one kernel: between two layers' CPU experts the GPU's serial work is dozens of small
    kernels). A model without DeepSeek MoE blocks is a ValueError (other MoE families, e.g. Mixtral or
    Qwen-MoE, route differently: experts_implementation="hmoe" runs their experts); a model patched before
    gives a report saying so. check_memory: before the first block is swapped, a MemoryError (with the
    sizes, and the experts' in the other formats) when the host's available memory (Linux MemAvailable, or a
    container's memory cgroup limit where that leaves less) cannot hold the packed CPU experts at the swap's
    peak; False skips it.
    """
    from .hybrid import HybridMoE

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"hmoe.nn.patch_model: expected a torch.nn.Module, got {type(model).__name__}")
    blocks = [(n, m) for n, m in model.named_modules() if is_moe_block(m) and not isinstance(m, HybridMoE)]
    done = sum(isinstance(m, HybridMoE) for m in model.modules())
    if not blocks:
        if done:
            warnings.warn(f"hmoe.nn.patch_model: the model was patched before ({done} HybridMoE blocks); nothing "
                          "to do", stacklevel=2)
            return PatchReport([], done, None, "-", 0)
        other = next((m for m in model.modules() if _has_moe_shape(m)), None)
        why = f"{type(other).__name__}: {_not_deepseek(other)}" if other is not None else _not_deepseek(None)
        raise ValueError(f"hmoe.nn.patch_model: {type(model).__name__} has no DeepSeek-V2/V3 MoE block ({why}); nothing "
                         "to patch")
    counts = {}
    if is_int(gpu_experts) and gpu_experts > 0:  # a count
        if calibration is None:
            raise ValueError("hmoe.nn.patch_model: gpu_experts as a count is chosen from routing statistics: pass "
                             "calibration= (input ids or a dict of model inputs), or give expert ids")
        counts = _count_routing(model, blocks, calibration)
    if check_memory:
        _check_swap_memory(blocks, gpu_experts, isa, quant, group_size)
    reports, freed, isa_name, device = [], 0, None, "-"
    for name, block in _progress(blocks, len(blocks), progress):
        w13, w2 = expert_weights(block.experts)
        moved_from, dtype, E = str(w13.device), w13.dtype, w13.shape[0]
        hybrid = HybridMoE.from_hf(block, gpu_experts=gpu_experts, routing_counts=counts.get(name), isa=isa,
                                   quant=quant, group_size=group_size)
        device, isa_name = str(hybrid.gate_weight.device), hybrid.experts.isa
        _set_submodule(model, name, hybrid)
        freed += _free_routed(block.experts)
        del w13, w2
        reports.append(BlockReport(name, E, hybrid.gpu_ids.tolist(), dtype, moved_from, hybrid.experts.packed_bytes,
                                   hybrid.experts.format))
    norms = _fuse_norms(model) if fuse_norms else 0
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return PatchReport(reports, done, isa_name, device, freed, norms)


def _set_submodule(model, name: str, module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _free_routed(experts) -> int:
    """Empties the original routed expert parameters (whoever still holds the old block sees empty
    tensors, and the memory is released); returns the bytes freed."""
    freed = 0
    for p in list(experts.parameters()):
        freed += p.numel() * p.element_size()
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return freed


# --- transformers' experts mechanism ---------------------------------------------------------------------

EXPERTS_IMPLEMENTATION = "hmoe"


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward (ExpertsInterface) for experts whose weights are in host memory:
    packs them once into a CPUExperts kept on the module (packed again if the weights change) and runs
    it. Hidden states may be on any device; the result has their dtype and device."""
    from .experts import CPUExperts

    w = self.gate_up_proj
    if w.device.type != "cpu":
        raise ValueError(f"experts_implementation='{EXPERTS_IMPLEMENTATION}' runs experts whose weights are in host "
                         f"memory; these are on {w.device}. Keep them on the CPU (e.g. device_map) or use "
                         "hmoe.nn.patch_model, which moves them")
    key = (w.data_ptr(), w._version, self.down_proj.data_ptr(), self.down_proj._version)
    cached = getattr(self, "_hmoe_experts", None)
    if cached is None or cached[0] != key:
        _check_silu(self, self, f"experts_implementation='{EXPERTS_IMPLEMENTATION}'")
        w13, w2 = expert_weights(self)
        cached = (key, CPUExperts(w13.contiguous(), w2.contiguous()))
        object.__setattr__(self, "_hmoe_experts", cached)  # not a submodule, not in the state dict
    x = hidden_states.to("cpu")
    out = cached[1](x, top_k_index.to("cpu"), top_k_weights.to("cpu", torch.float32))
    return out.to(hidden_states.device)


def register_experts_implementation() -> str:
    """Registers hmoe in transformers' ExpertsInterface; then `experts_implementation="hmoe"` in
    from_pretrained, or model.set_experts_implementation("hmoe"), runs a model's experts (weights on
    the CPU) through hmoe: the model's own routing, experts computing silu(gate) * up (others are a
    ValueError at their first forward). Returns the name. Safe to call more than once."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError("hmoe.nn.register_experts_implementation needs transformers >= 5 (with "
                          f"transformers.integrations.moe.ExpertsInterface): {e}") from None
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)
    return EXPERTS_IMPLEMENTATION
