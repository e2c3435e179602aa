"""hmoe.CPUExperts: routed experts with weights prepacked once for the selected CPU ISA."""
from __future__ import annotations

from .._dtypes import code
from .._threads import get_num_threads
from ..ops import experts as _experts


class CPUExperts:
    """CPUExperts(w13, w2, *, isa=None)(x, topk_ids, topk_weights, out=None) -> [T, H] in x.dtype.

    Same math and precision contract as hmoe.ops.moe_experts_cpu, with w13 [E, 2I, H] and
    w2 [E, H, I] repacked at construction into the blocked layout the kernels stream (the
    originals are not kept: drop your references to free them). Calls are thread-safe.

    Pickling and deep copies keep the packed weights and the `isa` asked for, not the variant:
    unpickling selects again for the CPU it runs on (a forced `isa` that CPU cannot run is a
    ValueError there, never an illegal instruction).
    """

    _STATE_VERSION = 1

    def __init__(self, w13, w2, *, isa: str | None = None):
        self._isa_request = isa
        self.selection = _experts.select(isa)
        mod = _experts.module(self.selection)
        # The module checks both weights (shapes, one float dtype, CPU, contiguous) before packing.
        self._w13, self._w2 = mod.pack_weights(w13, w2, get_num_threads())
        self.num_experts, two_i, self.hidden_size = w13.shape
        self.intermediate_size = two_i // 2
        self.dtype = w13.dtype
        self._mod, self._code = mod, code(self.dtype)
        self._dims = (self._code, self.num_experts, self.hidden_size, self.intermediate_size)

    def __getstate__(self):
        return {"version": self._STATE_VERSION, "isa": self._isa_request, "dtype": self.dtype,
                "shape": (self.num_experts, self.hidden_size, self.intermediate_size),
                "w13": self._w13, "w2": self._w2}

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
        # Every ISA module packs the same layout; its size is the cheap check that it still does.
        b13, b2 = mod.packed_bytes(code(state["dtype"]), H, I)
        if (state["w13"].numel(), state["w2"].numel()) != (E * b13, E * b2):
            raise ValueError(f"unpickling CPUExperts: the packed weights do not have the layout the "
                             f"{sel.variant} module expects; build it again from the weights")
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self._isa_request, self.selection, self.dtype = state["isa"], sel, state["dtype"]
        self._w13, self._w2 = state["w13"], state["w2"]
        self._mod, self._code = mod, code(self.dtype)
        self._dims = (self._code, self.num_experts, self.hidden_size, self.intermediate_size)

    @property
    def isa(self) -> str:
        return self.selection.variant

    @property
    def packed_bytes(self) -> int:
        return self._w13.numel() + self._w2.numel()

    def __call__(self, x, topk_ids, topk_weights, out=None):
        return self._mod.moe_experts_packed(x, topk_ids, topk_weights, self._w13, self._w2, self._code,
                                            self.num_experts, self.hidden_size, self.intermediate_size, out,
                                            get_num_threads())

    def __repr__(self):
        return (f"CPUExperts(E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
                f"dtype={str(self.dtype).replace('torch.', '')}, isa={self.isa!r})")
