"""Random DeepSeek models of transformers for the benchmarks and the example, built without running
transformers' initialisation over billions of weights: created on the meta device, then every tensor
materialised where it belongs (routed experts in host memory, the rest on `device`) and filled with
cheap random values. Timing only: the values are random, the shapes and layout are the model's."""
from __future__ import annotations

import sys

PRESETS = {
    # DeepSeek-V2-Lite's dimensions (26 MoE layers after one dense layer, 64 experts, top-6, 2 shared).
    "v2-lite": dict(arch="v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                    moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1,
                    num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
                    n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, topk_method="greedy",
                    routed_scaling_factor=1.0, max_position_embeddings=4096),
    # A small DeepSeek-V3 (grouped sigmoid routing with a bias) that runs anywhere in seconds.
    "small": dict(arch="v3", vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                  num_hidden_layers=5, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
                  kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                  n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                  norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096),
    "tiny": dict(arch="v3", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                 kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                 norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=512),
}


def config(preset: str, layers: int | None = None):
    import transformers

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)}")
    kw = dict(PRESETS[preset])
    arch = kw.pop("arch")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be at least 1 (MoE layers), got {layers}")
        kw["num_hidden_layers"] = kw["first_k_dense_replace"] + layers
    cls = transformers.DeepseekV2Config if arch == "v2" else transformers.DeepseekV3Config
    return cls(**kw)


def build(preset: str, *, dtype, device, layers: int | None = None, seed: int = 0, progress: bool = True):
    """A random DeepseekV2ForCausalLM / DeepseekV3ForCausalLM in eval mode: routed experts in host
    memory (as transformers' offloading leaves them), everything else on `device`."""
    import torch
    import transformers

    cfg = config(preset, layers)
    cls = transformers.DeepseekV2ForCausalLM if cfg.model_type == "deepseek_v2" else transformers.DeepseekV3ForCausalLM
    with torch.device("meta"):
        model = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    # A pool of distinct experts tiled over all of them: random values at memcpy speed.
    pool = 4
    w13 = (torch.randn(pool, 2 * inter, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(pool, H, inter, generator=g) * inter**-0.5).to(dtype)
    mods = list(model.named_modules())
    for i, (name, mod) in enumerate(mods):
        if progress and sys.stderr.isatty():
            print(f"\rbuilding {preset}: {100 * (i + 1) // len(mods)}%", end="", file=sys.stderr)
        routed = hasattr(mod, "gate_up_proj")
        for pname, p in list(mod.named_parameters(recurse=False)):
            if routed:
                src = w13 if pname == "gate_up_proj" else w2
                t = torch.empty(p.shape, dtype=dtype)
                for e in range(p.shape[0]):
                    t[e].copy_(src[e % pool])
            else:
                t = torch.empty(p.shape, dtype=dtype, device=device)
                if p.dim() == 1:
                    t.fill_(1.0)  # norms
                else:
                    t.normal_(0.0, p.shape[-1] ** -0.5)
            mod._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                if bname == "e_score_correction_bias":
                    mod._buffers[bname] = torch.randn(b.shape, generator=g).mul_(0.01).to(device)
                else:
                    mod._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype, device=device)
        if type(mod).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = type(mod)(config=cfg)
            for bname, b in fresh.named_buffers(recurse=False):
                mod._buffers[bname] = b
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    return model.eval()


def routed_expert_bytes(cfg, dtype_bytes: int) -> int:
    """Bytes of one routed expert's weights (gate, up and down)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype_bytes
