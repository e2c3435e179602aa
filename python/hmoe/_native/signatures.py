"""The signature table Python expects from each native module (mirrors the C++ bindings)."""

CPU_CORE = {
    "cpuid": "cpuid(leaf:u32, subleaf:u32) -> (eax, ebx, ecx, edx)",
    "xcr0": "xcr0() -> u64",
    "request_amx_permission": "request_amx_permission() -> str",
    "hwcap": "hwcap() -> (u64, u64)",
}

# Must equal HMOE_GROUPED_TOPK_SIG_ARGS in cpp/topk/grouped_topk.h: the arguments of both variants.
_GROUPED_TOPK_ARGS = (
    "logits:ptr, logits_dtype:i32, bias:ptr, bias_dtype:i32, weights:ptr, ids:ptr, num_tokens:i64, "
    "num_experts:i32, top_k:i32, n_group:i32, topk_group:i32, scoring:i32, renormalize:bool, "
    "routed_scaling_factor:f32")
CPU_CORE["grouped_topk"] = f"grouped_topk({_GROUPED_TOPK_ARGS}) -> None"

# hmoe._native.cuda_ops (cuda/cuda_ops_binding.cpp).
CUDA_OPS = {
    "grouped_topk": f"grouped_topk({_GROUPED_TOPK_ARGS}, device:i32, stream:ptr) -> None",
    "prewarm": "prewarm(device:i32) -> None",
    "mla_decode": (
        "mla_decode(q_nope:ptr, q_pe:ptr, ckv:ptr, kpe:ptr, page_table:ptr, seq_lens:ptr, out:ptr, "
        "lse:ptr, partial_o:ptr, partial_lse:ptr, batch:i32, heads:i32, page_size:i32, "
        "max_pages:i32, num_pages:i32, num_splits:i32, config:i32, loader:i32, dtype:i32, sm_scale:f32, "
        "device:i32, stream:ptr) -> None"),
    "mla_decode_plan": (
        "mla_decode_plan(device:i32, batch:i32, heads:i32, max_pages:i32, page_size:i32, config:i32, "
        "allow_tma:bool) -> (num_splits, config, loader, heads_per_cta, tile_tokens, smem_bytes)"),
}

EXPERTS = {
    "moe_experts": (
        "moe_experts(x:ptr, x_dtype:i32, topk_ids:ptr, ids_dtype:i32, topk_weights:ptr, w13:ptr, w2:ptr, "
        "w_dtype:i32, packed:i32, out:ptr, T:i64, K:i64, E:i64, H:i64, I:i64, num_threads:i32)"),
    "packed_bytes": "packed_bytes(w_dtype:i32, H:i64, I:i64) -> (w13_bytes_per_expert, w2_bytes_per_expert)",
    "pack_weights": (
        "pack_weights(w13:ptr, w2:ptr, w_dtype:i32, E:i64, H:i64, I:i64, dst13:ptr, dst2:ptr, num_threads:i32)"),
}
