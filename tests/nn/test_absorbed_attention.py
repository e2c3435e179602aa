"""GraphDecoder(attention="hmoe"): the absorbed MLA decode of transformers' DeepSeek-V2/V3 attention
(hmoe/nn/_mla.py) against the model's own attention; on the CPU through its fp32 torch path, on a GPU
(tests marked gpu) through hmoe.ops.mla_decode inside CUDA-graph steps."""
import pytest
import torch

import hmoe
import hmoe.nn as hn
from hmoe import _reference
from hmoe.nn import _mla

from . import models

CONFIGS = [("v2", {}), ("v2", {"q_lora_rank": None}), ("v3", {"rope_interleave": True}),
           ("v3", {"rope_interleave": False, "q_lora_rank": None})]


def _rel(a, b):
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _counting(monkeypatch, name):
    calls = []
    real = getattr(_mla, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_mla, name, counted)
    return calls


def _teacher_forced(model, prompt, steps, **kw):
    """Logits of the prompt's prefill and of `steps` decode steps of each decoder, all fed the model
    attention's greedy tokens (so that both decode the same sequence)."""
    mine, out, _ = _teacher_forced_routing(model, prompt, steps, **kw)
    return mine, out


def _routing_probe(model):
    """A function that returns what the model's MoE routing chose since its previous call: hmoe.nn's
    HybridMoE blocks count their routing on the device (inside graphs too); transformers' own blocks are
    read through a hook on their gate (eager calls), whose output ends with the top-k expert ids."""
    blocks = [b for b in model.modules() if isinstance(b, hn.HybridMoE)]
    if blocks:
        state = [[b.routing_counts.clone() for b in blocks]]

        def counts():
            now = [b.routing_counts.clone() for b in blocks]
            delta = [n - s for n, s in zip(now, state[0])]
            state[0] = now
            return delta

        return counts
    seen = []
    for block in models.moe_blocks(model):
        block.gate.register_forward_hook(
            lambda mod, args, out: seen.append(out[-1].sort(-1).values.clone()) if isinstance(out, tuple) else None)

    def hooked():
        out = list(seen)
        seen.clear()
        return out

    return hooked


def _teacher_forced_routing(model, prompt, steps, **kw):
    """_teacher_forced, and for each pair whether the two decoders' routing differed in any MoE layer.
    A token routed to another expert goes through a different function: the rounding differences of two
    attentions flip a close choice now and then, and that step's logits may then differ by more than
    rounding."""
    probe = _routing_probe(model)
    mine = hn.GraphDecoder(model, batch_size=prompt.shape[0], max_cache_len=40, **kw)
    theirs = hn.GraphDecoder(model, batch_size=prompt.shape[0], max_cache_len=40, capture=False, attention="model")
    out, flipped = [(mine.prefill(prompt).clone(), theirs.prefill(prompt))], [False]
    for _ in range(steps):
        nxt = out[-1][1].argmax(-1)
        probe()
        a = mine.step(nxt).clone()
        routed = probe()
        out.append((a, theirs.step(nxt)))
        other = probe()
        flipped.append(len(routed) != len(other) or any(not torch.equal(x, y) for x, y in zip(routed, other)))
    return mine, out, flipped


@pytest.mark.parametrize("kind,kw", CONFIGS, ids=lambda c: str(c))
def test_absorbed_decode_matches_the_model_on_the_cpu(kind, kw, monkeypatch):
    calls = _counting(monkeypatch, "_attend_cpu")
    m = models.model(kind, **kw)
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    dec, pairs = _teacher_forced(m, prompt, 12, capture=False, attention="hmoe")
    assert dec.attention == "hmoe" and "absorbed MLA decode of 3 attention modules" in dec.attention_reason
    assert len(calls) == 12 * 3  # every decode step of every layer ran absorbed; the prefill did not
    assert dec._absorbed.appends == 12 * 3  # and appended through mla_rope_append's math
    assert dec.attention_reason.endswith("cache append of 3 of 3 layers in one hmoe.ops.mla_rope_append each")
    assert dec.cache.get_seq_length() == 5 + 12  # the cache's own count of its tokens is kept
    for mine, theirs in pairs:
        assert _rel(mine, theirs) <= _reference.tolerance("absorbed_mla_logits", torch.float32)
    assert all("forward" not in mod.__dict__ for mod in _mla.attention_modules(m))  # uninstalled after each step
    want = hn.GraphDecoder(m, batch_size=2, max_cache_len=40, capture=False, attention="model").generate(prompt, 20)
    got = hn.GraphDecoder(m, batch_size=2, max_cache_len=40, capture=False, attention="hmoe").generate(prompt, 20)
    assert torch.equal(got, want)


