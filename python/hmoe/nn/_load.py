"""hmoe.nn.load_model: a DeepSeek-V2/V3 model straight from a safetensors checkpoint, its routed experts
read into hmoe's CPU experts one expert at a time (hmoe.load_experts): the model's expert weights are never
materialised together, and with quant= not even one layer's in float.

transformers' from_pretrained materialises every routed expert before patch_model can move it: for
DeepSeek-V3 that is about 1.3 TB in bf16, more than the GPU and most hosts hold. Here the model is built
without data (the meta device), each MoE block becomes a HybridMoE whose experts come from the checkpoint
(quantised as they are read when asked), and every other tensor is read by name onto the device; fp8
tensors (DeepSeek-V3/R1's block-scaled float8_e4m3fn with weight_scale_inv) are dequantised on the way.
"""
from __future__ import annotations

import re
import sys

import torch

from .. import checkpoint
from .._dtypes import name as dtype_name
from .._units import size_text
from ..hardware import cpu as _cpu
from ..ops import experts as _experts
from ..validation import is_int
from . import _hf
from .hybrid import _cpu_ids, _resolve_gpu_experts

WHO = "hmoe.nn.load_model"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def load_model(path: str, *, device="cuda", dtype=torch.bfloat16, quant: str | None = None,
               group_size: int | None = None, gpu_experts=None, calibration=None, isa: str | None = None,
               fuse_norms: bool = True, check_memory: bool = True, progress: bool = True):
    """A transformers DeepSeek-V2/V3 causal LM (eval mode) from the checkpoint directory `path` (its
    config.json and safetensors shards), patched as hmoe.nn.patch_model patches one: every MoE block a
    HybridMoE with its routed experts on the CPU, read from the checkpoint one expert at a time (quant
    "int8" / "int4" / "fp8" quantises each as it is read, group_size as hmoe.quant.quantize; None keeps
    `dtype`); everything else in `dtype` on `device` (where transformers keeps a tensor in fp32, e.g. the
    router, it stays fp32). fp8 checkpoints are dequantised with their weight_scale_inv (blocks of the
    config's weight_block_size, default 128 x 128). Tensors of the checkpoint the model has no place for
    (DeepSeek-V3's multi-token-prediction layer) are left unread; a tensor the model needs and the
    checkpoint lacks is an error. model.hmoe_report is the PatchReport (printed to stderr with progress).

    gpu_experts, as hmoe.nn.patch_model's: per MoE block, expert ids to compute on `device` instead of the CPU,
    or a count n chosen per block from routing statistics: the n busiest experts of one forward of the loaded
    model (every expert still on the CPU) on `calibration` (input ids, or a dict of model inputs; tensors are
    moved to `device`). The CPU experts keep the others, quantised or not as `quant` says. With ids, each block
    reads the others into its CPU experts and those ids in `dtype` onto `device` (HybridMoE's gpu_weights): no
    expert is read twice, and the host never holds the chosen ones packed. A count is chosen with every expert
    on the CPU, so its experts are read from the checkpoint again, in `dtype`, onto `device` after the forward
    (HybridMoE.keep_on_device).

    check_memory: before anything is read, the bytes the load will hold are counted from the config (the CPU
    experts' packed size in their format: with gpu_experts as ids the others only, with a count all of them;
    one MoE block's more while it is read and packed, or, on a CUDA device with experts kept there, while their
    float weights pass through the host, if that is more; with device="cpu" the other tensors and the experts
    kept there too; on a CUDA device the other tensors and the experts kept there) and a MemoryError
    names them, with the size of the experts in the other formats, when they exceed the host's available
    memory (Linux MemAvailable, or a container's memory cgroup limit where that leaves less) or the device's
    free memory. False skips the check (swap, or memory that will be freed meanwhile).
    """

    from .hybrid import HybridMoE

    if dtype not in _DTYPES:
        raise ValueError(f"{WHO}: dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    if quant not in (None, "int8", "int4", "fp8"):
        raise ValueError(f"{WHO}: quant must be None, 'int8', 'int4' or 'fp8', got {quant!r}")
    if quant is None and group_size is not None:
        raise ValueError(f"{WHO}: group_size={group_size!r} applies to quant='int8' or 'int4'")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{WHO}: device {device} asked for, but torch sees no CUDA device (device='cpu' loads it "
                         "all into host memory)")
    count = is_int(gpu_experts) and gpu_experts > 0
    if count:
        if calibration is None:
            raise ValueError(f"{WHO}: gpu_experts as a count is chosen from routing statistics: pass calibration= "
                             "(input ids or a dict of model inputs), or give expert ids")
        _hf._check_calibration(calibration, WHO)
    names = checkpoint._shards(path, WHO)
    config, model, blocks, block = _meta_model(path, dtype)
    reader = checkpoint._Reader(names, path, WHO)
    used = set()

    def fill(module, prefix: str) -> None:
        """module's parameters and persistent buffers that have no data yet, read from the checkpoint."""
        for name, t in list(module.named_parameters()) + _persistent_buffers(module):
            if not t.is_meta:
                continue
            key = prefix + name
            if key not in names:
                if key == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
                    continue  # tied to the embedding below
                raise ValueError(f"{WHO}: {key} (shape {tuple(t.shape)}) is missing from {path!r}")
            w = checkpoint._weight(reader, key, block)
            if tuple(w.shape) != tuple(t.shape):
                raise ValueError(f"{WHO}: {key} has shape {tuple(w.shape)} in {path!r}, the model expects "
                                 f"{tuple(t.shape)}: the checkpoint does not fit its config.json")
            used.add(key)
            _set(module, name, w.to(device=device, dtype=t.dtype))

    E = blocks[0][1].gate.weight.shape[0]
    fixed = [] if count or gpu_experts is None else _resolve_gpu_experts(gpu_experts, None, E)  # checked now
    if len(fixed) >= E or count and gpu_experts >= E:
        raise ValueError(f"{WHO}: gpu_experts keeps all {E} experts of a block on {device}; leave at least one on "
                         "the CPU")
    if check_memory:
        _check_memory(path, model, blocks, quant, group_size, dtype, block, isa,
                      gpu_experts if count else len(fixed), not count, device, progress)
    # each layer's expert tensors, indexed in one pass over the names (a scan of them all for every layer
    # took 18 s for DeepSeek-V3's 89k names)
    experts_of: dict = {}
    for k, f in names.items():
        at = k.find(".mlp.experts.")
        if at >= 0:
            experts_of.setdefault(k[:at + len(".mlp.experts.")], {})[k] = f
    reports, isa_name, placed = [], None, []
    for i, (name, moe) in enumerate(blocks):
        layer = _layer_of(name)
        if progress:
            onto = f": experts {fixed} onto {device}" if fixed else ""
            print(f"{WHO}: MoE block {i + 1} of {len(blocks)} ({name}){onto}", file=sys.stderr, flush=True)
        fill(moe.gate, name + ".gate.")
        if getattr(moe, "shared_experts", None) is not None:
            fill(moe.shared_experts, name + ".shared_experts.")
        expert_keys = experts_of.get(f"{name}.experts.", {})
        if not expert_keys:
            raise ValueError(f"{WHO}: {name}.experts.* (the routed experts of layer {layer}) are missing from "
                             f"{path!r}")
        # the names read once for all layers (load_experts would list the shards again for each); with ids, the
        # CPU experts read without them, and they in float for the device: no stack of every expert
        prefix, on_device = f"{name}.experts.", None
        w13, w2 = checkpoint._read_experts(expert_keys, path, layer, quant, group_size, None if quant else dtype,
                                           prefix, block, progress,
                                           only=_cpu_ids(fixed, moe.gate.weight.shape[0]) if fixed else None)
        if fixed:
            on_device = checkpoint._read_experts(expert_keys, path, layer, None, None, dtype, prefix, block, progress,
                                                 only=fixed)
        used.update(expert_keys)
        hybrid = HybridMoE(moe.gate.weight.detach(), w13, w2, shared_experts=getattr(moe, "shared_experts", None),
                           gpu_experts=fixed or None, gpu_weights=on_device, isa=isa, **_hf.router_options(moe.gate))
        del w13, w2, on_device
        _hf._set_submodule(model, name, hybrid)
        placed.append((name, layer, hybrid, expert_keys))
        isa_name = hybrid.experts.isa
        reports.append(_hf.BlockReport(name, hybrid.num_experts, list(fixed), reader.dtype(min(expert_keys)),
                                       "the checkpoint", hybrid.experts.packed_bytes, hybrid.experts.format))
    fill(model, "")
    for name, mod in list(model.named_modules()):  # non-persistent buffers (the rotary embedding's frequencies)
        if any(b.is_meta for b in mod.buffers(recurse=False)) and type(mod).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):  # their constructors compute them (some take no device argument)
                _hf._set_submodule(model, name, type(mod)(getattr(mod, "config", model.config)))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{WHO}: {len(left)} tensors of the model were not filled: {left[:5]}")
    norms = _hf._fuse_norms(model) if fuse_norms else 0
    model.eval()
    if count:
        _place_experts(model, placed, reports, gpu_experts, calibration, path, dtype, device, block, progress)
    unread = len([k for k in names if k not in used and not k.endswith("_scale_inv")])
    report = _hf.PatchReport(reports, 0, isa_name, str(device), 0, norms, who=WHO, unread=unread)
    model.hmoe_report = report
    if progress:
        print(report, file=sys.stderr, flush=True)
    return model


