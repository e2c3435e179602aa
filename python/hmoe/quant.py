"""hmoe.quant: quantised expert weights (int8, int4, DeepSeek's block-scaled fp8).

A weight is a matrix [N, K] (or a stack of them, [..., N, K], e.g. every expert's w13 [E, 2I, H]),
quantised along K, its reduction dimension, symmetrically with round-to-nearest-even (w read as fp32;
scale and quotient computed in fp32):

  int8  per output row (group_size=None, the default) or per group of 32/64/128 along K:
        q = round(w / s) in [-127, 127], s = max|w| / 127 over the row or group.
  int4  per group of 32/64/128 along K (default 128): q = round(w / s) in [-7, 7],
        s = max|w| / 7; two values per byte, element 2j in the low nibble, 2j + 1 in the high one.
  fp8   float8_e4m3fn with one fp32 scale per block of (128, 128) [N, K] elements, DeepSeek-V3/R1's
        checkpoint format (weight_scale_inv): w = fp8 * scale. The blocks at the matrix's edges are
        partial (scales [..., ceil(N/rows), ceil(K/cols)]); a block larger than the matrix covers it whole.

The scales are fp32; the dequantised weight is q * s in fp32. A group or block whose weights are all
zero has scale 0. QuantizedWeights pickles (plain tensors, fp8's as their bytes, and a version number).
On the CPU, quantize to int8 / int4, from_fp8(..., to=) and fp8's dequantize run natively, row by row on
hmoe's CPU threads, with no fp32 copy of the weights; weights elsewhere, and quantize to fp8, go through torch
ops in pieces of about 16M weights, so that the fp32 temporaries stay a few hundred MB whatever the stack's size
(a DeepSeek-V3 layer's 256 experts are 5.6G weights a matrix). Both give the same bits.

hmoe.CPUExperts takes QuantizedWeights for w13 and w2 (the same format for both); its kernels work
in k groups of `kernel_group` (the group size; for int8 per row the whole row, K rounded up to a
multiple of 128; fp8's block columns, which must then be 32, 64 or 128), the unit in which they also
quantise the activations (the precision contract is in hmoe.ops.experts).
"""
from __future__ import annotations

import math

from .validation import is_int

FORMATS = ("int8", "int4", "fp8")
GROUP_SIZES = (32, 64, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_QMAX = {"int8": 127, "int4": 7}


class QuantizedWeights:
    """Quantised weights of logical shape `shape` ([..., N, K]); see the module docstring.

    format: "int8", "int4" or "fp8"; group_size: K elements per scale (int8 per row: None; fp8: None,
    see block); block: fp8's (rows, columns) per scale; data: int8 [..., N, K] (int8), uint8
    [..., N, K/2] (int4) or float8_e4m3fn [..., N, K] (fp8); scales: fp32 [..., N, K/group]
    (int8 per row: [..., N, 1]) or [..., ceil(N/rows), ceil(K/cols)] (fp8).
    """

    # 2: float8 data travels as its bytes and dtype name (plain pickle cannot load float8 tensors; torch.save
    # and deepcopy can). Version 1 states (int8 and int4 only: fp8 ones never loaded) read the same way.
    _STATE_VERSION = 2

    def __init__(self, format: str, data, scales, shape, *, group_size: int | None = None, block=None):
        if format not in FORMATS:
            raise ValueError(f"QuantizedWeights: unknown format {format!r}; expected one of {FORMATS}")
        self.format, self.data, self.scales = format, data, scales
        self.shape, self.group_size = tuple(int(d) for d in shape), group_size
        self.block = None if block is None else (int(block[0]), int(block[1]))

    @property
    def nbytes(self) -> int:
        """Bytes of the quantised values and their scales."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def bits_per_weight(self) -> float:
        """Bits a weight takes, its share of the scales included: one matrix's layout (every matrix of a
        stack has the same), so that an empty stack has one too."""
        matrix = (math.prod(self.data.shape[-2:]) * self.data.element_size()
                  + math.prod(self.scales.shape[-2:]) * self.scales.element_size())
        weights = math.prod(self.shape[-2:])
        return 8 * matrix / weights if weights else math.nan

    @property
    def kernel_group(self) -> int:
        """k per group in hmoe's CPU kernels: the group size; for int8 per row the whole row (K
        rounded up to a multiple of 128: one activation scale a row, one scaling of each dot
        product); fp8's block columns."""
        return _kernel_group(self.format, self.shape[-1], self.group_size, self.block)

    def dequantize(self):
        return dequantize(self)

    def __getstate__(self):
        import torch

        data, data_dtype = self.data, None
        if data.dtype.is_floating_point and data.element_size() == 1:  # float8
            data, data_dtype = data.view(torch.uint8), str(data.dtype).removeprefix("torch.")
        return {"version": self._STATE_VERSION, "format": self.format, "data": data, "data_dtype": data_dtype,
                "scales": self.scales, "shape": self.shape, "group_size": self.group_size, "block": self.block}

    def __setstate__(self, state):
        import torch

        if not isinstance(state, dict) or state.get("version") not in (1, self._STATE_VERSION):
            raise ValueError("unpickling QuantizedWeights: written by another hmoe version; quantise the weights again")
        data, data_dtype = state["data"], state.get("data_dtype")
        if data_dtype is not None:
            dtype = getattr(torch, data_dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unpickling QuantizedWeights: the data's dtype {data_dtype} does not exist in torch "
                                 f"{torch.__version__}")
            data = data.view(dtype)
        self.__init__(state["format"], data, state["scales"], state["shape"],
                      group_size=state["group_size"], block=state["block"])

    def __repr__(self):
        how = (f"block={self.block}" if self.format == "fp8" else
               f"group_size={self.group_size if self.group_size else 'per row'}")
        return (f"QuantizedWeights({self.format}, shape={list(self.shape)}, {how}, "
                f"{self.bits_per_weight:.2f} bits/weight)")


