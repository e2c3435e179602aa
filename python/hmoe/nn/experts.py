"""hmoe.CPUExperts: routed experts with weights prepacked once for the selected CPU ISA."""
from __future__ import annotations

from .._dtypes import code
from .._native import spec
from .._threads import get_num_threads
from ..ops import experts as _experts
from ..quant import QuantizedWeights

_FLOAT_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def _format_code(fmt: str) -> int:
    codes = {k.removeprefix("weight_format_"): v for k, v in spec.constants().items() if k.startswith("weight_format_")}
    if fmt not in codes:
        # QuantizedWeights' constructor refuses unknown formats, but its attributes can still be changed.
        raise ValueError(f"CPUExperts: unknown quantised weight format {fmt!r}; the kernels take {tuple(codes)}")
    return codes[fmt]


def _quant_args(w13: QuantizedWeights, w2: QuantizedWeights):
    """pack_quantized's arguments for two QuantizedWeights ([E, 2I, H] and [E, H, I]), checked."""
    import torch

    for qw, name in ((w13, "w13"), (w2, "w2")):
        if len(qw.shape) != 3:
            raise ValueError(f"CPUExperts: {name} must be quantised weights of shape [E, N, K], got {list(qw.shape)}")
        if qw.format == "fp8" and qw.kernel_group not in (32, 64, 128):
            raise ValueError(f"CPUExperts: {name}: fp8 blocks {qw.block} have {qw.kernel_group} columns; hmoe's "
                             "kernels take blocks of 32, 64 or 128 columns")
    if w13.format != w2.format:
        raise ValueError(f"CPUExperts: w13 is {w13.format} and w2 is {w2.format}; quantise both to one format")
    args = []
    for qw in (w13, w2):
        N, K = qw.shape[-2:]
        data = qw.data if qw.data.dtype == torch.uint8 else qw.data.view(torch.uint8)
        if qw.format == "fp8":
            # A block larger than the matrix covers it whole (hmoe.quant's rule): bounded here so that the
            # sizes reach the module as the matrix's, whatever block=(2**64, ...) was given.
            rows, cols = min(qw.block[0], N), min(qw.block[1], K)
        else:
            rows, cols = 1, qw.group_size or K
        args.append((data.contiguous(), qw.scales.float().contiguous(), qw.kernel_group, rows, cols))
    (d13, s13, g13, r13, c13), (d2, s2, g2, r2, c2) = args
    return d13, s13, d2, s2, _format_code(w13.format), g13, g2, r13, c13, r2, c2