def _meta_model(path: str, dtype):
    """(config, the model built from path's config.json on the meta device, its DeepSeek MoE blocks as (name,
    module), the fp8 block size of its quantization_config or (128, 128))."""
    import os

    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):  # transformers would look for it on the Hub
        raise FileNotFoundError(f"{WHO}: {path!r} is not a checkpoint directory: it has no config.json")
    config = transformers.AutoConfig.from_pretrained(path)
    if getattr(config, "model_type", None) not in ("deepseek_v2", "deepseek_v3"):
        raise ValueError(f"{WHO}: {path!r} holds a {getattr(config, 'model_type', '?')!r} model; this loader reads "
                         "DeepSeek-V2/V3 checkpoints (others: transformers' from_pretrained, then patch_model)")
    qcfg = getattr(config, "quantization_config", None)  # DeepSeek-V3's fp8: dequantised here, not by transformers
    size = qcfg.get("weight_block_size") if isinstance(qcfg, dict) else getattr(qcfg, "weight_block_size", None)
    block = tuple(size or (128, 128))
    if qcfg is not None:
        del config.quantization_config
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers 4 names it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    blocks = [(n, m) for n, m in model.named_modules() if _hf.is_moe_block(m)]
    if not blocks:
        raise ValueError(f"{WHO}: the model built from {path!r} has no DeepSeek MoE block")
    return config, model, blocks, block


