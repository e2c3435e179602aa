"""hmoe.nn.HybridMoE and patch_model on transformers' own DeepSeek-V2/V3 models (CPU)."""
import copy
import io
import warnings

import numpy as np
import pytest
import torch

import hmoe.nn as hn
from hmoe import _reference
from hmoe.quant import quantize

from . import models

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits.float()


def _rel(a, b):
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind", ["v3", "v2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_patched_logits_match_the_original(kind, dtype):
    m = models.model(kind, dtype)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = _logits(m, ids)
    report = hn.patch_model(m, progress=False)
    assert report.swapped == 2 and all(isinstance(b, hn.HybridMoE) for b in _moe(m))
    assert not models.moe_blocks(m)
    got = _logits(m, ids)
    assert _rel(got, ref) <= _reference.tolerance("hybrid_model_logits", dtype)


def _moe(m):
    return [mod for mod in m.modules() if isinstance(mod, hn.HybridMoE)]


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_greedy_generation_is_identical_in_fp32(kind):
    m = models.model(kind)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)
    with torch.no_grad():
        want = m.generate(prompt, **kw)
        hn.patch_model(m, progress=False)
        got = m.generate(prompt, **kw)
    assert got.shape == (1, 26) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_block_returns_its_input_dtype_and_fp16_never_meets_bf16(dtype, monkeypatch):
    m = models.model("v3", dtype)
    hn.patch_model(m, progress=False)
    seen = []

    def record(mod, args, out):
        for t in list(args) + [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                seen.append((type(mod).__name__, t.dtype))

    hooks = [mod.register_forward_hook(record) for mod in m.modules()]
    calls = []
    real = hn.CPUExperts.__call__

    def spy(self, x, ids, w, out=None):
        y = real(self, x, ids, w, out)
        calls.append((x.dtype, self.dtype, y.dtype))
        return y

    monkeypatch.setattr(hn.CPUExperts, "__call__", spy)
    _logits(m, torch.randint(0, 128, (1, 5)))
    for h in hooks:
        h.remove()
    blocks = [(n, d) for n, d in seen if n == "HybridMoE"]
    assert blocks and all(d == dtype for _, d in blocks)
    assert calls and all(c == (dtype, dtype, dtype) for c in calls), calls
    if dtype == torch.float16:
        assert all(d != torch.bfloat16 for _, d in seen)


def test_gpu_experts_by_id_and_by_count_give_the_same_output():
    m = models.model("v3")
    block = models.moe_blocks(m)[0]
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        want = block(x)
        full = hn.HybridMoE.from_hf(block)(x)
        some = hn.HybridMoE.from_hf(block, gpu_experts=[0, 3, 15])
        got = some(x)
        counts = full_counts = hn.HybridMoE.from_hf(block)
        full_counts(x)
        by_count = hn.HybridMoE.from_hf(block, gpu_experts=4, routing_counts=counts.routing_counts)
        got_count = by_count(x)
    assert some.gpu_ids.tolist() == [0, 3, 15] and some.experts.num_experts == 13
    busiest = torch.argsort(counts.routing_counts, descending=True, stable=True)[:4].sort().values
    assert by_count.gpu_ids.tolist() == busiest.tolist()
    tol = 4 * _reference.unit_roundoff(torch.float32)
    for y in (full, got, got_count):
        assert _rel(y, want) <= tol
    assert int(full_counts.routing_counts.sum()) == 14 * 4


def test_slots_of_gpu_experts_are_empty_for_the_cpu_experts():
    # A slot routed to a GPU-resident expert reaches the CPU experts as -1, which computes no row (it was
    # a weight-0 copy of another of the token's slots, or expert 0 for a token all on the GPU).
    m = models.model("v3")
    block = models.moe_blocks(m)[0]
    moe = hn.HybridMoE.from_hf(block, gpu_experts=[0, 3, 15])
    cpu_experts, seen = moe.experts, []

    def recorded(x, ids, w):
        seen.append(ids.clone())
        return cpu_experts(x, ids, w)

    moe.experts = recorded
    x = torch.randn(9, 64)
    with torch.no_grad():
        y, want = moe(x), block(x)
        _, ids = moe.route(x)
    (got,) = seen
    on_gpu = (ids.unsqueeze(-1) == moe.gpu_ids).any(-1)
    assert on_gpu.any() and torch.equal(got < 0, on_gpu)
    assert torch.equal(got[~on_gpu], moe.cpu_index[ids[~on_gpu]])
    assert _rel(y, want) <= 4 * _reference.unit_roundoff(torch.float32)


def test_gpu_experts_run_in_token_chunks_of_bounded_temporaries(monkeypatch):
    E, H, inter = 8, 16, 8
    gen = torch.Generator().manual_seed(3)
    g, w13, w2 = (torch.randn(*s, generator=gen) for s in ((E, H), (E, 2 * inter, H), (E, H, inter)))
    moe = hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=[1, 5])
    x = torch.randn(50, H, generator=gen)
    part, seen = moe._gpu_part, []

    def recorded(x, *args):
        seen.append(x.shape[0])
        return part(x, *args)

    monkeypatch.setattr(moe, "_gpu_part", recorded)
    with torch.no_grad():
        whole = moe(x)
        assert seen == [50]
        moe.GPU_PART_BYTES = 7 * (4 * 2 * inter * 4 + H * 4)  # 7 tokens' temporaries of 2 GPU experts
        chunked = moe(x)
    assert seen == [50] + [7] * 7 + [1]
    assert _rel(chunked, whole) <= 4 * _reference.unit_roundoff(torch.float32)


