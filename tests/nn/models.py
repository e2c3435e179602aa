"""Small random DeepSeek-V2/V3 models of transformers for the hmoe.nn tests (grouped routing on, a
non-zero V3 router bias, a dense first layer, 2 MoE layers)."""
import torch

transformers = __import__("pytest").importorskip("transformers", reason="hmoe.nn's model tests need transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_group=4, topk_group=2,
              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
              qk_nope_head_dim=16, max_position_embeddings=128)


# Router weights: large enough that routing depends on the token, small enough that rounding the
# hidden states to bf16 rarely flips a choice (a flipped expert is a different function, not an error).
ROUTER_STD = 0.05


def v3_config(**kw):
    return transformers.DeepseekV3Config(**{**COMMON, "n_shared_experts": 1, "num_experts_per_tok": 4,
                                            "norm_topk_prob": True, "routed_scaling_factor": 2.5, **kw})


def v2_config(**kw):
    return transformers.DeepseekV2Config(**{**COMMON, "n_shared_experts": 2, "num_experts_per_tok": 3,
                                            "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5,
                                            **kw})


def model(kind: str, dtype=torch.float32, seed: int = 0, **kw):
    """A random DeepseekV3ForCausalLM ("v3") or DeepseekV2ForCausalLM ("v2") in eval mode."""
    torch.manual_seed(seed)
    if kind == "v3":
        m = transformers.DeepseekV3ForCausalLM(v3_config(**kw))
    else:
        m = transformers.DeepseekV2ForCausalLM(v2_config(**kw))
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(getattr(mod, "e_score_correction_bias", None), torch.Tensor):
                mod.e_score_correction_bias.normal_(0, 0.1)
            if type(mod).__name__.endswith("TopkRouter"):
                mod.weight.normal_(0, ROUTER_STD)
    return m.eval().to(dtype)


def moe_blocks(m):
    return [mod for mod in m.modules() if type(mod).__name__ in ("DeepseekV3MoE", "DeepseekV2Moe")]
