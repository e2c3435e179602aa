"""hmoe.load_experts: one layer's routed experts read straight from a safetensors checkpoint.

Layouts read (for layer N, prefix "model.layers.N.mlp.experts." unless `prefix` says otherwise):
  * per expert, as DeepSeek-V2/V3 and transformers' save_pretrained write them:
    "{e}.gate_proj.weight" [I, H], "{e}.up_proj.weight" [I, H], "{e}.down_proj.weight" [H, I], with
    "{e}.*.weight_scale_inv" [ceil(rows/128), ceil(cols/128)] beside float8_e4m3fn weights (DeepSeek-V3/R1);
  * fused, as transformers 5 holds them in memory: "gate_up_proj" [E, 2I, H] and "down_proj" [E, H, I],
    in a float dtype. Fused float8_e4m3fn is refused: DeepSeek's fp8 checkpoints are per expert, and the
    "*_scale_inv" written beside fused fp8 stacks comes in several layouts (per 128x128 block of [2I, H],
    per projection, per tensor) that the shapes alone cannot always tell apart.
Tensors are read one expert at a time from the shard that holds them (model.safetensors.index.json
when present), converted or quantised, and written into the result, so no more than one expert is
held unconverted at a time. Every expert must have expert 0's shapes; a missing tensor, a corrupt
index or tensors that do not fit each other are errors that name the tensor and the checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import sys

from .validation import is_int


def _shards(path: str, who: str = "load_experts") -> dict:
    """tensor name -> shard file for a checkpoint directory or a single .safetensors file; `who` starts
    the messages."""
    from safetensors import SafetensorError, safe_open

    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    contents = json.load(f)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"{who}: {index} is not valid JSON: {e}") from None
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{who}: {index} has no \"weight_map\" of tensor name -> shard file")
            return {k: os.path.join(path, v) for k, v in weight_map.items()}
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    else:
        raise FileNotFoundError(f"{who}: {path!r} is neither a checkpoint directory nor a .safetensors file")
    if not files:
        raise FileNotFoundError(f"{who}: no .safetensors file in {path!r}")
    names = {}
    for f in files:
        try:
            with safe_open(f, "pt") as s:
                names.update({k: f for k in s.keys()})
        except SafetensorError as e:
            raise ValueError(f"{who}: {f!r} is not a safetensors file ({e})") from None
    return names


class _Reader:
    """Reads tensors by name, keeping the shard that served the last one open; `path` and `where` (what
    reads them: "load_experts: layer 3") are for the messages."""

    def __init__(self, names: dict, path: str, where: str):
        self.names, self.path, self.where, self._file, self._handle, self._keys = names, path, where, None, None, set()

    def _open(self, name: str):
        from safetensors import safe_open

        if name not in self.names:
            raise ValueError(f"{self.where}: {name} is missing from {self.path!r}")
        f = self.names[name]
        if f != self._file:
            self._handle, self._file = safe_open(f, "pt"), f
            self._keys = set(self._handle.keys())
        if name not in self._keys:  # the index names a shard that does not hold it
            raise ValueError(f"{self.where}: {name} is not in {f}, the shard "
                             f"model.safetensors.index.json names for it")
        return self._handle

    def shape(self, name: str) -> tuple:
        return tuple(self._open(name).get_slice(name).get_shape())

    def dtype(self, name: str):
        """The tensor's dtype, from an empty slice: no data read."""
        return self._open(name).get_slice(name)[0:0].dtype

    def get(self, name: str, expert: int | None = None):
        """The tensor, or only its matrix `expert` when it is a fused [E, ...] stack."""
        h = self._open(name)
        return h.get_tensor(name) if expert is None else h.get_slice(name)[expert:expert + 1][0]