def check_gpu_experts_against_fp64(dtype, device):
    """The GPU-resident experts' part on `device` against the fp64 routed sum over those experts, on a
    random routing with a token routed to no GPU expert (which gets exactly 0) and one to GPU experts only."""
    E, H, inter, K, T = 8, 128, 64, 3, 24
    gen = torch.Generator().manual_seed(12)
    gate = torch.randn(E, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) * inter ** -0.5).to(dtype)
    moe = hn.HybridMoE(gate.to(device), w13, w2, top_k=K, gpu_experts=[1, 4, 6])
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
    ids[0], ids[1] = torch.tensor([0, 2, 7]), torch.tensor([6, 1, 4])
    weights = torch.rand(T, K, generator=gen)
    with torch.no_grad():
        got = moe._gpu_routed(x.to(device), ids.to(device), weights.to(device)).cpu()
    on_gpu = torch.isin(ids, moe.gpu_ids.cpu())
    want = _reference.moe_experts(x, torch.where(on_gpu, ids, -1), weights, w13, w2, contract=False)
    assert got.dtype == dtype and got.shape == (T, H)
    assert (got[0] == 0).all()  # its routing weights on the GPU are all 0
    assert _rel(got.double(), want) <= _reference.tolerance("hybrid_gpu_experts", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_gpu_experts_against_the_fp64_routed_sum(dtype):
    check_gpu_experts_against_fp64(dtype, "cpu")


def test_gpu_w2_keeps_its_layout_through_to_and_the_state_dict():
    # gpu_w2 is [G, H, I] over memory laid out as [G, I, H]: _gpu_part reads it as [G * I, H] without a copy
    E, H, inter = 8, 16, 8
    gen = torch.Generator().manual_seed(13)
    g, w13, w2 = (torch.randn(*s, generator=gen) for s in ((E, H), (E, 2 * inter, H), (E, H, inter)))
    moe = hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=[1, 5])

    def laid_out(m):
        return m.gpu_w2.shape == (2, H, inter) and m.gpu_w2.permute(0, 2, 1).is_contiguous()

    assert laid_out(moe) and torch.equal(moe.gpu_w2, w2[[1, 5]])
    x = torch.randn(9, H, generator=gen)
    with torch.no_grad():
        want = moe(x)
    buf = io.BytesIO()
    torch.save(moe.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert torch.equal(sd["gpu_w2"], w2[[1, 5]])  # the state dict's shape and values
    other = hn.HybridMoE(*(torch.randn_like(t) for t in (g, w13, w2)), top_k=2, gpu_experts=[1, 5])
    with torch.no_grad():
        other.load_state_dict(sd)
        assert laid_out(other) and torch.equal(other(x), want)
        other.load_state_dict({**sd, "gpu_w2": sd["gpu_w2"].contiguous()})  # copied into the module's layout
        assert laid_out(other) and torch.equal(other(x), want)
        other.load_state_dict({**sd, "gpu_w2": sd["gpu_w2"].contiguous()}, assign=True)  # the layout is lost:
        assert not laid_out(other) and torch.equal(other(x), want)  # a copy a call, the same result
    assert laid_out(copy.deepcopy(moe).to("meta"))  # a device move keeps the strides (meta: no data)
    m64 = copy.deepcopy(moe).to(torch.float64)
    assert laid_out(m64) and m64.gpu_w2.dtype == torch.float64
    ids = torch.tensor([[1, 5], [0, 5], [2, 3]], dtype=torch.int32)
    weights = torch.rand(3, 2, generator=gen)
    with torch.no_grad():
        got = m64._gpu_routed(x[:3].double(), ids, weights)
    ref = _reference.moe_experts(x[:3], torch.where(torch.isin(ids, m64.gpu_ids), ids, -1), weights, w13, w2,
                                 contract=False)
    assert got.dtype == torch.float64 and _rel(got, ref) <= 1e-14


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_experts_moved_to_the_device_later_compute_as_if_placed_there_at_construction(quant):
    # keep_on_device after construction (load_model's gpu_experts: CPU experts quantised, the device's in float
    # from the checkpoint) gives the module gpu_experts= builds: the same placement, bits and state dict
    E, H, inter = 8, 64, 32
    group = 32 if quant == "int4" else None
    gen = torch.Generator().manual_seed(21)
    g, w13, w2 = (torch.randn(*s, generator=gen) for s in ((E, H), (E, 2 * inter, H), (E, H, inter)))
    want = hn.HybridMoE(g, w13, w2, top_k=3, gpu_experts=[2, 5, 6], quant=quant, group_size=group)
    if quant is None:
        moe = hn.HybridMoE(g, w13, w2, top_k=3)
    else:
        moe = hn.HybridMoE(g, quantize(w13, quant, group_size=group), quantize(w2, quant, group_size=group), top_k=3)
    x = torch.randn(11, H, generator=gen)
    with torch.no_grad():
        moe(x)  # routing_counts and an eager call before the move
        moe.keep_on_device(torch.tensor([6, 2, 5]), w13[[2, 5, 6]], w2[[2, 5, 6]])
        assert torch.equal(moe(x), want(x))
    assert moe.gpu_ids.tolist() == [2, 5, 6] and moe.experts.num_experts == 5
    assert moe.routing_counts.sum() == 11 * 3  # counted again from the move on
    sd, ref = moe.state_dict(), want.state_dict()
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd if k != "routing_counts")
    with pytest.raises(ValueError, match="keeps experts on its device already"):
        moe.keep_on_device([1], w13[[1]], w2[[1]])
    fresh = hn.HybridMoE(g, w13, w2, top_k=3)
    with pytest.raises(ValueError, match=r"w13 must be float weights of shape \(2, 64, 64\)"):
        fresh.keep_on_device([1, 2], w13[[1]], w2[[1, 2]])
    with pytest.raises(ValueError, match="distinct expert ids"):
        fresh.keep_on_device([1, 1], w13[[1, 1]], w2[[1, 1]])
    with pytest.raises(TypeError, match="a list of expert ids"):
        fresh.keep_on_device(2, w13[[1, 2]], w2[[1, 2]])
    with pytest.raises(ValueError, match="leave at least one on the CPU"):
        fresh.keep_on_device(list(range(E)), w13, w2)
    assert fresh.gpu_w13 is None and fresh.experts.num_experts == E  # a refused move changes nothing


