# Tests of hmoe.ops.grouped_topk (CPU and CUDA) against a torch reference and transformers' routers.
import math

import pytest
import torch

import hmoe
from hmoe import _reference

grouped_topk = hmoe.ops.grouped_topk


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")
    return request.param


# Relative gaps in selection score up to this are near ties that rounding may resolve either
# way: exp/sigmoid differ by an ulp between libraries, and two groups' top-2 sums can round to
# the same float. Exact ties of equal inputs are tested separately (test_exact_ties_*).
NEAR_TIE = 1e-5


def _rel_gap(a, b):
    return (a - b) / (torch.maximum(a.abs(), b.abs()) + 0.01)  # as _reference._gap


def _check(w, ids, ref_w, ref_ids, ref_sel, margin, *, rtol=1e-6, atol=1e-6):
    """Same id sets per token, same weights per id, and our documented order; tokens whose
    routing hinges on a near tie (reference margin <= NEAR_TIE) may differ."""
    T, K = ref_ids.shape
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert tuple(w.shape) == (T, K) and tuple(ids.shape) == (T, K)
    w, ids, ref_sel = w.cpu(), ids.cpu().long(), ref_sel.float()
    E = ref_sel.shape[1]
    assert bool(((ids >= 0) & (ids < E)).all())
    ours_sorted, ours_perm = ids.sort(dim=-1)
    ref_sorted, ref_perm = ref_ids.sort(dim=-1)
    assert bool((ours_sorted[:, 1:] != ours_sorted[:, :-1]).all()), "duplicate ids"
    same = (ours_sorted == ref_sorted).all(dim=-1)
    near = margin <= NEAR_TIE
    bad = (~same & ~near).nonzero().flatten().tolist()
    assert not bad, f"tokens {bad[:5]} route differently: {ids[bad[:1]]} vs {ref_ids[bad[:1]]}"
    assert int((~same).sum()) <= max(1, T // 100), "too many near-tie differences"
    torch.testing.assert_close(w.gather(1, ours_perm)[same], ref_w.float().gather(1, ref_perm)[same],
                               rtol=rtol, atol=atol)
    # Documented order: selection score descending (up to near ties).
    s = ref_sel.gather(1, ids)
    a, b = s[:, :-1], s[:, 1:]
    assert bool(((a >= b) | (_rel_gap(b, a) <= NEAR_TIE)).all())


def _run_both(logits, top_k, **kw):
    w, ids = grouped_topk(logits, top_k, **kw)
    ref = _reference.grouped_topk(logits.cpu(), top_k,
                                 **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kw.items()})
    return w, ids, ref


# (E, n_group, topk_group, top_k); groups of one expert only with softmax scoring.
GROUPINGS = [
    (8, 1, 1, 2), (8, 2, 1, 3), (8, 4, 2, 3), (8, 8, 3, 2), (8, 4, 4, 8),
    (16, 1, 1, 4), (16, 4, 2, 4), (16, 8, 4, 6), (16, 2, 2, 16),
    (64, 1, 1, 6), (64, 8, 3, 6), (64, 8, 1, 8), (64, 4, 2, 1),
    (160, 1, 1, 6), (160, 8, 3, 6), (160, 5, 2, 10), (160, 160, 20, 8),
    (256, 8, 4, 8), (256, 1, 1, 8), (256, 16, 4, 8), (256, 2, 1, 100),
]