class CPUExperts:
    """CPUExperts(w13, w2, *, isa=None)(x, topk_ids, topk_weights, out=None) -> [T, H] in x.dtype.

    Same math and precision contract as hmoe.ops.moe_experts_cpu, with w13 [E, 2I, H] and
    w2 [E, H, I] repacked at construction into the blocked layout the kernels stream (the
    originals are not kept: drop your references to free them). w13 and w2 are float tensors of one
    dtype (fp32, fp16, bf16), or both hmoe.quant.QuantizedWeights of one format (int8, int4, fp8;
    the precision contract of each is in hmoe.ops.experts); x may be fp32, fp16 or bf16 whatever the
    weights are. Calls are thread-safe.

    Attributes: format ("bf16", "fp16", "fp32", "int8", "int4", "fp8"), dtype (the float weights'
    torch dtype; None when quantised), group13 / group2 (the kernels' k groups of w13 / w2; 0 for
    float weights), num_experts, hidden_size, intermediate_size, packed_bytes, isa.

    Pickling and deep copies keep the packed weights and the `isa` asked for, not the variant:
    unpickling selects again for the CPU it runs on (a forced `isa` that CPU cannot run is a
    ValueError there, never an illegal instruction).
    """

    _STATE_VERSION = 2

    def __init__(self, w13, w2, *, isa: str | None = None):
        self._isa_request = isa
        self.selection = _experts.select(isa)
        mod = _experts.module(self.selection)
        quantised = isinstance(w13, QuantizedWeights), isinstance(w2, QuantizedWeights)
        if any(quantised):
            if not all(quantised):
                raise TypeError("CPUExperts: w13 and w2 must both be QuantizedWeights or both float tensors, got "
                                f"{type(w13).__name__} and {type(w2).__name__}")
            args = _quant_args(w13, w2)
            # The module checks every shape against the other and the format before packing.
            self._w13, self._w2 = mod.pack_quantized(*args, get_num_threads())
            fmt, self.dtype, (g13, g2) = w13.format, None, args[5:7]
            self.num_experts, two_i, self.hidden_size = w13.shape
        else:
            # The module checks both weights (shapes, one float dtype, CPU, contiguous) before packing.
            self._w13, self._w2 = mod.pack_weights(w13, w2, get_num_threads())
            self.dtype, g13, g2 = w13.dtype, 0, 0
            fmt = _FLOAT_NAMES[str(w13.dtype)]
            self.num_experts, two_i, self.hidden_size = w13.shape
        self._set(mod, fmt, self.num_experts, self.hidden_size, two_i // 2, g13, g2)

    def _set(self, mod, fmt: str, E: int, H: int, I: int, g13: int, g2: int):
        self._mod, self.format = mod, fmt
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.group13, self.group2 = g13, g2
        fcode = code(self.dtype) if self.dtype is not None else _format_code(fmt)
        # The packed entry points' (format, E, H, I, group13, group2), and the same as
        # hmoe::cpu_experts_packed's layout string.
        self._dims = (fcode, E, H, I, g13, g2)
        self._layout = ",".join(map(str, self._dims))

    def __getstate__(self):
        return {"version": self._STATE_VERSION, "isa": self._isa_request, "format": self.format, "dtype": self.dtype,
                "shape": (self.num_experts, self.hidden_size, self.intermediate_size),
                "groups": (self.group13, self.group2), "w13": self._w13, "w2": self._w2}

    def __setstate__(self, state):
        if not isinstance(state, dict) or state.get("version") != self._STATE_VERSION:
            raise ValueError("unpickling CPUExperts: this state was written by another hmoe version "
                             f"(state version {state.get('version') if isinstance(state, dict) else '?'}, "
                             f"this hmoe reads {self._STATE_VERSION}); build it again from the weights")
        E, H, I = state["shape"]
        try:
            sel = _experts.select(state["isa"])
        except ValueError as e:
            raise ValueError(f"unpickling CPUExperts on this machine: {e}") from None
        mod = _experts.module(sel)
        self._isa_request, self.selection, self.dtype = state["isa"], sel, state["dtype"]
        self._set(mod, state["format"], E, H, I, *state["groups"])
        # Every ISA module packs the same layout; its size is the cheap check that it still does.
        b13, b2 = mod.packed_bytes(self._dims[0], H, I, *state["groups"])
        if (state["w13"].numel(), state["w2"].numel()) != (E * b13, E * b2):
            raise ValueError(f"unpickling CPUExperts: the packed weights do not have the layout the "
                             f"{sel.variant} module expects; build it again from the weights")
        self._w13, self._w2 = state["w13"], state["w2"]

    def subset(self, ids) -> CPUExperts:
        """A CPUExperts of experts `ids` of this one, in that order (their packed bytes copied: nothing is
        packed or quantised again)."""
        import torch

        idx = torch.as_tensor(ids, dtype=torch.int64).flatten()
        if idx.numel() == 0:
            raise ValueError("CPUExperts.subset: no expert ids")
        w13, w2 = self._mod.packed_select(self._w13, self._w2, self.num_experts, idx, get_num_threads())
        new = object.__new__(CPUExperts)
        new._isa_request, new.selection, new.dtype = self._isa_request, self.selection, self.dtype
        new._set(self._mod, self.format, idx.numel(), self.hidden_size, self.intermediate_size, self.group13,
                 self.group2)
        new._w13, new._w2 = w13, w2
        return new

    @property
    def isa(self) -> str:
        return self.selection.variant

    @property
    def packed_bytes(self) -> int:
        return self._w13.numel() + self._w2.numel()

    def __call__(self, x, topk_ids, topk_weights, out=None):
        return self._mod.moe_experts_packed(x, topk_ids, topk_weights, self._w13, self._w2, *self._dims, out,
                                            get_num_threads())

    def __repr__(self):
        groups = f", groups=({self.group13}, {self.group2})" if self.group13 else ""
        return (f"CPUExperts(E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
                f"format={self.format!r}{groups}, isa={self.isa!r})")