def test_gpu_experts_under_torch_compile():
    E, H, inter = 8, 16, 8
    gen = torch.Generator().manual_seed(14)
    g, w13, w2 = (torch.randn(*s, generator=gen) for s in ((E, H), (E, 2 * inter, H), (E, H, inter)))
    moe = hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=[1, 5])
    x = torch.randn(9, H, generator=gen)
    with torch.no_grad():
        want = moe(x)
        got = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, want)


def test_patch_with_a_count_uses_calibration():
    m = models.model("v2")
    ids = torch.randint(0, 128, (2, 16))
    ref = _logits(m, ids)
    with pytest.raises(ValueError, match="calibration="):
        hn.patch_model(copy.deepcopy(m), gpu_experts=2, progress=False)
    report = hn.patch_model(m, gpu_experts=2, calibration=ids, progress=False)
    assert all(len(b.gpu_experts) == 2 for b in report.blocks)
    assert "2 kept on" not in str(report) and "4 kept on cpu" in str(report)
    assert _rel(_logits(m, ids), ref) <= _reference.tolerance("hybrid_model_logits", torch.float32)


class _RemoteMLP(torch.nn.Module):
    def __init__(self, H, inter):
        super().__init__()
        self.gate_proj = torch.nn.Linear(H, inter, bias=False)
        self.up_proj = torch.nn.Linear(H, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, H, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _RemoteGate(torch.nn.Module):
    """The attributes of DeepSeek-V3's remote-code MoEGate (noaux_tc routing)."""

    def __init__(self, E, H):
        super().__init__()
        self.top_k, self.n_routed_experts, self.routed_scaling_factor = 3, E, 2.0
        self.scoring_func, self.topk_method, self.n_group, self.topk_group = "sigmoid", "noaux_tc", 4, 2
        self.norm_topk_prob = True
        self.weight = torch.nn.Parameter(torch.randn(E, H) * 0.2)
        self.e_score_correction_bias = torch.nn.Parameter(torch.randn(E) * 0.1)


class _RemoteMoE(torch.nn.Module):
    def __init__(self, E=8, H=32, inter=16):
        super().__init__()
        self.gate = _RemoteGate(E, H)
        self.experts = torch.nn.ModuleList(_RemoteMLP(H, inter) for _ in range(E))
        self.shared_experts = _RemoteMLP(H, inter)

    def forward(self, x):
        """DeepSeek-V3's routing and expert sum, written out in fp32."""
        h = x.reshape(-1, x.shape[-1])
        scores = torch.nn.functional.linear(h, self.gate.weight).sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        groups = choice.view(h.shape[0], 4, -1).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(2, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~keep.repeat_interleave(choice.shape[1] // 4, 1).bool(), float("-inf"))
        idx = choice.topk(3, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.0
        y = torch.stack([sum(w[t, k] * self.experts[int(idx[t, k])](h[t]) for k in range(3))
                         for t in range(h.shape[0])])
        return y.view(x.shape) + self.shared_experts(x)


def test_from_hf_reads_the_remote_code_layout():
    torch.manual_seed(3)
    block = _RemoteMoE()
    x = torch.randn(5, 32)
    with torch.no_grad():
        want, got = block(x), hn.HybridMoE.from_hf(block)(x)
    assert _rel(got, want) <= 4 * _reference.unit_roundoff(torch.float32)


def test_expert_dims_read_every_layout_without_a_copy():
    from hmoe.nn import _hf

    class Transposed(torch.nn.Module):  # transformers' fused experts stored [E, H, 2I] and [E, I, H]
        is_transposed = True

        def __init__(self, E, H, inter):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(E, H, 2 * inter))
            self.down_proj = torch.nn.Parameter(torch.randn(E, inter, H))

    for experts in [models.moe_blocks(models.model("v3"))[0].experts, _RemoteMoE().experts, Transposed(3, 16, 8)]:
        w13, w2 = _hf.expert_weights(experts)
        assert _hf.expert_dims(experts) == (w13.shape[0], w13.shape[2], w2.shape[2], w13.dtype, w13.device)


def test_constructor_errors():
    E, H, inter = 8, 16, 8
    g, w13, w2 = torch.randn(E, H), torch.randn(E, 2 * inter, H), torch.randn(E, H, inter)
    with pytest.raises(ValueError, match="shapes do not fit"):
        hn.HybridMoE(g, w13, torch.randn(E, H, inter + 1), top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        hn.HybridMoE(g, w13, w2, top_k=9)
    # the router options are grouped_topk's, which takes ints only (top_k=2.5 routed 2 experts a token)
    for name, kw in (("top_k", dict(top_k=2.5)), ("top_k", dict(top_k=True)), ("n_group", dict(top_k=2, n_group=2.0)),
                     ("topk_group", dict(top_k=2, n_group=2, topk_group="1"))):
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            hn.HybridMoE(g, w13, w2, **kw)
    assert hn.HybridMoE(g, w13, w2, top_k=np.int64(2), n_group=np.int32(2), topk_group=1).top_k == 2
    with pytest.raises(ValueError, match="scoring"):
        hn.HybridMoE(g, w13, w2, top_k=2, scoring="tanh")
    with pytest.raises(ValueError, match="leave at least one on the CPU"):
        hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=list(range(E)))
    with pytest.raises(ValueError, match="distinct expert ids"):
        hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=[1, 1])
    with pytest.raises(ValueError, match="routing statistics"):
        hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=2)
    for bad in (2.0, [1.5], "01"):
        with pytest.raises(TypeError, match="gpu_experts must be a list of int expert ids or an int count"):
            hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=bad)
    with pytest.raises(TypeError, match="0-dim tensor"):  # a count or one id: ambiguous
        hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=torch.tensor(2))
    assert hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=torch.tensor([2])).gpu_ids.tolist() == [2]
    with pytest.raises(TypeError, match="3-d torch tensor"):
        hn.HybridMoE(g, w13[0], w2, top_k=2)
    moe = hn.HybridMoE(g, w13, w2, top_k=2)
    with pytest.raises(ValueError, match=r"expected \[..., 16\]"):
        moe(torch.randn(3, 17))