# sigmoid scoring ranks groups by their two best experts, so it needs >= 2 per group
CASES = [(*g, s) for g in GROUPINGS for s in ("softmax", "sigmoid")
         if not (s == "sigmoid" and g[1] > 1 and g[0] // g[1] < 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("E,G,TG,K,scoring", CASES)
def test_matches_reference(device, E, G, TG, K, scoring, dtype):
    gen = torch.Generator().manual_seed(E * 1000 + G * 10 + TG + K)
    for i, T in enumerate([0, 1, 7, 100]):
        logits = (torch.randn(T, E, generator=gen) * 2).to(dtype).to(device)
        kw = dict(n_group=G, topk_group=TG, scoring=scoring, renormalize=bool(i % 2 == 0),
                  routed_scaling_factor=[1.0, 2.5, 16.0, 0.5][i])
        biases = [None]
        if scoring == "sigmoid":
            b = torch.randn(E, generator=gen) * 0.1
            biases += [b.to(device), b.to(torch.bfloat16).to(device)]
        for bias in biases:
            w, ids, ref = _run_both(logits, K, bias=bias, **kw)
            _check(w, ids, *ref)
            assert w.device == logits.device and ids.device == logits.device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_exact_ties_go_to_the_lower_index(device, scoring, dtype):
    # equal logits give bit-equal scores on every device: groups and experts then rank by index
    x = torch.tensor([[0.5, 1.0, 1.0, 0.5] * 4, [0.0] * 16, [2.0, 1.0] * 8], dtype=dtype)
    w, ids = grouped_topk(x.to(device), 3, n_group=4, topk_group=2, scoring=scoring)
    assert ids.cpu().tolist() == [[1, 2, 5], [0, 1, 2], [0, 2, 4]]
    w, ids = grouped_topk(x.to(device), 5, scoring=scoring)
    assert ids.cpu().tolist() == [[1, 2, 5, 6, 9], [0, 1, 2, 3, 4], [0, 2, 4, 6, 8]]
    torch.testing.assert_close(w.cpu()[1], torch.full((5,), 0.2), rtol=1e-6, atol=1e-7)
    assert bool((w.cpu() > 0).all())


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_against_fp64_reference(device, scoring):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(100, 256, generator=gen).to(device)
    bias = (torch.randn(256, generator=gen) * 0.1).to(device) if scoring == "sigmoid" else None
    kw = dict(n_group=8, topk_group=4, scoring=scoring, bias=bias, routed_scaling_factor=2.5)
    w, ids = grouped_topk(logits, 8, **kw)
    kw["bias"] = None if bias is None else bias.cpu()
    ref = _reference.grouped_topk(logits.cpu(), 8, dtype=torch.float64, **kw)
    _check(w, ids, *ref)
    # fp32 weights against fp64: the op's normwise tolerance (16 roundings of fp32), not a hand-picked
    # elementwise 1e-5 (ten times looser)
    tol = _reference.tolerance("grouped_topk", torch.float32)
    same = (ids.cpu().long().sort(-1).values == ref[1].sort(-1).values).all(-1)
    got = w.cpu().gather(1, ids.cpu().long().argsort(-1))[same].double()
    want = ref[0].gather(1, ref[1].argsort(-1))[same]
    assert float((got - want).norm() / want.norm()) <= tol


def _hidden_and_router(router, T, H, gen):
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) / math.sqrt(H))
    return torch.randn(T, H, generator=gen)


@pytest.mark.parametrize("E,K,G,TG,norm", [(256, 8, 8, 4, True), (64, 6, 8, 3, False),
                                           (16, 4, 1, 1, True), (160, 6, 8, 3, True)])
def test_matches_transformers_deepseek_v3(device, E, K, G, TG, norm):
    pytest.importorskip("transformers", reason="compares with transformers' router")
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=E, num_experts_per_tok=K, n_group=G,
                           topk_group=TG, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(E + K)
    hidden = _hidden_and_router(router, 100, 64, gen)
    router.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    with torch.no_grad():
        logits, tw, tids = router(hidden)
    w, ids = grouped_topk(logits.to(device), K, n_group=G, topk_group=TG, scoring="sigmoid",
                          bias=router.e_score_correction_bias.to(device), renormalize=norm,
                          routed_scaling_factor=2.5)
    _, _, rsel, margin = _reference.grouped_topk(logits, K, n_group=G, topk_group=TG,
                                                scoring="sigmoid",
                                                bias=router.e_score_correction_bias)
    _check(w, ids, tw, tids, rsel, margin)


@pytest.mark.parametrize("E,K,G,TG,method", [(64, 6, 8, 3, "group_limited_greedy"),
                                             (160, 6, 8, 3, "group_limited_greedy"),
                                             (64, 6, None, None, "greedy")])
def test_matches_transformers_deepseek_v2(device, E, K, G, TG, method):
    pytest.importorskip("transformers", reason="compares with transformers' router")
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=64, n_routed_experts=E, num_experts_per_tok=K, n_group=G,
                           topk_group=TG, topk_method=method, routed_scaling_factor=16.0)
    router = DeepseekV2TopkRouter(cfg)
    hidden = _hidden_and_router(router, 100, 64, torch.Generator().manual_seed(E + K))
    with torch.no_grad():
        logits, tw, tids = router(hidden)
    # transformers' V2 router never renormalises (norm_topk_prob is unused there).
    w, ids = grouped_topk(logits.to(device), K, n_group=G or 1, topk_group=TG or 1,
                          scoring="softmax", renormalize=False, routed_scaling_factor=16.0)
    _, _, rsel, margin = _reference.grouped_topk(logits, K, n_group=G or 1, topk_group=TG or 1)
    _check(w, ids, tw, tids, rsel, margin, atol=1e-5)  # weights up to 16