def test_absorbed_decode_of_a_patched_model(monkeypatch):
    m = models.model("v3")
    hn.patch_model(m, progress=False)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    want = hn.GraphDecoder(m, batch_size=1, max_cache_len=30, capture=False, attention="model").generate(prompt, 16)
    got = hn.GraphDecoder(m, batch_size=1, max_cache_len=30, capture=False, attention="hmoe").generate(prompt, 16)
    assert torch.equal(got, want)


def test_a_norm_it_does_not_know_keeps_the_modules_own_steps():
    # One layer's latent norm replaced by torch's RMSNorm: that layer's steps use its own norm, rotary
    # embedding and cache.update; the others go through mla_rope_append's math; the logits still match.
    m = models.model("v2")
    mod = _mla.attention_modules(m)[1]
    norm = torch.nn.RMSNorm(mod.kv_lora_rank, eps=mod.kv_a_layernorm.variance_epsilon)
    norm.weight.data.copy_(mod.kv_a_layernorm.weight)
    mod.kv_a_layernorm = norm
    prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(4))
    dec, pairs = _teacher_forced(m, prompt, 5, capture=False, attention="hmoe")
    assert dec._absorbed.appends == 5 * 2 and "append of 2 of 3 layers" in dec.attention_reason
    for mine, theirs in pairs:
        assert _rel(mine, theirs) <= _reference.tolerance("absorbed_mla_logits", torch.float32)


def test_an_instance_forward_set_before_is_kept():
    m = models.model("v3")
    mod = _mla.attention_modules(m)[1]
    seen = []
    original = mod.forward

    def wrapped(hidden_states, *args, **kwargs):
        seen.append(hidden_states.shape[1])
        return original(hidden_states, *args, **kwargs)

    mod.forward = wrapped
    prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    hn.GraphDecoder(m, batch_size=1, max_cache_len=12, capture=False, attention="hmoe").generate(prompt, 3)
    assert mod.__dict__["forward"] is wrapped and seen == [4]  # the prompt went through it, the steps did not


def test_attention_choice_and_its_reasons():
    m = models.model("v2")
    auto = hn.GraphDecoder(m, batch_size=1, max_cache_len=8, capture=False)
    assert auto.attention == "model" and "CUDA devices only" in auto.attention_reason
    assert hn.GraphDecoder(m, batch_size=1, max_cache_len=8, capture=False, attention="model").attention_reason == \
        "attention='model'"
    with pytest.raises(ValueError, match="attention must be one of 'auto', 'hmoe', 'model', got 'mla'"):
        hn.GraphDecoder(m, batch_size=1, max_cache_len=8, capture=False, attention="mla")
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match="attention='hmoe' cannot run this model: the model has no DeepSeek MLA"):
        hn.GraphDecoder(llama, batch_size=1, max_cache_len=8, capture=False, attention="hmoe")
    assert hn.GraphDecoder(llama, batch_size=1, max_cache_len=8, capture=False).attention == "model"


def test_what_the_cuda_path_needs_is_checked_without_a_gpu():
    cuda = torch.device("cuda", 0)
    small = _mla.attention_modules(models.model("v3"))
    assert "takes bf16 or fp16" in _mla.unsupported(small, cuda, torch.float32, 1, 64)
    assert "kv_lora_rank 16 and qk_rope_head_dim 8" in _mla.unsupported(small, cuda, torch.bfloat16, 1, 64)
    real = _mla.attention_modules(models.model("v3", kv_lora_rank=512, qk_rope_head_dim=64))
    why = _mla.unsupported(real, cuda, torch.bfloat16, 1, 64)  # hmoe.dispatch's choice of a variant decides
    runs = torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 0)
    if runs and hmoe.build_info()["cuda_kernels"]:
        assert why == ""
    elif runs:  # a GPU, but a build without CUDA kernels (HMOE_CUDA=OFF)
        assert why.startswith("hmoe.ops.mla_decode cannot run on cuda:0: NoGpuVariant: no GPU kernels"), why
    else:
        assert why.startswith("hmoe.ops.mla_decode cannot run on cuda:0: "), why
    assert "runs on CUDA devices" in _mla.unsupported(real, torch.device("meta"), torch.bfloat16, 1, 64)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        _mla.AbsorbedDecode(real, 1, 40, cuda)