def test_any_layout_of_hidden_states():
    E, H, inter = 8, 16, 8
    gen = torch.Generator().manual_seed(5)
    g, w13, w2 = (torch.randn(*s, generator=gen) for s in ((E, H), (E, 2 * inter, H), (E, H, inter)))
    moe = hn.HybridMoE(g, w13, w2, top_k=2, gpu_experts=[np.int64(1)])
    x = torch.randn(H, 5, generator=gen)
    assert torch.equal(moe(x.t()), moe(x.t().contiguous()))  # a transposed view, as a drop-in module gets
    y = torch.randn(2, 3, 2 * H, generator=gen)[..., ::2]  # strided in the last dim
    assert torch.equal(moe(y), moe(y.contiguous()))


def test_experts_implementation_hmoe_in_transformers():
    name = hn.register_experts_implementation()
    m = models.model("v3")
    ids = torch.randint(0, 128, (2, 9))
    ref = _logits(m, ids)
    m.set_experts_implementation(name)
    assert m.config._experts_implementation == "hmoe"
    got = _logits(m, ids)
    assert _rel(got, ref) <= _reference.tolerance("hybrid_model_logits", torch.float32)
    block = models.moe_blocks(m)[0]
    assert isinstance(block.experts._hmoe_experts[1], hn.CPUExperts)
    with torch.no_grad():  # new weights are packed again
        block.experts.down_proj.mul_(2)
    got = _logits(m, ids)
    assert block.experts._hmoe_experts[0][3] == block.experts.down_proj._version
    # and computed with: the logits are those of transformers' own experts on the new weights
    m.set_experts_implementation("eager")
    want = _logits(m, ids)
    assert _rel(want, ref) > 10 * _reference.tolerance("hybrid_model_logits", torch.float32)  # the change shows
    assert _rel(got, want) <= _reference.tolerance("hybrid_model_logits", torch.float32)


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_static_cache_decoder_matches_generate(kind):
    """GraphDecoder's static cache and explicit masks, run eagerly (capture=False) on the CPU."""
    m = models.model(kind)
    hn.patch_model(m, progress=False)
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    got = hn.GraphDecoder(m, batch_size=2, max_cache_len=32, capture=False).generate(prompt, 8)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        hn.GraphDecoder(m, batch_size=2, max_cache_len=32)


