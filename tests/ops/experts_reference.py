"""fp64 references for moe_experts_cpu: plain, and one that rounds where the contract says."""
import torch
import torch.nn.functional as F


def moe_reference(x, ids, w, w13, w2, *, contract=True):
    """Returns fp64 [T, H]. With contract=True, activations entering each matmul are rounded
    to bf16 when the weights are bf16 (hmoe's precision contract); otherwise nothing is rounded."""
    T, H = x.shape
    I = w13.shape[1] // 2
    bf16_act = contract and w13.dtype == torch.bfloat16

    def act(v):
        return v.to(torch.bfloat16).double() if bf16_act else v

    xd = act(x.double())
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            we = w13[e].double()
            g, u = xd[t] @ we[:I].T, xd[t] @ we[I:].T
            h = act(F.silu(g) * u)
            out[t] += float(w[t, k]) * (h @ w2[e].double().T)
    return out


def tolerance(x_dtype, w_dtype, contract=True):
    """Norm-relative tolerance: the output rounding of x_dtype plus fp32 accumulation; against
    the unrounded reference, bf16/fp16 weights add their activation rounding."""
    out = {torch.float32: 2e-5, torch.float16: 1.5e-3, torch.bfloat16: 8e-3}[x_dtype]
    if w_dtype == torch.bfloat16:
        out += 2e-4 if contract else 1.2e-2
    elif w_dtype == torch.float16 and x_dtype == torch.float16:
        out += 0.0
    return out


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