def test_the_route_is_asked_about_the_decoders_own_calls(monkeypatch):
    """The variant check routes the shape GraphDecoder's mla_decode calls have (its batch, its cache as
    whole pages), so a route that depends on the shape is asked about the calls that will run, and a
    forced variant that declines them is the reason the model keeps its attention."""
    asked = []

    def route(*args):
        asked.append(args)
        if args[1] == 3:
            raise ValueError("mla_decode: HMOE_CUDA_VARIANT='sm90a' does not serve this shape")
    monkeypatch.setattr(_mla.mla, "route", route)
    real = _mla.attention_modules(models.model("v3", kv_lora_rank=512, qk_rope_head_dim=64))
    heads = real[0].num_heads
    assert _mla.unsupported(real, torch.device("cuda", 1), torch.bfloat16, 8, 4097) == ""
    assert asked == [(1, 8, heads, 65, _mla.PAGE)]
    why = _mla.unsupported(real, torch.device("cuda", 0), torch.float16, 3, 64)
    assert asked[-1] == (0, 3, heads, 1, _mla.PAGE)
    assert why == ("hmoe.ops.mla_decode cannot run on cuda:0: ValueError: mla_decode: HMOE_CUDA_VARIANT='sm90a' "
                   "does not serve this shape"), why
    assert _mla.choose(real, "auto", torch.device("cuda", 0), torch.float16, 3, 64) == (False, why)
    with pytest.raises(ValueError, match="attention='hmoe' cannot run this model: hmoe.ops.mla_decode cannot run"):
        _mla.choose(real, "hmoe", torch.device("cuda", 0), torch.float16, 3, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v3", "v2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("patched", [False, True], ids=["original", "patched"])
def test_absorbed_decode_on_the_gpu_in_cuda_graphs(kind, dtype, patched, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    calls = _counting(monkeypatch, "_attend_cpu")
    m = models.model(kind, dtype, kv_lora_rank=512, qk_rope_head_dim=64).cuda()
    if patched:
        hn.patch_model(m, progress=False)
    prompt = torch.randint(0, 128, (2, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    # attention="auto"; transformers' own routed experts (torch._grouped_mm with host offsets) cannot be
    # captured, so the original model decodes eagerly and the patched one in CUDA graphs
    dec, pairs, flipped = _teacher_forced_routing(m, prompt, 12, capture=patched)
    assert dec.attention == "hmoe" and "hmoe.ops.mla_decode" in dec.attention_reason
    assert (dec._graph is not None) == patched and dec._cache_len == 64 and not calls
    assert dec.attention_reason.endswith("append of 3 of 3 layers in one hmoe.ops.mla_rope_append each")
    errs = [_rel(mine, theirs) for mine, theirs in pairs]
    same = [e for e, f in zip(errs, flipped) if not f]  # steps whose routing matched (see _teacher_forced_routing)
    assert len(same) >= len(errs) - 2 and max(same) <= _reference.tolerance("absorbed_mla_logits", dtype), \
        (errs, flipped)


@pytest.mark.gpu
def test_absorbed_decode_over_several_pages_per_row(monkeypatch):
    """Rows of three 64-token pages each (the static cache viewed as mla_decode's page table), steps
    that cross a page boundary, three sequences."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    m = models.model("v2", torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, max_position_embeddings=256).cuda()
    hn.patch_model(m, progress=False)
    prompt = torch.randint(0, 128, (3, 120), device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    mine = hn.GraphDecoder(m, batch_size=3, max_cache_len=150)
    theirs = hn.GraphDecoder(m, batch_size=3, max_cache_len=150, capture=False, attention="model")
    assert mine.attention == "hmoe" and mine._cache_len == 192
    assert mine._absorbed.page_table.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    pairs = [(mine.prefill(prompt).clone(), theirs.prefill(prompt))]
    for _ in range(12):  # positions 120..131: across the boundary at 128
        nxt = pairs[-1][1].argmax(-1)
        pairs.append((mine.step(nxt).clone(), theirs.step(nxt)))
    errs = [_rel(a, b) for a, b in pairs]
    assert max(errs) <= _reference.tolerance("absorbed_mla_logits", torch.bfloat16), errs
