"""GraphDecoder.generate: prompts of different lengths in one batch (attention_mask), where every row
decodes as it would alone, padding on either side, with the model's attention and with the absorbed MLA
decode; and end-of-sequence tokens (eos_token_id), as transformers' generate treats them. On the CPU
(capture=False) and on a GPU in CUDA graphs (tests marked gpu)."""
import pytest
import torch

import hmoe.nn as hn
from hmoe import _reference
from hmoe.nn import _mla

from . import models

LENGTHS = (7, 3, 5)  # the longest first, the shortest second: padded rows on both sides of a full one


def _padded(lengths, side, device="cpu", seed=11, pad=0):
    """(input_ids [B, L], attention_mask [B, L], prompts): random prompts padded with `pad` on `side`."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (n,), generator=gen) for n in lengths]
    L = max(lengths)
    ids = torch.full((len(lengths), L), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, p in enumerate(prompts):
        cols = slice(L - len(p), L) if side == "left" else slice(0, len(p))
        ids[b, cols], mask[b, cols] = p, 1
    return ids.to(device), mask.to(device), [p.to(device) for p in prompts]


def _alone(model, prompts, steps, **kw):
    """Each prompt's greedy continuation decoded alone (batch 1, no padding)."""
    return [hn.GraphDecoder(model, batch_size=1, max_cache_len=32, **kw).generate(p.view(1, -1), steps)[0, len(p):]
            for p in prompts]


@pytest.mark.parametrize("attention", ["model", "hmoe"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_each_padded_row_decodes_as_it_would_alone(kind, side, attention):
    m = models.model(kind)
    hn.patch_model(m, progress=False)
    ids, mask, prompts = _padded(LENGTHS, side)
    dec = hn.GraphDecoder(m, batch_size=3, max_cache_len=32, capture=False, attention=attention)
    got = dec.generate(ids, 12, attention_mask=mask)
    assert dec.attention == attention
    assert got.shape == (3, 7 + 12) and torch.equal(got[:, :7], ids)  # the prompts as given, padding included
    want = _alone(m, prompts, 12, capture=False, attention=attention)
    for b in range(3):
        assert torch.equal(got[b, 7:], want[b]), b


def test_padded_rows_match_transformers_generate():
    """transformers' generate with left padding gives each row positions from the mask (cumsum - 1), as
    GraphDecoder does."""
    m = models.model("v3")
    hn.patch_model(m, progress=False)
    ids, mask, _ = _padded(LENGTHS, "left", seed=12)
    with torch.no_grad():
        want = m.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                          pad_token_id=0)
    for attention in ("model", "hmoe"):
        got = hn.GraphDecoder(m, batch_size=3, max_cache_len=32, capture=False, attention=attention).generate(
            ids, 10, attention_mask=mask)
        assert torch.equal(got, want), attention


def test_prefill_returns_each_rows_last_prompt_logits():
    m = models.model("v2")
    ids, mask, prompts = _padded(LENGTHS, "right", seed=13, pad=5)
    dec = hn.GraphDecoder(m, batch_size=3, max_cache_len=16, capture=False)
    got = dec.prefill(ids, mask)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            want = m(p.view(1, -1)).logits[0, -1]
        assert _rel(got[b], want) <= 8 * _reference.unit_roundoff(torch.float32), b
    full = torch.ones_like(mask)  # an all-ones mask is no padding: the last column for every row
    assert torch.equal(dec.prefill(ids, full), dec.prefill(ids))


def test_a_padded_row_in_the_modules_own_cache_update():
    """A layer whose latent norm hmoe does not know appends through cache.update, which writes every row at
    one slot: each row's token still lands at its own position."""
    m = models.model("v3")
    hn.patch_model(m, progress=False)
    layer = _mla.attention_modules(m)[1]
    layer.kv_a_layernorm = torch.nn.RMSNorm(layer.kv_lora_rank, eps=layer.kv_a_layernorm.variance_epsilon)
    ids, mask, prompts = _padded(LENGTHS, "left", seed=14)
    dec = hn.GraphDecoder(m, batch_size=3, max_cache_len=32, capture=False, attention="hmoe")
    got = dec.generate(ids, 10, attention_mask=mask)
    assert dec._absorbed.appends == 9 * 2  # the other two layers went through mla_rope_append's math
    want = _alone(m, prompts, 10, capture=False, attention="model")
    for b in range(3):
        assert torch.equal(got[b, 7:], want[b]), b


def test_bad_attention_masks_are_refused():
    m = models.model("v3")
    dec = hn.GraphDecoder(m, batch_size=2, max_cache_len=16, capture=False)
    ids = torch.zeros(2, 4, dtype=torch.long)
    for bad, err, match in ((torch.ones(2, 3, dtype=torch.long), ValueError, r"must be a \[2, 4\] tensor"),
                            ([[1, 1, 1, 1]] * 2, ValueError, "got list"),
                            (torch.ones(2, 4), TypeError, "bool or integer"),
                            (torch.full((2, 4), 2), ValueError, "other than 0 and 1"),
                            (torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]), ValueError, r"row\(s\) \[1\]")):
        with pytest.raises(err, match=match):
            dec.prefill(ids, bad)
    assert dec.prefill(ids, torch.tensor([[True, True, False, False], [True] * 4])).shape[0] == 2


