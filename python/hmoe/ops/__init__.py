"""hmoe's ops on torch tensors: validated, then dispatched to the selected native variant."""
from .experts import moe_experts_cpu
from .topk import grouped_topk

__all__ = ["grouped_topk", "moe_experts_cpu"]