def _sizes(model, blocks, dtype) -> dict:
    """What a load of the meta `model` holds besides the CPU experts' packed bytes: "shapes" per block
    (experts, H, I); "other": the tensors besides the routed experts, in the dtypes the model gives them;
    "expert_float": one expert in `dtype`, per block."""
    shapes = [_hf.expert_dims(moe.experts)[:3] for _, moe in blocks]
    routed = {id(t) for _, moe in blocks for t in moe.experts.parameters()}
    tensors = list(model.parameters()) + [b for _, b in _persistent_buffers(model)]
    other = sum(t.numel() * t.element_size() for t in tensors if id(t) not in routed)
    return {"shapes": shapes, "other": other, "expert_float": [3 * H * I * dtype.itemsize for _, H, I in shapes]}


def _check_memory(path, model, blocks, quant, group_size, dtype, block, isa, n_gpu: int, by_id: bool, device,
                  progress) -> None:
    """The MemoryError of load_model's check_memory (see there), or a line on what the load will take; n_gpu
    experts a block kept on the device, by_id: given as ids (never among the CPU experts) rather than a count."""
    mod = _experts.module(_experts.select(isa))  # an isa this CPU cannot run is refused here, before any read
    sizes = _sizes(model, blocks, dtype)
    shapes, other = sizes["shapes"], sizes["other"]
    try:
        per = [_hf._expert_bytes(quant, group_size, dtype, block, H, I, mod) for _, H, I in shapes]
    except ValueError:
        return  # a format the kernels do not take (fp8 blocks of other widths): the load says so in its words
    # ids given: a block's CPU experts are read without them; a count is chosen with every expert on the CPU
    on_cpu = [E - n_gpu if by_id else E for E, _, _ in shapes]
    experts = sum(n * b for n, b in zip(on_cpu, per))
    held = max(n * b for n, b in zip(on_cpu, per))  # a block's stacks beside their packed copy
    if device.type == "cuda" and n_gpu:  # the kept experts' float weights are read on the host first, beside a
        # block's CPU stacks (ids) or beside the subset copy of its CPU experts (a count, keep_on_device)
        held = max(held, max((E - n_gpu) * b + n_gpu * f
                             for (E, _, _), b, f in zip(shapes, per, sizes["expert_float"])))
    gpu = n_gpu * sum(sizes["expert_float"])
    host = experts + held + (other + gpu if device.type == "cpu" else 0)
    avail = _cpu.mem_available_bytes()
    fmt = quant or dtype_name(dtype)
    if avail and host > avail:
        on = f", and the model's other tensors {size_text(other + gpu)}" if device.type == "cpu" else ""
        raise _hf._host_memory_error(
            f"{WHO}: not enough host memory for {path!r}: its routed experts take {size_text(experts)} packed as {fmt} "
            f"({len(blocks)} MoE blocks; {size_text(per[0])} an expert), {size_text(held)} more while a block is read{on}: "
            f"{size_text(host)} in all", avail, quant, dtype, block, shapes, mod)
    line = f"{WHO}: routed experts {size_text(experts)} packed as {fmt} on the CPU (+{size_text(held)} while a block is read"
    line += f"; {size_text(avail)} available)" if avail else ")"
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        free, _ = torch.cuda.mem_get_info(device)
        if other + gpu > free:
            kept = f", the {n_gpu} experts a block kept there {size_text(gpu)}" if gpu else ""
            raise MemoryError(
                f"{WHO}: not enough memory on {device} for {path!r}: the model's tensors other than the routed "
                f"experts take {size_text(other)}{kept}, and {size_text(free)} of it is free; free some, keep fewer experts "
                "there (gpu_experts=), or pass check_memory=False to go ahead anyway")
        line += f"; {size_text(other + gpu)} onto {device} ({size_text(free)} free)"
    if progress:
        print(line, file=sys.stderr, flush=True)


