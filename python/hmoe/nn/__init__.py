"""hmoe.nn: modules for models. CPUExperts (routed experts prepacked for this CPU), HybridMoE (the
DeepSeek-V2/V3 MoE block with its routed experts on the CPU), patch_model (swaps the MoE blocks of a
loaded transformers model), load_model (a DeepSeek model from its checkpoint, the routed experts read
expert by expert into CPU experts), register_experts_implementation (experts_implementation="hmoe" in
transformers), GraphDecoder (greedy decoding with each step replayed from a CUDA graph).
Importing it imports torch, not transformers."""
from __future__ import annotations

from ._hf import PatchReport, patch_model, register_experts_implementation
from ._load import load_model
from .decode import GraphDecoder
from .experts import CPUExperts
from .hybrid import HybridMoE

__all__ = ["CPUExperts", "GraphDecoder", "HybridMoE", "PatchReport", "load_model", "patch_model",
           "register_experts_implementation"]