def test_decoder_refuses_what_it_cannot_run():
    m = models.model("v3")
    hn.patch_model(m, progress=False)
    with pytest.raises(TypeError, match="model must be a transformers causal LM"):
        hn.GraphDecoder(torch.nn.Linear(4, 4), batch_size=1, max_cache_len=16, capture=False)
    for kw in ({"batch_size": 0, "max_cache_len": 16}, {"batch_size": 1, "max_cache_len": -1},
               {"batch_size": 1.5, "max_cache_len": 16}, {"batch_size": True, "max_cache_len": 16}):
        with pytest.raises(ValueError, match="must be a positive int"):
            hn.GraphDecoder(m, capture=False, **kw)
    dec = hn.GraphDecoder(m, batch_size=2, max_cache_len=16, capture=False)
    with pytest.raises(RuntimeError, match=r"call prefill\(input_ids\) first"):  # it decoded from an empty cache
        dec.step(torch.zeros(2, dtype=torch.long))
    dec.prefill(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="ids must be a tensor of 2 token ids"):
        dec.step(torch.zeros(3, dtype=torch.long))
    assert dec.step(torch.zeros(2, dtype=torch.long)).shape[0] == 2


def test_group_size_without_quant_is_refused():
    m = models.model("v3")
    with pytest.raises(ValueError, match="group_size=64 applies to quant='int8' or 'int4'"):
        hn.patch_model(m, group_size=64, progress=False)