def _check_float(w, what: str) -> None:
    import torch

    if not isinstance(w, torch.Tensor) or type(w) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"{what}: expected a torch tensor, got {type(w).__name__}")
    if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{what}: weights must be float32, float16 or bfloat16, got {w.dtype}")
    if w.dim() < 2 or w.shape[-1] == 0 or w.shape[-2] == 0:
        raise ValueError(f"{what}: expected weights [..., N, K] with N, K >= 1, got shape {tuple(w.shape)}")


_PIECE = 1 << 24  # weights quantised at a time (64 MB in fp32)


def _pieces(L: int, N: int, K: int, rows_multiple: int):
    """Slices (l0, l1, n0, n1) of weights viewed as [L, N, K], in order, each about _PIECE weights:
    several whole matrices, or a run of rows of one (a multiple of rows_multiple rows, so that fp8's
    blocks never straddle two pieces)."""
    if N * K <= _PIECE:
        step = max(1, _PIECE // (N * K))
        for l0 in range(0, L, step):
            yield l0, min(L, l0 + step), 0, N
        return
    rows = max(rows_multiple, _PIECE // K // rows_multiple * rows_multiple)
    for l0 in range(L):
        for n0 in range(0, N, rows):
            yield l0, l0 + 1, n0, min(N, n0 + rows)


def _finite_f32(piece, what: str):
    import torch

    wf = piece.float()
    if not torch.isfinite(wf).all():
        raise ValueError(f"{what}: the weights hold NaN or infinity; they cannot be quantised")
    return wf


def _kernel_group(fmt: str, K: int, group_size, block) -> int:
    """QuantizedWeights.kernel_group of weights with K columns (group_size as stored: None for int8 per row)."""
    if fmt == "fp8":
        return block[1]
    return group_size or -(-K // 128) * 128


def _group(fmt: str, K: int, group_size):
    if group_size is None:
        if fmt == "int4":
            group_size = 128
        else:
            return None
    if not is_int(group_size):
        raise TypeError(f"quantize: group_size must be an int (one of {GROUP_SIZES})"
                        + (" or None (per row)" if fmt == "int8" else "")
                        + f", got {group_size!r} of type {type(group_size).__name__}")
    group_size = int(group_size)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantize: group_size must be one of {GROUP_SIZES}"
                         + (" or None (per row)" if fmt == "int8" else "") + f", got {group_size!r}")
    if K % group_size:
        raise ValueError(f"quantize: K = {K} (the last dimension) is not a multiple of group_size {group_size}")
    return group_size


def _block_scales(wf, block, qmax):
    """amax / qmax per (rows, cols) block of the last two dims, shape [..., ceil(N/r), ceil(K/c)]."""
    import torch

    N, K = wf.shape[-2:]
    # A block larger than the matrix covers it whole: padding stays under one block within the matrix's
    # size (the scales are the same; block=(2**20, 2**20) would otherwise pad to terabytes).
    r, c = min(block[0], N), min(block[1], K)
    pn, pk = -N % r, -K % c
    padded = torch.nn.functional.pad(wf.abs(), (0, pk, 0, pn))
    lead = padded.shape[:-2]
    blocks = padded.reshape(*lead, (N + pn) // r, r, (K + pk) // c, c)
    return blocks.amax(dim=(-3, -1)) / qmax


def _expand_blocks(scales, block, N: int, K: int):
    r, c = min(block[0], N), min(block[1], K)  # as in _block_scales
    return scales.repeat_interleave(r, dim=-2)[..., :N, :].repeat_interleave(c, dim=-1)[..., :K]


def quantize(w, format: str, *, group_size: int | None = None, block=(128, 128)) -> QuantizedWeights:
    """Quantises w [..., N, K] (fp32/fp16/bf16, any device) along K; see the module docstring.
    group_size: int8 None (per row, default) or 32/64/128; int4 32/64/128 (default 128). fp8 uses
    `block` (rows, columns) per scale instead."""
    import torch

    if format not in FORMATS:
        raise ValueError(f"quantize: unknown format {format!r}; expected one of {FORMATS}")
    _check_float(w, "quantize")
    *lead, N, K = w.shape
    L = math.prod(lead)
    w3 = w.detach().reshape(L, N, K)
    if format == "fp8":
        if group_size is not None:
            raise ValueError("quantize: fp8 is scaled per block (block=(rows, cols)), not per group")
        block = _check_block(block)
        r, c = block
        q = torch.empty((L, N, K), dtype=torch.float8_e4m3fn, device=w.device)
        scales = torch.empty((L, -(-N // r), -(-K // c)), dtype=torch.float32, device=w.device)
        for l0, l1, n0, n1 in _pieces(L, N, K, r):
            wf = _finite_f32(w3[l0:l1, n0:n1], "quantize")
            s = _block_scales(wf, block, FP8_MAX)
            full = _expand_blocks(s, block, n1 - n0, K)
            q[l0:l1, n0:n1] = torch.where(full > 0, wf / torch.where(full > 0, full, 1.0), 0.0).to(torch.float8_e4m3fn)
            scales[l0:l1, n0 // r:n0 // r + s.shape[-2]] = s
        return QuantizedWeights("fp8", q.reshape(w.shape), scales.reshape(*lead, *scales.shape[1:]), w.shape,
                                block=block)
    out = _empty(w.shape, format, group_size, w.device)
    _quantize_into(w, out)
    return out


def _empty(shape, format: str, group_size, device="cpu") -> QuantizedWeights:
    """Uninitialised int8 / int4 QuantizedWeights of logical shape [..., N, K] (group_size checked as quantize
    checks it)."""
    import torch

    K = shape[-1]
    g = _group(format, K, group_size)
    if format == "int4" and K % 2:
        raise ValueError(f"quantize: int4 needs an even K, got {K}")
    q = torch.empty((*shape[:-1], K // 2 if format == "int4" else K),
                    dtype=torch.uint8 if format == "int4" else torch.int8, device=device)
    scales = torch.empty((*shape[:-1], K // (g or K)), dtype=torch.float32, device=device)
    return QuantizedWeights(format, q, scales, shape, group_size=g)


def _quantize_into(src, out: QuantizedWeights) -> None:
    """quantize of weights [..., N, K] into int8 / int4 `out` of that shape, whose data and scales may be views
    (e.g. one expert's rows of a stack: hmoe.load_experts fills its stacks so, with no copy). src: float
    weights, or fp8 QuantizedWeights (from_fp8's), quantised from their fp32 values (on the CPU without an fp32
    copy of them)."""
    *lead, N, K = src.shape
    L = math.prod(lead)
    q, scales = out.data.view(L, N, out.data.shape[-1]), out.scales.view(L, N, out.scales.shape[-1])
    fp8 = isinstance(src, QuantizedWeights)
    if (src.data if fp8 else src).device.type != "cpu":
        w3 = (dequantize(src) if fp8 else src.detach()).reshape(L, N, K)
        _quantize_torch(w3, out.format, out.group_size or K, q, scales)
        return
    import torch

    from ._native import spec

    mod, threads = _native()
    code = spec.constants()[f"weight_format_{out.format}"]
    weights = _fp8_args(src) if fp8 else (src.detach().reshape(L, N, K).contiguous(), None, 0, 0)
    mod.quantize_weights(*weights, code, out.group_size or K, q.view(torch.uint8), scales, threads)


def _fp8_args(qw: QuantizedWeights):
    """The native entry points' view of fp8 weights [..., N, K]: (bytes [L, N, K], scales fp32 [L, ...], block rows,
    block columns), the block bounded by the matrix (a block larger than it covers it whole)."""
    import torch

    N, K = qw.shape[-2:]
    L = math.prod(qw.shape[:-2])
    return (qw.data.reshape(L, N, K).view(torch.uint8).contiguous(),
            qw.scales.float().reshape(L, *qw.scales.shape[-2:]).contiguous(), min(qw.block[0], N), min(qw.block[1], K))


def _native():
    """The experts module of this CPU (its quantisation entry points) and hmoe's thread count."""
    from ._threads import get_num_threads
    from .ops import experts

    return experts.module(experts.select()), get_num_threads()


def _quantize_torch(w3, format: str, gk: int, q, scales) -> None:
    """quantize's int8 / int4 rule in torch ops (any device), in pieces of bounded fp32 temporaries."""
    import torch

    L, N, K = w3.shape
    qmax = _QMAX[format]
    for l0, l1, n0, n1 in _pieces(L, N, K, 1):
        grouped = _finite_f32(w3[l0:l1, n0:n1], "quantize").reshape(l1 - l0, n1 - n0, K // gk, gk)
        s = grouped.abs().amax(dim=-1) / qmax  # [l, n, G]
        safe = torch.where(s > 0, s, 1.0).unsqueeze(-1)
        qi = torch.round(grouped / safe).clamp_(-qmax, qmax).to(torch.int8).reshape(l1 - l0, n1 - n0, K)
        if format == "int4":
            u = (qi & 0xF).to(torch.uint8)
            qi = u[..., 0::2] | (u[..., 1::2] << 4)
        q[l0:l1, n0:n1] = qi
        scales[l0:l1, n0:n1] = s


def _check_block(block):
    try:
        r, c = block
    except (TypeError, ValueError):
        raise ValueError(f"fp8: block must be (rows, cols), got {block!r}") from None
    if not all(is_int(b) for b in (r, c)):
        raise TypeError(f"fp8: block must be two ints (rows, cols), got {block!r}")
    r, c = int(r), int(c)
    if r < 1 or c < 1:
        raise ValueError(f"fp8: block sizes must be positive, got {block!r}")
    return r, c


def _int4_values(data):
    """uint8 [..., K/2] -> int8 [..., K] in [-8, 7]."""
    import torch

    lo = (data & 0xF).to(torch.int8)
    hi = (data >> 4).to(torch.int8)
    both = torch.stack([lo, hi], dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])
    return torch.where(both > 7, both - 16, both)


def dequantize(qw: QuantizedWeights):
    """The fp32 weights [..., N, K] that qw stands for: q * s (fp8 on the CPU: a NaN byte is a ValueError)."""
    if not isinstance(qw, QuantizedWeights):
        raise TypeError(f"dequantize: expected QuantizedWeights, got {type(qw).__name__}")
    N, K = qw.shape[-2:]
    if qw.format == "fp8" and qw.data.device.type == "cpu":  # natively, on threads: the same products
        import torch

        mod, threads = _native()
        out = torch.empty(qw.shape, dtype=torch.float32)
        mod.dequantize_fp8(*_fp8_args(qw), out.view(-1, N, K), threads)
        return out
    if qw.format == "fp8":
        return qw.data.float() * _expand_blocks(qw.scales.float(), qw.block, N, K)
    q = _int4_values(qw.data) if qw.format == "int4" else qw.data
    g = qw.group_size or K
    grouped = q.float().reshape(*qw.shape[:-1], K // g, g) * qw.scales.unsqueeze(-1)
    return grouped.reshape(qw.shape)


def from_fp8(w_fp8, scale_inv, block=(128, 128), *, to: str | None = None,
             group_size: int | None = None) -> QuantizedWeights:
    """DeepSeek-V3/R1's block-scaled fp8 weight (float8_e4m3fn [..., N, K] and its weight_scale_inv
    fp32 [..., ceil(N/rows), ceil(K/cols)]) as QuantizedWeights: kept as fp8 with its scales (to=None),
    or converted to "int8" / "int4" (group_size as in quantize) through the fp32 weights."""
    import torch

    if not isinstance(w_fp8, torch.Tensor) or w_fp8.dtype != torch.float8_e4m3fn:
        raise TypeError(f"from_fp8: w_fp8 must be a float8_e4m3fn tensor, got "
                        f"{w_fp8.dtype if isinstance(w_fp8, torch.Tensor) else type(w_fp8).__name__}")
    if w_fp8.dim() < 2 or w_fp8.shape[-1] == 0 or w_fp8.shape[-2] == 0:
        raise ValueError(f"from_fp8: expected w_fp8 [..., N, K] with N, K >= 1, got shape {tuple(w_fp8.shape)}")
    if not isinstance(scale_inv, torch.Tensor) or not scale_inv.is_floating_point():
        raise TypeError("from_fp8: scale_inv must be a floating-point tensor")
    r, c = _check_block(block)
    N, K = w_fp8.shape[-2:]
    want = (*w_fp8.shape[:-2], -(-N // r), -(-K // c))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"from_fp8: scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for w_fp8 "
                         f"{tuple(w_fp8.shape)} and block {(r, c)}")
    if not torch.isfinite(scale_inv).all():
        raise ValueError("from_fp8: scale_inv holds NaN or infinity")
    # e4m3fn has no infinity and NaN is the byte pattern S.1111.111: found on the bytes (natively on the CPU,
    # elsewhere piece by piece: the fp32 copy of a whole layer's stack would be four times its size).
    raw = w_fp8.detach().reshape(-1, N, K).view(torch.uint8)
    if raw.device.type == "cpu":
        mod, threads = _native()
        nan = mod.fp8_has_nan(raw.reshape(-1), threads)
    else:
        nan = any(((raw[l0:l1, n0:n1] & 0x7F) == 0x7F).any() for l0, l1, n0, n1 in _pieces(raw.shape[0], N, K, 1))
    if nan:
        raise ValueError("from_fp8: w_fp8 holds NaN")
    qw = QuantizedWeights("fp8", w_fp8.detach(), scale_inv.detach().float(), w_fp8.shape, block=(r, c))
    if to is None:
        return qw
    if to not in ("int8", "int4"):
        raise ValueError(f"from_fp8: to must be None, 'int8' or 'int4', got {to!r}")
    if w_fp8.device.type == "cpu":  # natively, from the bytes: no fp32 copy of the weights
        out = _empty(w_fp8.shape, to, group_size)
        _quantize_into(qw, out)
        return out
    # One matrix of the stack at a time: the fp32 weights never exist for the whole stack.
    L = math.prod(w_fp8.shape[:-2])
    if L == 0:  # an empty stack: no matrix to convert one at a time, but quantize still checks and shapes it
        return quantize(dequantize(qw), to, group_size=group_size)
    mats = qw.data.reshape(L, N, K), qw.scales.reshape(L, *qw.scales.shape[-2:])
    parts = [quantize(dequantize(QuantizedWeights("fp8", d, sc, (N, K), block=(r, c))), to, group_size=group_size)
             for d, sc in zip(*mats)]
    lead = w_fp8.shape[:-2]
    data = torch.stack([p.data for p in parts]).reshape(*lead, *parts[0].data.shape)
    scales = torch.stack([p.scales for p in parts]).reshape(*lead, *parts[0].scales.shape)
    return QuantizedWeights(to, data, scales, w_fp8.shape, group_size=parts[0].group_size)