def _weight(reader, name: str, block, expert: int | None = None, keep_fp8: bool = False):
    """A weight in its float dtype, or an fp8 one dequantised with its scales (fp32; with keep_fp8, as
    hmoe.quant.from_fp8's QuantizedWeights, for int8 / int4 to quantise from its bytes); `expert`: one matrix
    of a fused stack, which must be a float (see the module docstring). Callers convert as they store it
    (a bf16 weight through fp32 on the way was two more copies of it)."""
    import torch

    from . import quant

    w = reader.get(name, expert)
    scale = name.removesuffix(".weight") + ".weight_scale_inv"
    if w.dtype == torch.float8_e4m3fn:
        if expert is not None:
            raise TypeError(f"{reader.where}: {name} is a fused float8_e4m3fn stack, which hmoe does not read: "
                            "its scales' layout is not fixed; use per-expert tensors with weight_scale_inv "
                            "(DeepSeek-V3's layout) or a float dtype")
        if scale not in reader.names:
            raise ValueError(f"{reader.where}: {name} is float8_e4m3fn but {scale} is missing")
        qw = quant.from_fp8(w, reader.get(scale), block)
        return qw if keep_fp8 else quant.dequantize(qw)
    if not w.is_floating_point():
        want = "a float" if expert is not None else "a float or float8_e4m3fn"
        raise TypeError(f"{reader.where}: {name} has dtype {w.dtype}; expected {want} weight")
    if scale in reader.names:  # scales beside another dtype: what they mean is not known, so not guessed
        raise ValueError(f"{reader.where}: {name} has dtype {w.dtype} but {scale} beside it; hmoe applies "
                         "weight_scale_inv to float8_e4m3fn weights only")
    return w


def load_experts(path: str, layer: int, *, quant: str | None = None, group_size: int | None = None,
                 dtype=None, prefix: str | None = None, fp8_block=(128, 128), progress: bool = True):
    """(w13 [E, 2I, H], w2 [E, H, I]) of one layer's routed experts, ready for hmoe.CPUExperts.

    quant=None: tensors in `dtype` (default: the checkpoint's float dtype; bfloat16 for fp8
    checkpoints). quant="int8" / "int4" / "fp8": hmoe.quant.QuantizedWeights of the whole stack,
    quantised one expert at a time (group_size as in hmoe.quant.quantize; "fp8" re-blocks with
    `fp8_block`). fp8 checkpoints are dequantised with their weight_scale_inv first.
    """
    import torch

    if not is_int(layer) or layer < 0:
        raise ValueError(f"load_experts: layer must be a non-negative int, got {layer!r}")
    layer = int(layer)
    if quant not in (None, "int8", "int4", "fp8"):
        raise ValueError(f"load_experts: quant must be None, 'int8', 'int4' or 'fp8', got {quant!r}")
    if quant is None and group_size is not None:
        raise ValueError(f"load_experts: group_size={group_size!r} applies to quant='int8' or 'int4'; with quant=None "
                         "the experts come back as float tensors")
    if dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"load_experts: dtype must be None (the checkpoint's), torch.float32, torch.float16 or "
                         f"torch.bfloat16 (hmoe.CPUExperts' float weights), got {dtype!r}")
    try:
        names = _shards(path)
    except ImportError as e:
        raise ImportError(f"load_experts needs the safetensors package: {e}") from None
    return _read_experts(names, path, layer, quant, group_size, dtype, prefix, fp8_block, progress)


