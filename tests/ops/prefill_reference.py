"""Builders of ragged and paged prefill inputs (garbage where the batch does not reach) and the
error measure of the prefill tests; the references themselves are hmoe._reference's."""
import torch

from hmoe import _reference

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [(192, 128), (128, 128), (64, 64)]


def indptr(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)


def make_ragged(q_lens, kv_lens, H, Hkv, dims, dtype, device, gen, extra_rows=5, poison=float("nan")):
    """Random q, k, v for requests of q_lens queries and kv_lens keys, with `extra_rows` rows of
    `poison` after the batch in k and v (a kernel that reads past a request's keys picks them up)."""
    dqk, dv = dims
    tq, tkv = sum(q_lens), sum(kv_lens)
    q = torch.randn(tq, H, dqk, generator=gen).to(dtype)
    k = torch.full((tkv + extra_rows, Hkv, dqk), poison, dtype=dtype)
    v = torch.full((tkv + extra_rows, Hkv, dv), poison, dtype=dtype)
    k[:tkv] = torch.randn(tkv, Hkv, dqk, generator=gen).to(dtype)
    v[:tkv] = torch.randn(tkv, Hkv, dv, generator=gen).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    # k and v are views of the first tkv rows: the poisoned rows follow them in memory
    return to(q), to(k)[:tkv], to(v)[:tkv], to(indptr(q_lens)), to(indptr(kv_lens))


def make_paged(q_lens, kv_lens, H, Hkv, dims, page, dtype, device, gen, extra_pages=3, poison=float("nan")):
    """Random q and a paged cache holding kv_lens tokens per request in shuffled pages; unused slots
    hold `poison`, unused page-table entries -7."""
    dqk, dv = dims
    need = [(int(n) + page - 1) // page for n in kv_lens]
    max_pages, P = max(1, max(need)), sum(need) + extra_pages
    perm = torch.randperm(P, generator=gen)
    kc = torch.full((P, page, Hkv, dqk), poison, dtype=dtype)
    vc = torch.full((P, page, Hkv, dv), poison, dtype=dtype)
    pt = torch.full((len(kv_lens), max_pages), -7, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(kv_lens):
        for i in range(need[b]):
            pg = int(perm[nxt])
            nxt += 1
            pt[b, i] = pg
            rows = min(page, int(n) - i * page)
            kc[pg, :rows] = torch.randn(rows, Hkv, dqk, generator=gen).to(dtype)
            vc[pg, :rows] = torch.randn(rows, Hkv, dv, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), H, dqk, generator=gen).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(kc), to(vc), to(pt), to(torch.tensor(kv_lens, dtype=torch.int32)), to(indptr(q_lens))


def rel_err(x, ref):
    """Normwise ||x - ref|| / ||ref|| in fp64 on ref's device; NaN or inf in x fails."""
    x = x.double().to(ref.device)
    assert torch.isfinite(x).all(), "non-finite output"
    return float((x - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def tol(dtype, same_rounding=False):
    return _reference.tolerance("prefill_same_rounding" if same_rounding else "prefill", dtype)