# --- NaN and infinities --------------------------------------------------------------------

def test_nan_logits_never_win(device):
    nan = float("nan")
    logits = torch.tensor([[nan, 1.0, 2.0, nan, 0.0, -1.0, nan, -2.0]], device=device)
    w, ids = grouped_topk(logits, 2)
    assert ids.cpu().tolist() == [[2, 1]]
    p = torch.softmax(torch.tensor([1.0, 2.0, 0.0, -1.0, -2.0]), dim=0)
    expect = torch.stack([p[1], p[0]]) / (p[1] + p[0] + 1e-20)
    torch.testing.assert_close(w.cpu()[0], expect, rtol=1e-6, atol=1e-7)
    # sigmoid: a NaN logit loses even with a huge bias
    bias = torch.tensor([100.0] + [0.0] * 7, device=device)
    w, ids = grouped_topk(logits, 2, scoring="sigmoid", bias=bias, renormalize=False)
    assert ids.cpu().tolist() == [[2, 1]]
    torch.testing.assert_close(w.cpu()[0], torch.sigmoid(torch.tensor([2.0, 1.0])))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_all_nan_row(device, scoring, renormalize):
    logits = torch.full((3, 16), float("nan"), device=device)
    w, ids = grouped_topk(logits, 3, n_group=4, topk_group=2, scoring=scoring,
                          renormalize=renormalize, routed_scaling_factor=2.5)
    # every group and expert ranks -inf: the lowest indices win, with weight 0
    assert ids.cpu().tolist() == [[0, 1, 2]] * 3
    assert torch.equal(w.cpu(), torch.zeros(3, 3))


