"""compat --selftest: each selected variant runs once on small random inputs against a torch
reference. SELFTESTS maps a name to callable(device: str) -> (ok, detail), or None when the
test does not apply to that device ("cpu" or "cuda:N"); other ops register theirs here."""
from __future__ import annotations

SELFTESTS: dict = {}


def _normwise(got, want, tol: float) -> tuple[bool, str]:
    """got against the fp64 reference `want`, normwise (NaN never passes)."""
    err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300))
    return err <= tol, f"normwise error {err:.1e} (allowed {tol:.1e})"


def experts_selftest(device: str):
    """moe_experts_cpu with fp32 weights (activations stay fp32 by contract) against fp64 math."""
    if device != "cpu":
        return None
    import torch

    from .. import _reference
    from ..ops import experts as ex

    g = torch.Generator().manual_seed(0)
    T, K, E, H, I = 5, 2, 4, 64, 32
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    got = ex.moe_experts_cpu(x, ids, w, w13, w2)
    tol = _reference.tolerance("moe_experts", torch.float32, w_dtype=torch.float32)
    ok, detail = _normwise(got, _reference.moe_experts(x, ids, w, w13, w2), tol)
    return ok, f"{ex.select().variant}: {detail}"


def grouped_topk_selftest(device: str):
    """grouped_topk (sigmoid, bias, 4 groups) against the fp64 reference; ids compared as sets."""
    import torch

    from .. import _reference
    from ..ops import _cuda, grouped_topk

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 32, generator=g)
    bias = torch.randn(32, generator=g) * 0.1
    kw = dict(n_group=4, topk_group=2, scoring="sigmoid", routed_scaling_factor=2.5)
    want_w, want_ids, _, _ = _reference.grouped_topk(logits, 4, bias=bias, dtype=torch.float64, **kw)
    w, ids = grouped_topk(logits.to(device), 4, bias=bias.to(device), **kw)
    w, ids = w.cpu(), ids.cpu().long()
    if not all(set(a.tolist()) == set(b.tolist()) for a, b in zip(ids, want_ids)):
        return False, "chose different experts than the reference"
    got = w.gather(1, ids.argsort(dim=1))
    want = want_w.gather(1, want_ids.argsort(dim=1))
    ok, detail = _normwise(got, want, _reference.tolerance("grouped_topk", torch.float32))
    if device == "cpu":
        return ok, f"cpu_core: {detail}"
    sel = _cuda.select("grouped_topk", _cuda.device_index(torch, torch.device(device)))
    return ok, f"{sel.variant} {sel.target}: {detail}"


def mla_decode_selftest(device: str):
    """mla_decode (bf16, shuffled pages, a 0-length request) against the fp64 reference: 16 heads with
    a page table of 2 pages a request and of 80 (most of them unused), and 128 heads. On compute
    capability 9.0 the sm90a family runs the last two and leaves the first, a small call, to the
    portable one (hmoe.ops.mla.route)."""
    if not device.startswith("cuda"):
        return None
    import torch

    from .. import _reference
    from ..ops import _cuda, mla, mla_decode

    g = torch.Generator().manual_seed(2)
    B, page, lens = 4, 64, [100, 0, 5, 64]
    ckv = torch.randn(6, page, 512, generator=g).to(torch.bfloat16)
    kpe = torch.randn(6, page, 64, generator=g).to(torch.bfloat16)
    short = torch.tensor([[2, 0], [1, 3], [5, 1], [4, 0]], dtype=torch.int32)
    wide = torch.cat([short, torch.zeros(B, 78, dtype=torch.int32)], 1)  # the same pages; the rest unused
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    index = _cuda.device_index(torch, torch.device(device))
    oks, details = [], []
    for H, pt in ((16, short), (16, wide), (128, short)):
        qn = torch.randn(B, H, 512, generator=g).to(torch.bfloat16)
        qp = torch.randn(B, H, 64, generator=g).to(torch.bfloat16)
        got = mla_decode(qn.to(device), qp.to(device), ckv.to(device), kpe.to(device), pt.to(device),
                         seq_lens.to(device), sm_scale=0.07).float().cpu()
        want = _reference.mla_decode(qn, qp, ckv, kpe, pt, seq_lens, 0.07)[0].double()
        ok, detail = _normwise(got, want, _reference.tolerance("mla_decode", torch.bfloat16))
        sel = mla.route(index, B, H, pt.shape[1], page)
        oks.append(ok)
        details.append(f"{H} heads, {pt.shape[1]} pages: {sel.variant} {sel.target}: {detail}")
    return all(oks), "; ".join(details)


