"""Random problems and the error measure of the moe_experts_cpu tests (the reference and its
tolerance: hmoe._reference)."""
import torch


def rel_err(y, ref):
    y = y.double()
    assert torch.isfinite(y).all(), "non-finite output"
    return float((y - ref).norm() / ref.norm().clamp_min(1e-300))


def random_problem(T, H, I, E, K, x_dtype, w_dtype, ids_dtype=torch.int32, gen=None):
    """Random inputs scaled so that activations are O(1); distinct experts per token."""
    g = gen or torch.Generator().manual_seed(torch.seed() % (2**31))
    x = torch.randn(T, H, generator=g).to(x_dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(w_dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(w_dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    ids = ids.to(ids_dtype)
    w = torch.rand(T, K, generator=g, dtype=torch.float32)
    return x, ids, w, w13, w2
