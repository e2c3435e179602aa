"""The mla_decode reference on the CPU, a paged-cache builder and the error measure of the tests."""
import torch

from hmoe import _reference


def mla_reference(q_nope, q_pe, ckv, kpe, page_table, seq_lens, sm_scale):
    """(out fp32 [B, H, 512], lse fp32 [B, H]) on the CPU: hmoe._reference.mla_decode (fp64)."""
    args = (t.cpu() for t in (q_nope, q_pe, ckv, kpe, page_table, seq_lens))
    return _reference.mla_decode(*args, sm_scale)


def make_cache(B, H, lens, page, dtype, device, gen, extra_pages=3, poison=float("nan"), table_pages=1):
    """Random q and a paged cache holding `lens` tokens per request in shuffled pages; every
    unused slot (and unused page-table entry) holds poison / garbage. The page table has
    max(table_pages, the most pages a request needs) columns."""
    lens = torch.tensor(lens, dtype=torch.int32)
    need = [(int(L) + page - 1) // page for L in lens]
    max_pages = max(table_pages, max(need))
    P = sum(need) + extra_pages
    perm = torch.randperm(P, generator=gen)
    ckv = torch.full((P, page, 512), poison, dtype=dtype)
    kpe = torch.full((P, page, 64), poison, dtype=dtype)
    pt = torch.full((B, max_pages), -7, dtype=torch.int32)  # garbage past the used pages
    nxt = 0
    for b in range(B):
        for i in range(need[b]):
            pg = int(perm[nxt])
            nxt += 1
            pt[b, i] = pg
            n = min(page, int(lens[b]) - i * page)
            ckv[pg, :n] = torch.randn(n, 512, generator=gen).to(dtype)
            kpe[pg, :n] = torch.randn(n, 64, generator=gen).to(dtype)
    q_nope = torch.randn(B, H, 512, generator=gen).to(dtype)
    q_pe = torch.randn(B, H, 64, generator=gen).to(dtype)
    to = lambda t: t.to(device)
    return to(q_nope), to(q_pe), to(ckv), to(kpe), to(pt), to(lens)


def rel_err(x, ref):
    x = x.float().cpu()
    assert torch.isfinite(x).all(), "non-finite output"
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


# Normwise, against the fp64 reference: hmoe._reference's rule for mla_decode.
TOL = {dt: _reference.tolerance("mla_decode", dt) for dt in (torch.bfloat16, torch.float16)}