def _rel(a, b):
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_padded_rows_in_cuda_graphs_with_the_absorbed_decode(kind):
    """bf16, the absorbed decode (hmoe.ops.mla_rope_append and mla_decode at each row's own position) in
    CUDA graphs: the padded batch's steps against each row decoded alone with the model's attention, all
    fed the same tokens; and the graph's replays against the same batch run eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    m = models.model(kind, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64).cuda()
    hn.patch_model(m, progress=False)
    ids, mask, prompts = _padded((9, 2, 5), "left", device="cuda", seed=15)
    steps = 12
    refs, tokens = [], []
    for p in prompts:  # each row alone, greedy: the tokens every decoder is fed
        alone = hn.GraphDecoder(m, batch_size=1, max_cache_len=64, capture=False, attention="model")
        logits, fed = [alone.prefill(p.view(1, -1))[0].clone()], []
        for _ in range(steps):
            fed.append(logits[-1].argmax())
            logits.append(alone.step(fed[-1].view(1))[0].clone())
        refs.append(logits)
        tokens.append(torch.stack(fed))
    tokens = torch.stack(tokens, 1)  # [steps, 3]
    runs = {}
    for capture in (True, False):
        dec = hn.GraphDecoder(m, batch_size=3, max_cache_len=64, capture=capture)
        assert dec.attention == "hmoe"
        out = [dec.prefill(ids, mask).clone()]
        out += [dec.step(t).clone() for t in tokens]
        assert (dec._graph is not None) == capture
        runs[capture] = out
    tol = _reference.tolerance("absorbed_mla_logits", torch.bfloat16)
    for b in range(3):
        errs = [_rel(step[b], ref) for step, ref in zip(runs[True], refs[b])]
        # a routing choice that rounding flips is a different function, not an error: a step or two may differ more
        assert sum(e <= tol for e in errs) >= len(errs) - 2, (b, errs)
    for replay, eager in zip(runs[True][2:], runs[False][2:]):  # the graph replays what the eager step runs
        assert _rel(replay, eager) <= _reference.unit_roundoff(torch.bfloat16)


def _stopped(free, L, eos, pad, max_new):
    """What generate with eos_token_id gives, from the tokens it gives without (rows are independent): a
    row's tokens after its first eos are pad, and the result ends once every row has produced one."""
    finished, cols = torch.zeros(free.shape[0], dtype=torch.bool, device=free.device), []
    for t in range(max_new):
        col = torch.where(finished, torch.tensor(pad, device=free.device), free[:, L + t])
        finished |= torch.isin(col, torch.tensor(eos, device=free.device))
        cols.append(col)
        if finished.all():
            break
    return torch.cat([free[:, :L], torch.stack(cols, 1)], 1)


@pytest.mark.parametrize("attention", ["model", "hmoe"])
def test_eos_ends_rows_as_transformers_generate_does(attention):
    m = models.model("v3")
    hn.patch_model(m, progress=False)
    ids, mask, _ = _padded(LENGTHS, "left", seed=16)
    dec = hn.GraphDecoder(m, batch_size=3, max_cache_len=32, capture=False, attention=attention)
    free = dec.generate(ids, 12, attention_mask=mask)
    eos = int(free[0, 7 + 3])  # row 0's fourth new token
    got = dec.generate(ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, _stopped(free, 7, [eos], 0, 12))
    assert (got[0, 7 + 4:] == 0).all() and got.shape[1] <= 7 + 12
    with torch.no_grad():
        want = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)
    assert torch.equal(got, want)
    every = sorted({int(free[b, 7 + 1]) for b in range(3)})  # each row's second new token: all end early
    short = dec.generate(ids, 12, attention_mask=mask, eos_token_id=every)
    assert torch.equal(short, _stopped(free, 7, every, every[0], 12)) and short.shape[1] < 7 + 12


def test_generate_refuses_bad_arguments():
    m = models.model("v3")
    dec = hn.GraphDecoder(m, batch_size=1, max_cache_len=16, capture=False)
    ids = torch.zeros(1, 3, dtype=torch.long)
    for n in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
            dec.generate(ids, n)
    for eos in ("a", -1, [], [1, 2.0], torch.tensor([-3])):
        with pytest.raises(ValueError, match="eos_token_id must be a token id or a list of them"):
            dec.generate(ids, 2, eos_token_id=eos)
    with pytest.raises(ValueError, match="pad_token_id must be a token id"):
        dec.generate(ids, 2, eos_token_id=1, pad_token_id=-1)
    with pytest.raises(ValueError, match="needs eos_token_id"):
        dec.generate(ids, 2, pad_token_id=0)
    assert dec.generate(ids, 2, eos_token_id=torch.tensor([5, 6])).shape[0] == 1


@pytest.mark.gpu
def test_eos_in_cuda_graphs_reads_the_end_one_step_late():
    """bf16 in CUDA graphs: generate with eos_token_id gives the tokens of generate without it, ended as
    transformers would end them, though the host learns that every row has finished one step late."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    m = models.model("v2", torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64).cuda()
    hn.patch_model(m, progress=False)
    ids, mask, _ = _padded((6, 3), "left", device="cuda", seed=17)
    dec = hn.GraphDecoder(m, batch_size=2, max_cache_len=64)
    dec.generate(ids, 3, attention_mask=mask)  # the eager first step and the capture: every later step replays
    assert dec._graph is not None
    free = dec.generate(ids, 16, attention_mask=mask)
    for eos in ([int(free[1, 6 + 2])], sorted({int(free[0, 6 + 4]), int(free[1, 6 + 1])})):
        got = dec.generate(ids, 16, attention_mask=mask, eos_token_id=eos, pad_token_id=127)
        assert torch.equal(got, _stopped(free, 6, eos, 127, 16)), eos