def _read_experts(names: dict, path: str, layer: int, quant, group_size, dtype, prefix, fp8_block, progress: bool,
                  only: list | None = None):
    """load_experts with its arguments checked and the checkpoint's tensor names (_shards) in hand; `only`: just
    these experts (ids in the layer), stacked in that order."""
    import torch

    from . import quant as q

    pre = prefix if prefix is not None else f"model.layers.{layer}.mlp.experts."
    reader = _Reader(names, path, f"load_experts: layer {layer}")
    ids = sorted({int(m.group(1)) for k in names if (m := re.match(re.escape(pre) + r"(\d+)\.", k))})
    gu_name, down_name = pre + "gate_up_proj", pre + "down_proj"
    fused = gu_name in names or down_name in names
    if not ids and not fused:
        near = sorted({k.split(".mlp.experts.")[0] for k in names if ".mlp.experts." in k},
                      key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)])[:5]
        raise KeyError(f"load_experts: no routed experts under {pre!r} in {path!r} (MoE layers seen: "
                       f"{near or 'none'})")
    if fused:
        gs, ds = reader.shape(gu_name), reader.shape(down_name)
        if len(gs) != 3 or len(ds) != 3 or gs[0] < 1 or gs[0] != ds[0] or gs[1:] != (2 * ds[2], ds[1]):
            raise ValueError(f"load_experts: layer {layer}: {gu_name} {gs} and {down_name} {ds} do not fit "
                             "[E, 2I, H] and [E, H, I] with the same E >= 1")
        E = gs[0]
        get = (lambda e: ([_weight(reader, gu_name, fp8_block, e)], _weight(reader, down_name, fp8_block, e)))
        src_dtype = reader.dtype(gu_name)
    else:
        E = len(ids)
        if ids != list(range(E)):
            missing = sorted(set(range(ids[-1] + 1)) - set(ids))
            raise ValueError(f"load_experts: experts {missing[:10]} of layer {layer} are missing from {path!r}")
        first = {}  # expert 0's shapes, which every expert must have (copy_ would broadcast a column)

        def get(e):
            ws = {n: _weight(reader, f"{pre}{e}.{n}.weight", fp8_block, keep_fp8=quant in ("int8", "int4"))
                  for n in ("gate_proj", "up_proj", "down_proj")}
            for n, w in ws.items():
                if w.shape != first.setdefault(n, w.shape):
                    raise ValueError(f"load_experts: layer {layer}, expert {e}: {pre}{e}.{n}.weight has shape "
                                     f"{tuple(w.shape)}, expected {tuple(first[n])} (expert 0's)")
            g, u, d = ws.values()
            if g.shape != u.shape or d.shape != (g.shape[1], g.shape[0]):
                raise ValueError(f"load_experts: layer {layer}, expert {e}: gate {tuple(g.shape)}, up "
                                 f"{tuple(u.shape)}, down {tuple(d.shape)} do not fit [I, H], [I, H], [H, I]")
            return [g, u], d

        src_dtype = reader.dtype(f"{pre}0.gate_proj.weight")
    if dtype is None:
        dtype = torch.bfloat16 if src_dtype == torch.float8_e4m3fn else src_dtype
    if only is not None and not all(0 <= e < E for e in only):
        raise ValueError(f"load_experts: layer {layer} has {E} experts; asked for {list(only)}")
    chosen = range(E) if only is None else list(only)
    n = len(chosen)  # matrices in the stacks
    bar = _bar(n, f"layer {layer} experts", progress)
    w13 = w2 = None
    for i, e in enumerate(chosen):
        # w13's rows in parts (gate, then up; or both fused), written into the stack with no concatenated copy
        # on the way (the checkpoint's tensors are read as they are first touched, here)
        parts, b = get(e)
        if quant == "fp8" and len(parts) > 1:  # fp8's blocks of rows may span gate and up
            parts = [torch.cat(parts)]
        starts = _starts(parts)
        shape13 = (n, starts[-1] + parts[-1].shape[0], parts[0].shape[1])
        if quant is None:
            if w13 is None:
                w13 = torch.empty(shape13, dtype=dtype)
                w2 = torch.empty((n, *b.shape), dtype=dtype)
            # one cat into the stack: copying gate and up into their rows, straight from the mapped shards, made a
            # bf16 load_model of 9.6 GiB 3-5 s slower on an H200 machine's host
            torch.cat(parts, out=w13[i])
            w2[i].copy_(b)
        elif quant == "fp8":  # group_size with fp8 (scaled per block) is quantize's error, not ignored
            qa, qb = (q.quantize(w, quant, group_size=group_size, block=fp8_block) for w in (parts[0], b))
            if w13 is None:
                w13, w2 = _stack_like(qa, n), _stack_like(qb, n)
            for dst, src in ((w13, qa), (w2, qb)):
                dst.data[i].copy_(src.data)
                dst.scales[i].copy_(src.scales)
        else:  # int8 / int4, quantised row by row straight into the stacks (gate and up apart: the same bits)
            if w13 is None:
                w13, w2 = q._empty(shape13, quant, group_size), q._empty((n, *b.shape), quant, group_size)
            for dst, r, w in [(w13, r, p) for r, p in zip(starts, parts)] + [(w2, 0, b)]:
                if not isinstance(w, q.QuantizedWeights):  # fp8 ones: from_fp8 has checked their bytes
                    q._check_float(w, "load_experts")
                r1 = r + w.shape[0]
                rows = q.QuantizedWeights(quant, dst.data[i, r:r1], dst.scales[i, r:r1], w.shape,
                                          group_size=dst.group_size)
                q._quantize_into(w, rows)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return w13, w2


def _starts(parts) -> list:
    """The first row of each of parts stacked along their first dimension."""
    out, r = [], 0
    for p in parts:
        out.append(r)
        r += p.shape[0]
    return out


def _stack_like(qw, E: int):
    import torch

    from .quant import QuantizedWeights

    return QuantizedWeights(qw.format, torch.empty((E, *qw.data.shape), dtype=qw.data.dtype),
                            torch.empty((E, *qw.scales.shape), dtype=qw.scales.dtype), (E, *qw.shape),
                            group_size=qw.group_size, block=qw.block)


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"hmoe: {desc}", unit="expert", file=sys.stderr)