def test_decoder_passes_the_cache_under_the_forwards_own_name():
    """transformers renamed the forward's past_key_values to cache (the old name warns): GraphDecoder
    uses whichever name the model's forward declares."""
    from hmoe.nn.decode import _cache_keyword

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return input_ids

    assert _cache_keyword(New()) == "cache" and _cache_keyword(Old()) == "past_key_values"
    m = models.model("v3")
    hn.patch_model(m, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hn.GraphDecoder(m, batch_size=1, max_cache_len=16, capture=False).generate(torch.zeros(1, 3, dtype=torch.long), 2)
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_forward_with_grad_warns_that_it_is_inference_only():
    m = models.model("v3")
    block = hn.HybridMoE.from_hf(models.moe_blocks(m)[0])
    x = torch.randn(3, 64, requires_grad=True)
    with pytest.warns(UserWarning, match="inference-only"):
        block(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block(x)  # once per module
        with torch.no_grad():
            block(x)


# Logits of the quantised model against the fp32 original: measured 1.6e-3 (int8), 1.8e-2 (int4 in
# groups of 32), 5.0e-3 (fp8) on this small model; the bounds leave 5x (int4 2x: its routed experts
# halved move the logits by 5.5e-2, returning zeros by 0.11). The fp16 V2 model against its
# unquantised self (tol16): measured 7.7e-4, 4.3e-3, 1.4e-3, bounds 5x; its routed experts returning
# zeros moves its logits by 2.7e-2 only, which every bound must stay below.
# The kernels' own precision is tested against references in tests/ops/test_moe_experts_quant.py.
@pytest.mark.parametrize("quant,group_size,tol,tol16", [("int8", None, 0.01, 0.004), ("int4", 32, 0.04, 0.022),
                                                        ("fp8", None, 0.025, 0.007)])
def test_patch_with_quantised_experts(quant, group_size, tol, tol16):
    """The CPU experts quantised as they are packed: the model still computes nearly what it did (an
    int4 model less nearly), every block runs the quantised kernels, and the report says so."""
    m = models.model("v3")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    ref = _logits(m, ids)
    report = hn.patch_model(m, quant=quant, group_size=group_size, progress=False)
    assert all(b.experts.format == quant for b in _moe(m)) and f"float32 as {quant}" in str(report)
    assert _rel(_logits(m, ids), ref) < tol
    m16 = models.model("v2", torch.float16)
    ref16 = _logits(m16, ids)
    hn.patch_model(m16, quant=quant, group_size=group_size, progress=False)
    x = torch.randn(5, m16.config.hidden_size, dtype=torch.float16)
    assert all(b(x).dtype == torch.float16 for b in _moe(m16))
    assert _rel(_logits(m16, ids), ref16) < tol16  # it computes with them too, not only in fp16


def test_router_follows_a_changed_gate_weight():
    # the fp32 copy of a bf16 router weight is kept between calls and remade when the weight changes
    from hmoe import ops

    m = models.model("v3", torch.bfloat16)
    hn.patch_model(m, progress=False)
    block = _moe(m)[0]
    x = torch.randn(5, block.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def expected():
        logits = torch.nn.functional.linear(x.float(), block.gate_weight.float())
        return ops.grouped_topk(logits, block.top_k, n_group=block.n_group, topk_group=block.topk_group,
                                scoring=block.scoring, bias=block.e_score_correction_bias,
                                renormalize=block.renormalize, routed_scaling_factor=block.routed_scaling_factor)

    for _ in range(2):
        got, want = block.route(x), expected()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        before = got[1]
        with torch.no_grad():
            block.gate_weight.copy_(-block.gate_weight)
        got, want = block.route(x), expected()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and not torch.equal(got[1], before)


def test_an_empty_batch_gives_an_empty_output():
    m = models.model("v3")
    block = hn.HybridMoE.from_hf(models.moe_blocks(m)[0])
    for shape in ((0, 64), (2, 0, 64)):
        with torch.no_grad():
            y = block(torch.randn(*shape))
        assert y.shape == shape and y.dtype == torch.float32