def test_fewer_usable_experts_than_top_k(device):
    nan = float("nan")
    logits = torch.tensor([[nan, nan, 3.0, nan, nan, 1.0, nan, nan]], device=device)
    for scoring in ("softmax", "sigmoid"):
        w, ids = grouped_topk(logits, 4, scoring=scoring)
        assert ids.cpu().tolist() == [[2, 5, 0, 1]]
        assert w.cpu()[0, 2:].tolist() == [0.0, 0.0] and bool((w.cpu()[0, :2] > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plus_inf_logits_take_the_softmax_limit(device, dtype):
    # an fp16 router that overflowed: the +inf experts share the row, the others score 0, so the
    # token still goes to them (torch's softmax gives NaN; a zero row would drop the token)
    inf = float("inf")
    logits = torch.tensor([[0.5, 2.0, -1.0, inf, 0.0, 1.0, -inf, 3.0],
                           [inf, 2.0, -1.0, inf, float("nan"), 1.0, -inf, 3.0]], dtype=dtype, device=device)
    w, ids = grouped_topk(logits, 2, renormalize=False)
    assert ids.cpu().tolist() == [[3, 0], [0, 3]]  # ties at score 0 go to the lower index
    assert w.cpu().tolist() == [[1.0, 0.0], [0.5, 0.5]]
    w, ids = grouped_topk(logits, 3, n_group=4, topk_group=2)  # groups {0,1} {2,3} {4,5} {6,7}
    assert ids.cpu().tolist() == [[3, 0, 1], [0, 3, 1]]
    assert w.cpu().tolist() == [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_random_nans_and_infs(device, scoring, dtype):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(200, 64, generator=gen)
    r = torch.rand(200, 64, generator=gen)
    logits[r < 0.3] = float("nan")
    logits[(r > 0.3) & (r < 0.35)] = float("-inf")
    logits[:4] = float("nan")  # whole rows
    logits[4:8] = float("-inf")
    logits[8, 5] = float("inf")
    bias = torch.randn(64, generator=gen) * 0.1 if scoring == "sigmoid" else None
    if bias is not None:
        bias[7] = float("nan")
    x = logits.to(dtype).to(device)
    for G, TG, K in [(1, 1, 8), (8, 3, 6), (8, 1, 8)]:
        w, ids, ref = _run_both(x, K, n_group=G, topk_group=TG, scoring=scoring,
                                bias=None if bias is None else bias.to(device))
        _check(w, ids, *ref)
        assert not bool(torch.isnan(w).any())


# --- validation ------------------------------------------------------------------------------

def _bad_calls():
    x = torch.randn(4, 16)
    ok = dict(n_group=4, topk_group=2)
    return [
        ("router_logits", TypeError, ([[0.0] * 16], 2), {}),
        ("router_logits", ValueError, (torch.randn(16), 2), {}),
        ("router_logits", ValueError, (torch.randn(2, 4, 16), 2), {}),
        ("router_logits", TypeError, (torch.zeros(4, 16, dtype=torch.int32), 2), {}),
        ("router_logits", TypeError, (x.double(), 2), {}),
        ("router_logits", ValueError, (torch.randn(4, 32)[:, ::2], 2), {}),
        ("router_logits", ValueError, (torch.empty(4, 16, device="meta"), 2), {}),
        ("experts", ValueError, (torch.randn(4, 0), 1), {}),
        ("experts", ValueError, (torch.randn(1, 4097), 1), {}),
        ("top_k", ValueError, (x, 0), {}),
        ("top_k", ValueError, (x, 17), {}),
        ("top_k", ValueError, (x, 9), ok),  # > topk_group * E / n_group
        ("top_k", TypeError, (x, 2.0), {}),
        ("top_k", TypeError, (x, True), {}),
        ("n_group", ValueError, (x, 2), dict(n_group=3)),
        ("n_group", ValueError, (x, 2), dict(n_group=0)),
        ("n_group", TypeError, (x, 2), dict(n_group="4")),
        ("n_group", ValueError, (x, 2), dict(n_group=16, scoring="sigmoid")),
        ("topk_group", ValueError, (x, 2), dict(n_group=4, topk_group=0)),
        ("topk_group", ValueError, (x, 2), dict(n_group=4, topk_group=5)),
        ("scoring", ValueError, (x, 2), dict(scoring="relu")),
        ("scoring", ValueError, (x, 2), dict(scoring=None)),
        ("bias", ValueError, (x, 2), dict(bias=torch.zeros(16))),  # softmax has no bias
        ("bias", ValueError, (x, 2), dict(scoring="sigmoid", bias=torch.zeros(8))),
        ("bias", TypeError, (x, 2), dict(scoring="sigmoid", bias=torch.zeros(16, dtype=torch.int64))),
        ("bias", TypeError, (x, 2), dict(scoring="sigmoid", bias=[0.0] * 16)),
        ("bias", ValueError, (x, 2), dict(scoring="sigmoid", bias=torch.zeros(16, device="meta"))),
        ("bias", ValueError, (x, 2), dict(scoring="sigmoid", bias=torch.zeros(32)[::2])),
        ("renormalize", TypeError, (x, 2), dict(renormalize=1)),
        ("routed_scaling_factor", ValueError, (x, 2), dict(routed_scaling_factor=float("inf"))),
        ("routed_scaling_factor", ValueError, (x, 2), dict(routed_scaling_factor=float("nan"))),
        ("routed_scaling_factor", ValueError, (x, 2), dict(routed_scaling_factor=1e39)),
        ("routed_scaling_factor", TypeError, (x, 2), dict(routed_scaling_factor="2.5")),
        ("routed_scaling_factor", TypeError, (x, 2), dict(routed_scaling_factor=True)),
    ]


@pytest.mark.parametrize("name,exc,args,kw", _bad_calls(),
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(_bad_calls())])
def test_bad_inputs_name_the_argument(name, exc, args, kw):
    # "experts" alone is also in top_k's and n_group's messages ("experts per group"): the E check's own
    match = {"experts": r"router_logits has \d+ experts \(dim 1\)"}.get(name, name)
    with pytest.raises(exc, match=match):
        grouped_topk(*args, **kw)


def test_empty_batch_and_accepted_types(device):
    w, ids = grouped_topk(torch.randn(0, 64, device=device), 6, n_group=8, topk_group=3,
                          scoring="sigmoid", bias=torch.zeros(64, device=device))
    assert w.shape == (0, 6) and w.dtype == torch.float32 and w.device.type == device
    assert ids.shape == (0, 6) and ids.dtype == torch.int32 and ids.device.type == device
    # any integral top_k (numpy ints too) and an int scaling factor are accepted
    import numpy as np
    w, ids = grouped_topk(torch.randn(3, 16, device=device), np.int64(2), routed_scaling_factor=2)
    assert w.shape == (3, 2)


def test_native_entry_checks_what_python_passes_through():
    # The module's entry point is where the checks live: called directly, it refuses the same.
    from hmoe import _native

    core = _native.bind("cpu_core")
    x = torch.randn(2, 8)
    base = [x, 2, 1, 1, "softmax", None, True, 1.0]
    for pos, bad, exc, what in [(0, x.double(), TypeError, "router_logits"), (4, "relu", ValueError, "scoring"),
                                (1, 9, ValueError, "top_k"), (2, 3, ValueError, "n_group")]:
        args = list(base)
        args[pos] = bad
        with pytest.raises(exc, match=what):
            core.grouped_topk(*args)


# --- CUDA specifics ----------------------------------------------------------------------

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.parametrize("E,G,TG,K,scoring", [
    (512, 8, 4, 8, "sigmoid"), (512, 1, 1, 32, "softmax"), (384, 1, 1, 8, "sigmoid"),
    (4096, 1, 1, 8, "softmax"), (4096, 2, 1, 16, "sigmoid"), (4096, 4096, 4000, 64, "softmax"),
    (4096, 64, 8, 16, "sigmoid"), (64, 8, 8, 64, "softmax"), (33, 1, 1, 33, "sigmoid")])
def test_cuda_large_shapes_match_cpu(E, G, TG, K, scoring):
    dev = _cuda()
    x = torch.randn(37, E, generator=torch.Generator().manual_seed(E))
    bias = torch.randn(E) * 0.1 if scoring == "sigmoid" else None
    kw = dict(n_group=G, topk_group=TG, scoring=scoring, routed_scaling_factor=2.5)
    w, ids = grouped_topk(x.to(dev), K, bias=None if bias is None else bias.to(dev), **kw)
    cw, cids = grouped_topk(x, K, bias=bias, **kw)
    _, _, rsel, margin = _reference.grouped_topk(x, K, bias=bias, **kw)
    _check(w, ids, cw, cids.long(), rsel, margin)


@pytest.mark.gpu
def test_cuda_grid_stride_many_tokens():
    dev = _cuda()
    x = torch.randn(300_000, 16, generator=torch.Generator().manual_seed(1))  # > 65535 blocks * 4
    kw = dict(n_group=4, topk_group=2, scoring="sigmoid")
    w, ids = grouped_topk(x.to(dev), 2, **kw)
    cw, cids = grouped_topk(x, 2, **kw)
    _, _, rsel, margin = _reference.grouped_topk(x, 2, **kw)
    _check(w, ids, cw, cids.long(), rsel, margin)


@pytest.mark.gpu
def test_cuda_side_stream_and_other_device():
    dev = _cuda()
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    cw, cids = grouped_topk(x, 8, n_group=8, topk_group=4)
    devices = [dev] + ([torch.device("cuda", 1)] if torch.cuda.device_count() > 1 else [])
    for d in devices:
        before = torch.cuda.current_device()
        s = torch.cuda.Stream(device=d)
        xd = x.to(d)
        s.wait_stream(torch.cuda.current_stream(d))
        with torch.cuda.stream(s):
            w, ids = grouped_topk(xd, 8, n_group=8, topk_group=4)
        s.synchronize()
        assert torch.cuda.current_device() == before and w.device == d
        assert torch.equal(ids.cpu(), cids)
        torch.testing.assert_close(w.cpu(), cw, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the refused capture
def test_cuda_graph_capture(monkeypatch):
    dev = _cuda()
    x = torch.randn(32, 256, device=dev)
    bias = torch.randn(256, device=dev) * 0.1
    kw = dict(n_group=8, topk_group=4, scoring="sigmoid", bias=bias, routed_scaling_factor=2.5)
    hmoe.prewarm(dev)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        grouped_topk(x, 8, **kw)  # eager warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        w, ids = grouped_topk(x, 8, **kw)
    x.copy_(torch.randn(32, 256, device=dev))
    g.replay()
    torch.cuda.synchronize()
    ew, eids = grouped_topk(x, 8, **kw)
    assert torch.equal(ids, eids)
    torch.testing.assert_close(w, ew, rtol=0, atol=0)
    # a first use under capture is refused with a clear error instead of breaking the capture
    from hmoe.ops import _cuda as cuda_ops
    monkeypatch.setattr(cuda_ops, "_warm", set())
    g2 = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prewarm"):
        with torch.cuda.graph(g2):
            grouped_topk(x, 8, **kw)
