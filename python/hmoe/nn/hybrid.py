"""hmoe.nn.HybridMoE: the DeepSeek-V2/V3 MoE block with its routed experts on the CPU."""
from __future__ import annotations

import operator
import warnings

import torch
import torch.nn.functional as F

from .. import ops, quant as hquant
from ..validation import is_int
from ..ops import library, linear
from .experts import CPUExperts

_SCORINGS = ("softmax", "sigmoid")


# torch.mm(..., out_dtype=) (16-bit inputs, fp32 output; CUDA) where this torch has it (aten::mm.dtype);
# an older torch (hmoe supports 2.3 on) keeps the fp32 matmul.
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


class HybridMoE(torch.nn.Module):
    """HybridMoE(gate_weight, w13, w2, *, top_k, ...)(hidden_states) -> tensor of hidden_states' shape and dtype.

    The MoE block of DeepSeek-V2/V3: router logits in fp32 (gate_weight [E, H], on the module's
    device) and group-limited top-k through hmoe.ops.grouped_topk (on the GPU when the hidden states
    are there), routed experts on the CPU through CPUExperts (w13 [E, 2I, H], w2 [E, H, I], packed
    once into host memory in their own dtype), shared experts (any module, e.g. the model's own MLP)
    where the hidden states are, and output = routed + shared in the input's dtype. The activation
    dtype is never assumed: fp32, fp16 and bf16 hidden states go to the experts as they are and the
    routed sum is rounded once to their dtype (hmoe.ops.experts' precision contract).

    Router options, as hmoe.ops.grouped_topk: top_k, n_group, topk_group, scoring ("softmax" for
    V2, "sigmoid" for V3), e_score_correction_bias (V3), renormalize (V3's norm_topk_prob),
    routed_scaling_factor. Building one from a transformers block: HybridMoE.from_hf.

    On a GPU the CPU work is enqueued on a side stream (a gather into mapped pinned memory, the
    hand-over to the experts: a doorbell, or a host function with HMOE_CPU_HANDOVER=host_func; see
    hmoe/nn/_staging.py) while the shared experts and GPU-resident experts run on the current
    stream, so the two overlap, and the result is read from mapped pinned memory; the same sequence
    can be captured in a CUDA graph after one eager call with the same number of tokens (replay runs
    the experts on the CPU with the routing of the step being replayed). A failed run (it cannot
    raise) leaves NaN in that step's output and is raised by the next forward or by check().

    gpu_experts: expert ids to keep on the hidden states' device, or a count n: the n experts most
    often routed to according to routing_counts ([E], e.g. from a calibration run; see
    hmoe.nn.patch_model). The CPU computes only the others. Each call adds its routing to the buffer
    `routing_counts`. The device computes its experts with two torch matmuls in the input's dtype:
    gate, up and h rounded to it, h times its (fp32) routing weight rounded once, and the sum over
    those experts inside the second matmul, rounded once.

    gpu_weights=(w13 [G, 2I, H], w2 [G, H, I]): a placement already split. The float weights of
    gpu_experts (ids; one matrix of each per id, in sorted id order) come apart from the CPU experts',
    and w13 and w2 hold only the others (E - G of them, in id order; float or quantised), so that no
    stack of every expert is needed: hmoe.nn.load_model reads each block's experts from a checkpoint so.

    quant: None (the CPU experts keep the weights' dtype), or "int8", "int4", "fp8": the CPU experts'
    weights are quantised with hmoe.quant.quantize (group_size as there; fp8 in (128, 128) blocks)
    and run by the quantised kernels (their precision contract: hmoe.ops.experts); GPU-resident
    experts keep the original weights. w13 and w2 may also come quantised, as
    hmoe.quant.QuantizedWeights (hmoe.load_experts(..., quant=...) reads them so from a checkpoint,
    expert by expert): the CPU experts take them as they are, and every routed expert is a CPU one
    unless gpu_weights gives the float weights of gpu_experts, or until keep_on_device moves some to the
    device with theirs.

    The state dict holds the CPU experts as packed (experts.w13_packed, experts.w2_packed, uint8, and
    experts.layout): load_state_dict takes them from a module built with the same quant, group_size and
    gpu_experts, and refuses others.
    """

    def __init__(self, gate_weight, w13, w2, *, top_k: int, n_group: int = 1, topk_group: int = 1,
                 scoring: str = "softmax", e_score_correction_bias=None, renormalize: bool = False,
                 routed_scaling_factor: float = 1.0, shared_experts: torch.nn.Module | None = None,
                 gpu_experts=None, routing_counts=None, isa: str | None = None, quant: str | None = None,
                 group_size: int | None = None, gpu_weights=None):
        super().__init__()
        quantised = [isinstance(w, hquant.QuantizedWeights) for w in (w13, w2)]
        if any(quantised):  # already quantised (hmoe.quant, hmoe.load_experts(quant=...)): the CPU experts as given
            if not all(quantised) or w13.format != w2.format or len(w13.shape) != 3 or len(w2.shape) != 3:
                what = [f"{type(w).__name__} {getattr(w, 'format', getattr(w, 'dtype', ''))} {tuple(w.shape)}"
                        if hasattr(w, "shape") else type(w).__name__ for w in (w13, w2)]
                raise TypeError(f"HybridMoE: w13 and w2 must both be float tensors or both hmoe.quant.QuantizedWeights "
                                f"of one format and [E, 2I, H] / [E, H, I] shapes, got {what[0]} and {what[1]}")
            if quant is not None and quant != w13.format or group_size is not None:
                raise ValueError(f"HybridMoE: w13 and w2 are quantised already ({w13.format}); quant={quant!r} and "
                                 f"group_size={group_size!r} apply to float weights")
            if gpu_weights is None and gpu_experts is not None and not (is_int(gpu_experts) and gpu_experts == 0):
                raise ValueError("HybridMoE: gpu_experts needs the float weights of the experts kept on the GPU; with "
                                 "quantised w13 and w2 every routed expert runs on the CPU")
        checked = (("gate_weight", gate_weight, 2),) + (() if quantised[0] else (("w13", w13, 3), ("w2", w2, 3)))
        for name, t, ndim in checked:
            if not isinstance(t, torch.Tensor) or t.dim() != ndim:
                raise TypeError(f"HybridMoE: {name} must be a {ndim}-d torch tensor, got "
                                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        named = (("gate_weight", gate_weight), ("w13", w13), ("w2", w2))
        if gpu_weights is not None:
            if not isinstance(gpu_weights, (tuple, list)) or len(gpu_weights) != 2:
                raise TypeError(f"HybridMoE: gpu_weights must be a pair (w13 [G, 2I, H], w2 [G, H, I]) of the "
                                f"gpu_experts' float weights, got {type(gpu_weights).__name__}")
            named += (("gpu_weights[0]", gpu_weights[0]), ("gpu_weights[1]", gpu_weights[1]))
        meta = [name for name, t in named if isinstance(t, torch.Tensor) and t.is_meta]
        if meta:
            raise ValueError(f"HybridMoE: {', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device, "
                             "without data (a model built under torch.device('meta'), or weights offloaded by "
                             "accelerate's hooks): load the weights into memory first")
        if quant is None and group_size is not None:
            raise ValueError(f"HybridMoE: group_size={group_size!r} applies to quant='int8' or 'int4'; with quant=None "
                             "the CPU experts keep the weights' dtype")
        E, H = gate_weight.shape
        split = None if gpu_weights is None else _split_ids(gpu_experts, E)  # the ids gpu_weights belong to
        n = E if split is None else E - len(split)  # experts in w13 and w2
        if tuple(w13.shape[::2]) != (n, H) or w13.shape[1] % 2 or tuple(w2.shape[:2]) != (n, H) \
                or w2.shape[2] * 2 != w13.shape[1]:
            rows, why = ("E", "") if split is None else \
                ("E - G", f" (with gpu_weights, w13 and w2 hold the experts not in gpu_experts: G = {len(split)})")
            raise ValueError(f"HybridMoE: shapes do not fit together: gate_weight {tuple(gate_weight.shape)} = "
                             f"[E, H], w13 {tuple(w13.shape)} = [{rows}, 2I, H], w2 {tuple(w2.shape)} = [{rows}, H, I]"
                             + why)
        if split is not None:
            _check_device_weights("HybridMoE: gpu_weights", len(split), H, w2.shape[2], *gpu_weights)
        if scoring not in _SCORINGS:
            raise ValueError(f"HybridMoE: scoring must be one of {_SCORINGS}, got {scoring!r}")
        for name, v in (("top_k", top_k), ("n_group", n_group), ("topk_group", topk_group)):
            if not is_int(v):  # as grouped_topk refuses them: int() would route top_k=2.5 as 2 and True as 1
                raise TypeError(f"HybridMoE: {name} must be an int, got {v!r} of type {type(v).__name__}")
        if not 1 <= top_k <= E:
            raise ValueError(f"HybridMoE: top_k = {top_k} must be in [1, E = {E}]")
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, w2.shape[2]
        self.top_k, self.n_group, self.topk_group, self.scoring = int(top_k), int(n_group), int(topk_group), scoring
        self.renormalize, self.routed_scaling_factor = bool(renormalize), float(routed_scaling_factor)
        dev = gate_weight.device
        self.register_buffer("gate_weight", gate_weight.detach())
        bias = None if e_score_correction_bias is None else e_score_correction_bias.detach().float().to(dev)
        self.register_buffer("e_score_correction_bias", bias)
        self.register_buffer("routing_counts", torch.zeros(E, dtype=torch.int64, device=dev))
        self.shared_experts = shared_experts

        gpu = _resolve_gpu_experts(gpu_experts, routing_counts, E) if split is None else split
        for name in ("cpu_index", "gpu_ids", "gpu_w13", "gpu_w2"):
            self.register_buffer(name, None)
        cpu = _cpu_ids(gpu, E)
        with torch.no_grad():
            if split is not None:
                on_device = [w.detach() for w in gpu_weights]
            elif gpu:
                sel = torch.tensor(gpu, dtype=torch.long)
                on_device = [w.detach().index_select(0, sel.to(w.device)) for w in (w13, w2)]
            else:
                on_device = [None, None]
            self._place(gpu, cpu, *on_device)
            if quantised[0]:
                c13, c2 = w13, w2
            else:
                c13, c2 = w13.detach().to("cpu"), w2.detach().to("cpu")
                if gpu and split is None:
                    c13, c2 = c13[cpu], c2[cpu]
                c13, c2 = c13.contiguous(), c2.contiguous()
            if quant is not None and not quantised[0]:  # group_size with fp8 (scaled per block) is quantize's error
                c13, c2 = (hquant.quantize(c, quant, group_size=group_size) for c in (c13, c2))
            self.experts = CPUExperts(c13, c2, isa=isa)
        self._jobs: dict = {}
        self._side: dict = {}
        self._ones: dict = {}
        self._gate_f32, self._gate_key = None, None
        self._warned_grad = False

    def _place(self, gpu: list, cpu: list, w13, w2) -> None:
        """Sets the expert placement: experts `gpu` (sorted ids) computed on the module's device from their
        float weights w13 [G, 2I, H] and w2 [G, H, I], experts `cpu` (the others, _cpu_ids) on the CPU."""
        E, dev = self.num_experts, self.gate_weight.device
        index = torch.full((E,), -1, dtype=torch.int32)
        index[cpu] = torch.arange(len(cpu), dtype=torch.int32)
        self.cpu_index = index.to(dev)
        self.gpu_ids = torch.tensor(gpu, dtype=torch.int32, device=dev)
        self.gpu_w13 = self.gpu_w2 = None
        if gpu:
            self.gpu_w13 = w13.to(dev)
            # gpu_w2 is [G, H, I] (the state dict's shape) over memory laid out as [G, I, H], so that
            # _gpu_part reads it as one [G * I, H] matrix without a copy (.to() keeps such strides)
            self.gpu_w2 = w2.transpose(1, 2).contiguous().to(dev).transpose(1, 2)

    def keep_on_device(self, gpu_experts, w13, w2) -> None:
        """Moves experts `gpu_experts` (ids, e.g. chosen from routing_counts after some tokens) from the CPU
        experts to the module's device, where they are computed from the float weights w13 [G, 2I, H] and
        w2 [G, H, I] given (one matrix of each per id, in sorted id order: from the checkpoint, say, when the
        CPU experts are quantised). The CPU experts keep the others (their packed bytes copied, nothing
        quantised again). Only for a module with no experts on its device yet; routing_counts is reset."""
        if self.gpu_w13 is not None:
            raise ValueError("HybridMoE.keep_on_device: this module keeps experts on its device already")
        if any(job.captured for job in self._jobs.values()):
            raise RuntimeError("HybridMoE.keep_on_device: a captured CUDA graph runs this module's CPU experts; "
                               "move experts before capturing")
        if isinstance(gpu_experts, bool) or not isinstance(gpu_experts, (list, tuple, torch.Tensor)):
            raise TypeError(f"HybridMoE.keep_on_device: gpu_experts must be a list of expert ids, got {gpu_experts!r}")
        gpu = _resolve_gpu_experts(gpu_experts, None, self.num_experts)
        _check_device_weights("HybridMoE.keep_on_device", len(gpu), self.hidden_size, self.intermediate_size, w13, w2)
        if not gpu:
            return
        cpu = _cpu_ids(gpu, self.num_experts)
        experts = self.experts.subset(cpu)  # first: if the copy fails, nothing has changed
        with torch.no_grad():
            self._place(gpu, cpu, w13.detach(), w2.detach())
            self.experts = experts
            self.routing_counts.zero_()
        self._jobs = {}  # their buffers were made for the CPU experts before (queued runs are waited for)

    # --- construction from transformers ---------------------------------------------------------------

    @classmethod
    def from_hf(cls, module, **options) -> HybridMoE:
        """A HybridMoE computing what a DeepSeek-V2/V3 MoE block of transformers computes:
        DeepseekV2Moe / DeepseekV3MoE (transformers 5: fused gate_up_proj [E, 2I, H] and down_proj
        [E, H, I]) or the remote-code DeepseekMoE (experts as a list of MLPs with nn.Linear
        gate_proj / up_proj / down_proj). The router weight and shared experts are taken over (same
        objects, same device); the routed weights are copied to host memory and packed. `options`:
        gpu_experts, routing_counts, isa, quant, group_size (see the class)."""
        from . import _hf

        return cls(**_hf.block_arguments(module), **options)

    # --- forward ---------------------------------------------------------------------------------------

    def _gate_fp32(self):
        """gate_weight in fp32: a copy made once and remade only when the weight changes (a decode
        step would otherwise cast [E, H] again in every layer)."""
        w = self.gate_weight
        if w.dtype == torch.float32 or torch.compiler.is_compiling():
            return w.float()
        key = (w.data_ptr(), w._version, w.device, w.shape)
        if self._gate_key != key:
            self._gate_f32, self._gate_key = w.float(), key
        return self._gate_f32

    def route(self, x):
        """(weights fp32 [T, top_k], ids int32 [T, top_k]) for x [T, H], on x's device. The logits are fp32
        sums of exact products: x and the router weight in fp32, or, on a GPU with both in the same 16-bit
        dtype, a 16-bit matmul that accumulates and writes fp32 (one kernel instead of a cast and two):
        hmoe.ops.decode_linear for a decode step's few tokens, torch's matmul for more."""
        w = self.gate_weight
        if linear.applies(x, w):  # a decode step's few tokens
            logits = linear.decode_linear(x, w, out_dtype=torch.float32)
        elif _MM_OUT_DTYPE and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype:
            logits = torch.mm(x, w.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(x.float(), self._gate_fp32())
        if torch.compiler.is_compiling():  # the custom op: traceable, same kernel
            return library.grouped_topk(logits, self.top_k, self.n_group, self.topk_group, self.scoring,
                                        self.e_score_correction_bias, self.renormalize, self.routed_scaling_factor)
        return ops.grouped_topk(logits, self.top_k, n_group=self.n_group, topk_group=self.topk_group,
                                scoring=self.scoring, bias=self.e_score_correction_bias,
                                renormalize=self.renormalize, routed_scaling_factor=self.routed_scaling_factor)

    def forward(self, hidden_states):
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"HybridMoE: hidden_states has shape {tuple(hidden_states.shape)}, expected [..., "
                             f"{self.hidden_size}]")
        if hidden_states.device != self.gate_weight.device:
            raise ValueError(f"HybridMoE: hidden_states are on {hidden_states.device}, the router on "
                             f"{self.gate_weight.device}: move the module with .to()")
        if hidden_states.requires_grad and torch.is_grad_enabled() and not self._warned_grad:
            self._warned_grad = True
            warnings.warn("HybridMoE is inference-only: no gradient flows through the routed experts (run the "
                          "model under torch.no_grad() or torch.inference_mode())", stacklevel=2)
        x = hidden_states.reshape(-1, self.hidden_size).contiguous()  # any layout in; the kernels take rows
        weights, ids = self.route(x)
        cpu_ids, cpu_w = self._cpu_routing(ids, weights)
        if x.is_cuda and not torch.compiler.is_compiling():
            routed, shared = self._forward_cuda(x, hidden_states, ids, weights, cpu_ids, cpu_w)
        else:
            self._count(ids)
            routed = self._experts_sync(x, cpu_ids, cpu_w)
            if self.gpu_w13 is not None:
                routed = routed + self._gpu_routed(x, ids, weights)
            shared = None if self.shared_experts is None else self.shared_experts(hidden_states)
        out = routed.view(hidden_states.shape)
        return out if shared is None else out + shared

    def _count(self, ids):
        """routing_counts[e] += the slots routed to e: one kernel (int32 ids, ones kept per size)."""
        flat = ids.flatten()
        if torch.compiler.is_compiling():
            self.routing_counts.index_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
            return
        ones = self._ones.get((flat.numel(), flat.device))
        if ones is None:
            ones = self._ones[(flat.numel(), flat.device)] = torch.ones(flat.numel(), dtype=torch.int64,
                                                                        device=flat.device)
        self.routing_counts.index_add_(0, flat, ones)

    def _cpu_routing(self, ids, weights):
        """ids in the CPU experts' numbering (int32) and their weights: a slot of a GPU-resident expert is
        -1, an empty slot the CPU experts skip (no row computed, no weight read)."""
        if self.gpu_w13 is None:
            return ids, weights
        return self.cpu_index[ids], weights  # int32 ids index directly: one kernel

    # The GPU-resident experts' temporaries of a call stay below this many bytes: tokens go through them
    # in chunks (a long prompt with many GPU experts would otherwise hold [T, G, 2I] and more at once).
    GPU_PART_BYTES = 256 << 20

    def _gpu_routed(self, x, ids, weights):
        """The GPU-resident experts' part of the routed sum, dense over those experts (no data-dependent
        shapes, so it can be captured), in x's dtype; tokens in chunks of bounded temporaries."""
        G, two_i, H = self.gpu_w13.shape
        inter, e = two_i // 2, x.element_size()
        w13 = self.gpu_w13.to(x.dtype).reshape(G * two_i, H)  # each expert's gate rows, then its up rows
        # gpu_w2 [G, H, I] is laid out as [G, I, H] (see __init__): a view, or one copy a call if a move
        # or a load lost that layout
        w2 = self.gpu_w2.to(x.dtype).permute(0, 2, 1).reshape(G * inter, H)
        # per token: gate and up [G, 2I], h and the weighted h [G, I] in x's dtype, the output [H]
        per_token = 4 * G * inter * e + H * e
        T, chunk = x.shape[0], max(1, self.GPU_PART_BYTES // per_token)
        if T <= chunk or torch.compiler.is_compiling():
            return self._gpu_part(x, ids, weights, w13, w2)
        out = torch.empty(T, H, dtype=x.dtype, device=x.device)
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            out[t0:t1] = self._gpu_part(x[t0:t1], ids[t0:t1], weights[t0:t1], w13, w2)
        return out

    def _gpu_part(self, x, ids, weights, w13, w2):
        """x [T, H] through the G GPU experts with w13 as [G * 2I, H] and w2 as [G * I, H] (rows g * I + i:
        w2[g, :, i]): one matmul for every expert's gate and up, then the routing weight folded into h
        so that one more matmul also sums over the experts. Rounded to x's dtype: gate and up, silu(gate)
        and h; h times its fp32 routing weight, once; the output once, from the matmul's accumulator."""
        T, G, inter = x.shape[0], self.gpu_ids.shape[0], self.intermediate_size
        wg = torch.where(ids.unsqueeze(-1) == self.gpu_ids, weights.unsqueeze(-1), 0.0).sum(1)  # [T, G] fp32
        gu = F.linear(x, w13).view(T, G, 2 * inter)
        h = F.silu(gu[..., :inter]) * gu[..., inter:]
        hw = torch.empty_like(h)  # the product in fp32 (h times an fp32 weight), rounded as it is stored: one kernel
        torch.mul(h, wg.unsqueeze(-1), out=hw)
        return hw.view(T, G * inter) @ w2

    def _experts_sync(self, x, ids, weights):
        if torch.compiler.is_compiling():
            out = library.cpu_experts_op(self.experts, x.to("cpu"), ids.to("cpu"), weights.to("cpu"))
        else:
            out = self.experts(x.to("cpu"), ids.to("cpu"), weights.to("cpu"))
        return out.to(x.device)

    def _forward_cuda(self, x, hidden_states, ids, weights, cpu_ids, cpu_w):
        self.check()
        if x.shape[0] == 0:  # nothing to hand over (an empty batch)
            return torch.zeros_like(x), None if self.shared_experts is None else self.shared_experts(hidden_states)
        main = torch.cuda.current_stream(x.device)
        side = self._side.get(x.device)
        if side is None:
            side = self._side[x.device] = torch.cuda.Stream(x.device)
        job = self._job(x.shape[0], x.dtype, x.device)
        side.wait_stream(main)
        routed = job.launch(x, cpu_ids, cpu_w, side)  # host memory seen by the GPU, until the job's next launch
        self._count(ids)  # while the CPU works: the hand-over does not wait for the statistics
        shared = None if self.shared_experts is None else self.shared_experts(hidden_states)
        gpu = None if self.gpu_w13 is None else self._gpu_routed(x, ids, weights)
        main.wait_stream(side)
        if gpu is not None:
            return routed + gpu, shared
        return (routed.clone() if shared is None else routed), shared  # the sum with shared reads it once

    def host_run_times(self) -> list[float]:
        """Wall times (us) of the CPU expert runs handed over on a CUDA stream (eager calls
        and graph replays) since the last call, oldest first: what the experts cost inside a step,
        where no Python timer sees them."""
        return [t for job in self._jobs.values() for t in job.times()]

    def _job(self, tokens: int, dtype, device):
        from . import _staging

        key = (tokens, dtype, device)
        job = self._jobs.get(key)
        if job is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"HybridMoE: first call with {tokens} tokens of {dtype} inside CUDA graph capture; "
                                   "run one eager step with the same batch before capturing (warm-up), so that its "
                                   "pinned buffers exist")
            if len(self._jobs) >= 64:  # many prompt lengths: drop the eager buffers (waits for queued runs), but
                # never a job a captured CUDA graph launches (its replays would find the buffers gone)
                self._jobs = {k: j for k, j in self._jobs.items() if j.captured}
            job = self._jobs[key] = _staging.HostJob(self.experts, torch, tokens, self.top_k, dtype, device)
        return job

    def check(self) -> None:
        """Raises RuntimeError if a run of the CPU experts handed over on a CUDA stream (doorbell or host
        function) failed since the last check (that step's routed output was NaN). Synchronise the
        stream first to see the latest step."""
        for job in self._jobs.values():
            err = job.error()
            if err:
                raise RuntimeError(f"HybridMoE: the CPU experts failed in an earlier step (its output was NaN): {err}")

    # --- state dict ----------------------------------------------------------------------------------------
    # The CPU experts are no module: without these a state dict held no routed expert (save_pretrained wrote a
    # checkpoint without them) and load_state_dict reported every key matched while they stayed as they were.
    # They travel packed (every ISA module packs the same layout) with their layout, which must match on load.

    _PACKED = ("experts.w13_packed", "experts.w2_packed", "experts.layout")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        e = self.experts
        for key, t in zip(self._PACKED, (e._w13, e._w2, torch.tensor(e._dims, dtype=torch.int64))):
            destination[prefix + key] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        keys = [prefix + k for k in self._PACKED]
        unexpected_keys[:] = [k for k in unexpected_keys if k not in keys]
        if not all(k in state_dict for k in keys):
            if strict:
                missing_keys.extend(k for k in keys if k not in state_dict)
            return
        w13, w2, layout = (state_dict[k] for k in keys)
        e = self.experts
        if layout.tolist() != list(e._dims) or w13.shape != e._w13.shape or w2.shape != e._w2.shape:
            error_msgs.append(f"HybridMoE {prefix!r}: the packed experts (format code, E, H, I, k groups) "
                              f"{layout.tolist()} do not fit this module's {list(e._dims)}: patch the model with the "
                              "same quant, group_size and gpu_experts as the one saved")
            return
        with torch.no_grad():
            e._w13.copy_(w13)
            e._w2.copy_(w2)

    def extra_repr(self) -> str:
        G = 0 if self.gpu_w13 is None else self.gpu_w13.shape[0]
        return (f"E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, top_k={self.top_k}, "
                f"groups={self.n_group}/{self.topk_group}, scoring={self.scoring}, cpu={self.experts!r}, "
                f"gpu_experts={G}")


def _check_device_weights(who: str, G: int, H: int, inter: int, w13, w2) -> None:
    """w13 [G, 2I, H] and w2 [G, H, I] must be float tensors: the weights of G experts computed on the device."""
    for name, t, want in (("w13", w13, (G, 2 * inter, H)), ("w2", w2, (G, H, inter))):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != want:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{who}: {name} must be float weights of shape {want} (the {G} experts' in sorted id "
                             f"order), got {got}")


def _split_ids(gpu_experts, E: int) -> list:
    """The sorted ids of gpu_experts given with their weights apart (gpu_weights): ids, at least one left."""
    if gpu_experts is None or is_int(gpu_experts):
        raise ValueError(f"HybridMoE: gpu_weights are the float weights of gpu_experts given as expert ids, got "
                         f"gpu_experts={gpu_experts!r}")
    gpu = _resolve_gpu_experts(gpu_experts, None, E)
    _cpu_ids(gpu, E)  # all E on the device is refused before the CPU experts' shapes are
    return gpu


def _cpu_ids(gpu: list, E: int) -> list:
    """The experts not in `gpu`, in id order; at least one must be left."""
    on_device = set(gpu)
    cpu = [e for e in range(E) if e not in on_device]
    if not cpu:
        raise ValueError(f"HybridMoE: gpu_experts keeps all {E} experts on the GPU; leave at least one on the "
                         "CPU (or use the model's own MoE block)")
    return cpu


def _resolve_gpu_experts(gpu_experts, routing_counts, E: int) -> list:
    if gpu_experts is None:
        return []
    if isinstance(gpu_experts, bool):
        raise TypeError("HybridMoE: gpu_experts must be a list of expert ids or a count, not a bool")
    if is_int(gpu_experts):  # a count, not expert ids
        n = int(gpu_experts)
        if not 0 <= n < E:
            raise ValueError(f"HybridMoE: gpu_experts = {n} must be in [0, {E}) (at least one expert on the CPU)")
        if n == 0:
            return []
        if routing_counts is None:
            raise ValueError("HybridMoE: gpu_experts as a count needs routing statistics: pass routing_counts ([E], "
                             "e.g. HybridMoE.routing_counts after some tokens), or use hmoe.nn.patch_model(..., "
                             "calibration=...), or give the expert ids")
        counts = torch.as_tensor(routing_counts).flatten().to("cpu", torch.float64)
        if counts.numel() != E:
            raise ValueError(f"HybridMoE: routing_counts has {counts.numel()} entries, expected E = {E}")
        if not counts.gt(0).any():
            raise ValueError("HybridMoE: routing_counts is all zero: no routing statistics to choose from")
        return sorted(torch.argsort(counts, descending=True, stable=True)[:n].tolist())
    if isinstance(gpu_experts, torch.Tensor):
        if gpu_experts.dim() == 0:  # a count or one id? Say which.
            raise TypeError(f"HybridMoE: gpu_experts is a 0-dim tensor ({gpu_experts.item()}): pass int(t) for a count "
                            "of experts or a 1-dim tensor / list for expert ids")
        gpu_experts = gpu_experts.flatten().tolist()
    try:
        ids = [operator.index(e) for e in gpu_experts]
    except TypeError:
        raise TypeError(f"HybridMoE: gpu_experts must be a list of int expert ids or an int count, got "
                        f"{gpu_experts!r}") from None
    bad = [e for e in ids if not 0 <= e < E]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(f"HybridMoE: gpu_experts {ids} must be distinct expert ids in [0, {E})")
    return sorted(ids)