def prefill_selftest(device: str):
    """ragged_prefill (bf16, causal, MLA head dims 192/128, GQA 2, a request with more keys than
    queries and an empty one) against the fp64 reference."""
    if not device.startswith("cuda"):
        return None
    import torch

    from .. import _reference
    from ..ops import _cuda, ragged_prefill

    g = torch.Generator().manual_seed(3)
    qo, kv = torch.tensor([0, 37, 37, 50], dtype=torch.int32), torch.tensor([0, 37, 37, 150], dtype=torch.int32)
    q = torch.randn(50, 4, 192, generator=g).to(torch.bfloat16)
    k = torch.randn(150, 2, 192, generator=g).to(torch.bfloat16)
    v = torch.randn(150, 2, 128, generator=g).to(torch.bfloat16)
    got = ragged_prefill(q.to(device), k.to(device), v.to(device), qo.to(device), kv.to(device),
                         sm_scale=192 ** -0.5).cpu()
    want = _reference.prefill(q, k, v, qo, kv, 192 ** -0.5)[0]
    ok, detail = _normwise(got, want, _reference.tolerance("prefill", torch.bfloat16))
    sel = _cuda.select("ragged_prefill", _cuda.device_index(torch, torch.device(device)))
    return ok, f"{sel.variant} {sel.target}: {detail}"


def decode_step_selftest(device: str):
    """The decode step's small kernels (bf16): decode_linear (fp32 out), rms_norm and mla_rope_append
    (V3's rope_interleave layout, a shuffled page table) against their fp64 references."""
    if not device.startswith("cuda"):
        return None
    import torch

    from .. import _reference
    from ..ops import _cuda, decode_linear, mla_rope_append, rms_norm

    g = torch.Generator().manual_seed(4)
    bf = torch.bfloat16
    x, w = torch.randn(2, 512, generator=g).to(bf), torch.randn(96, 512, generator=g).to(bf)
    checks = [("decode_linear", decode_linear(x.to(device), w.to(device), out_dtype=torch.float32).cpu(),
               x.double() @ w.double().T, _reference.tolerance("decode_linear", torch.float32))]
    nw = (1 + 0.2 * torch.randn(512, generator=g)).to(bf)
    checks.append(("rms_norm", rms_norm(x.to(device), nw.to(device), eps=1e-6).cpu(),
                   _reference.rms_norm(x, nw, 1e-6, contract=False), _reference.tolerance("rms_norm", bf)))
    q, kv = torch.randn(2, 16, 192, generator=g).to(bf), torch.randn(2, 576, generator=g).to(bf)
    angle = torch.rand(1, 64, generator=g) * 6
    pt = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    lens = torch.tensor([70, 5], dtype=torch.int32)
    ckv, kpe = torch.zeros(4, 64, 512, dtype=bf, device=device), torch.zeros(4, 64, 64, dtype=bf, device=device)
    q_pe = mla_rope_append(q.to(device), kv.to(device), nw.to(device), angle.cos().to(device),
                           angle.sin().to(device), ckv, kpe, pt.to(device), lens.to(device), eps=1e-6,
                           rope_layout="interleaved_to_half").cpu()
    want = _reference.mla_rope_append(q, kv, nw, angle.cos(), angle.sin(), 1e-6, "interleaved_to_half",
                                      contract=False)
    rows = [0 * 64 + 5, 1 * 64 + 4]  # token 69 of request 0 (page 0, slot 5), token 4 of request 1 (page 1)
    got = torch.cat([q_pe.flatten(), ckv.view(-1, 512)[rows].cpu().flatten(), kpe.view(-1, 64)[rows].cpu().flatten()])
    checks.append(("mla_rope_append", got, torch.cat([t.flatten() for t in want]),
                   _reference.tolerance("mla_rope_append", bf)))
    oks, details = [], []
    for name, g_, w_, tol in checks:
        ok, detail = _normwise(g_, w_, tol)
        oks.append(ok)
        details.append(f"{name} {detail}")
    sel = _cuda.select("mla_rope_append", _cuda.device_index(torch, torch.device(device)))
    return all(oks), f"{sel.variant} {sel.target}: " + "; ".join(details)


SELFTESTS["experts"] = experts_selftest
SELFTESTS["grouped_topk"] = grouped_topk_selftest
SELFTESTS["mla_decode"] = mla_decode_selftest
SELFTESTS["ragged_prefill"] = prefill_selftest
SELFTESTS["decode_step"] = decode_step_selftest


def run(devices) -> list[dict]:
    """Every registered test on every device in `devices`; a test that raises fails."""
    results = []
    for name, fn in list(SELFTESTS.items()):
        for dev in devices:
            try:
                r = fn(dev)
            except BaseException as e:  # a self-test failing badly is still one line
                if isinstance(e, KeyboardInterrupt):
                    raise
                r = (False, f"raised {type(e).__name__}: {e}")
            if r is None:
                continue
            ok, detail = r
            results.append({"name": name, "device": dev, "ok": bool(ok), "detail": str(detail)})
    return results
