"""hmoe's ops on torch tensors: validated, then dispatched to the selected native variant."""
from .experts import moe_experts_cpu
from .linear import decode_linear
from .mla import mla_decode, mla_rope_append
from .norm import rms_norm
from .prefill import paged_prefill, ragged_prefill
from .topk import grouped_topk

__all__ = ["decode_linear", "grouped_topk", "mla_decode", "mla_rope_append", "moe_experts_cpu", "paged_prefill",
           "ragged_prefill", "rms_norm"]