def memory_needs(path: str, dtype=torch.bfloat16, isa: str | None = None) -> dict:
    """What load_model(path) would hold, from path's config.json alone (no weights read): hmoe.compat's
    --model. JSON-ready: the model type, MoE blocks, experts a block, H, I; per CPU-experts format its packed
    bytes and the largest block's (null where the kernels cannot take the shapes); the other tensors' bytes;
    one expert's in dtype; the host's available bytes (0: unknown); and each CUDA device's free bytes."""
    config, model, blocks, block = _meta_model(path, dtype)
    mod = _experts.module(_experts.select(isa))
    sizes = _sizes(model, blocks, dtype)
    (E, H, I), shapes = sizes["shapes"][0], sizes["shapes"]
    totals = _hf._format_totals((None, "int8", "int4", "fp8"), dtype, block, shapes, mod)
    devices = []
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(d)
            devices.append({"device": f"cuda:{d}", "free_bytes": free, "total_bytes": total})
    return {"path": path, "model_type": config.model_type, "dtype": dtype_name(dtype),
            "moe_blocks": len(shapes), "experts": E, "hidden_size": H, "intermediate_size": I,
            "fp8_block": list(block),
            "formats": {q or dtype_name(dtype): None if t is None else
                        {"experts_bytes": t[0], "block_bytes": t[1]} for q, t in totals.items()},
            "other_bytes": sizes["other"], "expert_float_bytes": sizes["expert_float"][0],
            "host_available_bytes": _cpu.mem_available_bytes(), "devices": devices}


def _place_experts(model, placed, reports, count: int, calibration, path, dtype, device, block, progress) -> None:
    """Moves the `count` busiest experts of every placed block on a forward of `calibration` to the device,
    their float weights read from the checkpoint again."""
    _hf._calibrate(model, _to(calibration, device))  # counted from zero: nothing ran since construction
    for (name, layer, hybrid, keys), report in zip(placed, reports):
        ids = _resolve_gpu_experts(count, hybrid.routing_counts, hybrid.num_experts)
        if progress:
            print(f"{WHO}: {name}: experts {ids} onto {device}", file=sys.stderr, flush=True)
        w13, w2 = checkpoint._read_experts(keys, path, layer, None, None, dtype, f"{name}.experts.", block, progress,
                                           only=ids)
        hybrid.keep_on_device(ids, w13, w2)
        report.gpu_experts, report.packed_bytes = ids, hybrid.experts.packed_bytes


def _to(inputs, device):
    if isinstance(inputs, dict):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return inputs.to(device)


def _persistent_buffers(module) -> list:
    out = []
    for mod_name, mod in module.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out.append(((mod_name + "." if mod_name else "") + name, b))
    return out


def _set(module, name: str, t) -> None:
    owner, _, attr = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    if attr in mod._parameters:
        mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
    else:
        mod._buffers[attr] = t


def _layer_of(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name + ".")
    if m is None:
        raise ValueError(f"{WHO}: cannot tell the layer of MoE block {name!r}")
    return int(m.group(1))
