"""hmoe.nn.GraphDecoder: greedy decoding of a transformers causal LM with each decode step replayed
from one CUDA graph (HybridMoE's CPU experts run inside it, handed over by doorbells or host
functions: hmoe/nn/_staging.py)."""
from __future__ import annotations

import contextlib
import inspect

import torch

from .. import validation as V
from . import _mla, _staging

ATTENTIONS = ("auto", "hmoe", "model")


def _parameters(model):
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _cache_keyword(model) -> str:
    """The name under which the model's forward takes its cache: "cache" where the forward declares it
    (transformers renamed past_key_values to cache; its forwards still take the old name, with a
    deprecation warning), else "past_key_values"."""
    return "cache" if "cache" in _parameters(model) else "past_key_values"


def _prompt_lengths(input_ids, attention_mask):
    """Each row's prompt length [B] (int64, on input_ids' device) and the order that packs its tokens to
    the front ([B, L], or None when no row is padded); attention_mask checked."""
    B, L = input_ids.shape
    if attention_mask is None:
        return torch.full((B,), L, dtype=torch.long, device=input_ids.device), None
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, L):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"GraphDecoder.prefill: attention_mask must be a [{B}, {L}] tensor like input_ids, got {got}")
    if attention_mask.dtype != torch.bool and (attention_mask.is_floating_point() or attention_mask.is_complex()):
        raise TypeError(f"GraphDecoder.prefill: attention_mask must be bool or integer (1 for a prompt's tokens, 0 "
                        f"for padding), got {attention_mask.dtype}")
    mask = attention_mask.to(input_ids.device)
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("GraphDecoder.prefill: attention_mask holds values other than 0 and 1")
    kept = mask.bool()
    lens = kept.sum(1)
    empty = (lens == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"GraphDecoder.prefill: row(s) {empty} of attention_mask have no token: every prompt needs "
                         "at least one")
    if bool((lens == L).all()):
        return lens, None
    return lens, torch.argsort((~kept).to(torch.uint8), dim=1, stable=True)  # the kept tokens first, in order


class GraphDecoder:
    """GraphDecoder(model, *, batch_size, max_cache_len, capture=True, attention="auto") for a transformers
    causal LM.

    prefill(input_ids [B, L], attention_mask=None) runs the prompts eagerly into a StaticCache and
    returns each one's last logits [B, V]; step(ids [B]) runs one decode step and returns its logits
    [B, V] (a view of a static buffer: copy it to keep it). Prompts of different lengths come padded to
    L with attention_mask [B, L] (1 for a prompt's tokens, 0 for padding, on either side, as a
    tokenizer's padding gives it): each row's prompt is its tokens where the mask is 1, in order, at
    positions 0, 1, ... and every row then decodes at its own next position, as if alone (padding is
    never attended to). The first step runs eagerly (warm-up: HybridMoE creates its
    pinned buffers), the second captures the step in a CUDA graph, and every later one replays it
    with the current tokens, position and mask, all fed through static tensors. The attention mask
    is passed explicitly as a 4-d additive mask over the cache, so nothing in the step depends on
    data the host would have to read. generate() is greedy decoding on top of these.

    synchronize() waits for the steps enqueued so far without spinning (a blocking-sync CUDA event):
    a host thread spinning in torch.cuda.synchronize() takes a core from the CPU experts for the
    whole wait. generate() ends with it.

    attention: what runs the decode steps' attention of a DeepSeek-V2/V3 model. "hmoe": the absorbed
    MLA decode (hmoe/nn/_mla.py) on the latents the static cache holds, through hmoe.ops.mla_decode on a
    CUDA device (bf16/fp16, kv_lora_rank 512, rope 64) and through the same math in fp32 torch on the
    CPU; transformers' own attention instead expands the whole cache through kv_b_proj at every step.
    "model": the model's own attention. "auto" (default): "hmoe" where it runs (a DeepSeek MLA model on
    a CUDA device with those dimensions), else "model". self.attention says which, and
    self.attention_reason why (after the first step, also in how many layers hmoe.ops.mla_rope_append
    prepared the attention's inputs: where the module's latent norm and rotary embedding are transformers'
    DeepSeek ones). The prompt (prefill) always runs the model's own attention. On CUDA with
    "hmoe", the static cache is max_cache_len rounded up to a multiple of 64 tokens (mla_decode's pages).
    """

    def __init__(self, model, *, batch_size: int, max_cache_len: int, capture: bool = True,
                 attention: str = "auto"):
        from transformers import StaticCache

        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"GraphDecoder: model must be a transformers causal LM (a torch.nn.Module with a "
                            f"config), got {type(model).__name__}")
        for name, v in (("batch_size", batch_size), ("max_cache_len", max_cache_len)):
            if not V.is_int(v) or v < 1:
                raise ValueError(f"GraphDecoder: {name} must be a positive int, got {v!r}")
        self.model, self.batch, self.max_len, self.capture = model, int(batch_size), int(max_cache_len), capture
        self.device = next(model.parameters()).device
        if self.device.type != "cuda" and capture:
            raise ValueError(f"GraphDecoder: the model is on {self.device}; CUDA graphs need a CUDA device "
                             "(capture=False decodes eagerly through the same static cache)")
        if attention not in ATTENTIONS:
            raise ValueError(f"GraphDecoder: attention must be one of {', '.join(map(repr, ATTENTIONS))}, "
                             f"got {attention!r}")
        self.dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        self._cache_kw = _cache_keyword(model)
        modules = _mla.attention_modules(model)
        absorbed, self.attention_reason = _mla.choose(modules, attention, self.device, self.dtype, self.batch,
                                                      self.max_len)
        self.attention = "hmoe" if absorbed else "model"
        cache_len = self.max_len
        if absorbed and self.device.type == "cuda":
            cache_len = -(-self.max_len // _mla.PAGE) * _mla.PAGE
        self._absorbed = _mla.AbsorbedDecode(modules, self.batch, cache_len, self.device) if absorbed else None
        self._cache_len = cache_len
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        self._ids = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)  # the step's cache slot
        self._positions = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)  # each row's position
        self._mask = torch.zeros(self.batch, 1, 1, cache_len, dtype=self.dtype, device=self.device)
        self._slots = torch.arange(cache_len, device=self.device)
        self._lens = torch.zeros(self.batch, dtype=torch.long, device=self.device)  # each prompt's tokens
        self._kept = torch.ones(self.batch, 1, 1, cache_len, dtype=torch.bool, device=self.device)  # not padding
        self._keep_kw = "logits_to_keep" in _parameters(model)
        self._prompt = 0  # the prompt's slots (L)
        self._graph = self._logits = None
        self._done = torch.cuda.Event(blocking=True) if self.device.type == "cuda" else None
        self._steps = 0
        self.length = 0

    def _forward(self, ids, pos, mask, positions, **kw):
        out = self.model(input_ids=ids, cache_position=pos, position_ids=positions, attention_mask=mask,
                         use_cache=True, **{self._cache_kw: self.cache}, **kw)
        if self._absorbed is not None:
            self._absorbed.finish_step()
        return out.logits

    def _set_mask(self, mask, queries: int, start: int) -> None:
        """The additive mask of `queries` queries at slots start, start + 1, ...: causal over the cache,
        and no row sees another prompt's padding (slots [lens[b], L) of row b)."""
        q = torch.arange(start, start + queries, device=self.device).view(-1, 1)
        seen = (self._slots <= q) & self._kept  # [B, 1, queries, cache_len]
        mask.copy_(torch.where(seen, 0.0, torch.finfo(self.dtype).min).to(self.dtype))

    def prefill(self, input_ids, attention_mask=None):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != self.batch:
            raise ValueError(f"GraphDecoder.prefill: input_ids must be [{self.batch}, L], got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
        L = input_ids.shape[1]
        if not 0 < L < self.max_len:
            raise ValueError(f"GraphDecoder.prefill: a prompt of {L} tokens does not fit max_cache_len {self.max_len}")
        ids = input_ids.to(self.device)
        lens, order = _prompt_lengths(ids, attention_mask)
        if order is not None:  # each row's tokens to the front: its prompt at slots and positions 0 .. lens[b] - 1
            ids = ids.gather(1, order)
        self.cache.reset()
        self._lens.copy_(lens)
        self._kept.copy_((self._slots < lens.view(-1, 1, 1, 1)) | (self._slots >= L))
        self._prompt = L
        mask = torch.empty(self.batch, 1, L, self._cache_len, dtype=self.dtype, device=self.device)
        self._set_mask(mask, L, 0)
        slots = torch.arange(L, device=self.device)  # the prompt's cache slots, and each packed row's positions
        last = lens - 1
        # the logits of each row's last prompt token only ([B, L, V] would be a GB at a long prompt and a large vocab)
        kw = {"logits_to_keep": torch.unique(last)} if self._keep_kw else {}
        with torch.no_grad():
            logits = self._forward(ids, slots, mask, slots.expand(self.batch, L), **kw)
        rows = torch.arange(self.batch, device=self.device)
        cols = torch.searchsorted(kw["logits_to_keep"], last) if kw else last
        self.length = L
        return logits[rows, cols]

    def step(self, ids):
        if self.length == 0:
            raise RuntimeError("GraphDecoder.step: no prompt in the cache; call prefill(input_ids) first")
        if not isinstance(ids, torch.Tensor) or ids.numel() != self.batch:
            raise ValueError(f"GraphDecoder.step: ids must be a tensor of {self.batch} token ids (one a sequence), got "
                             f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        if self.length >= self.max_len:
            raise ValueError(f"GraphDecoder.step: the cache is full ({self.max_len} tokens)")
        self._ids.copy_(ids.view(self.batch, 1))
        self._pos.fill_(self.length)  # the slot every row writes (transformers' cache), after the longest prompt
        self._positions.copy_((self._lens + (self.length - self._prompt)).view(-1, 1))  # each row's own position
        self._set_mask(self._mask, 1, self.length)
        if self._absorbed is not None:  # the absorbed cache holds each row's tokens at their positions
            self._absorbed.seq_lens.copy_(self._positions.view(-1) + 1)
        step = (self._ids, self._pos, self._mask, self._positions)
        with torch.no_grad(), (self._absorbed.active() if self._absorbed else contextlib.nullcontext()):
            if not self.capture or self._steps == 0:
                logits = self._forward(*step)[:, -1]
            else:
                if self._graph is None:
                    self._graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(self._graph):
                        self._logits = self._forward(*step)[:, -1]
                _staging.wake()  # CPU experts on doorbells: their threads poll busily from now
                self._graph.replay()
                logits = self._logits
        if self._steps == 0 and self._absorbed is not None:  # what the first step's layers ran (the graph's too)
            self.attention_reason += (f"; the latent norm, rotary embedding and cache append of {self._absorbed.appends} "
                                      f"of {len(self._absorbed.modules)} layers in one hmoe.ops.mla_rope_append each")
        self._steps += 1
        self.length += 1
        return logits

    def synchronize(self) -> None:
        """Returns when the GPU has run everything enqueued on the current stream; the thread sleeps
        meanwhile instead of spinning (the CPU experts want every core)."""
        if self._done is not None:
            self._done.record()
            self._done.synchronize()

    def generate(self, input_ids, max_new_tokens: int, attention_mask=None, *, eos_token_id=None,
                 pad_token_id=None):
        """Greedy decoding: [B, L + n] token ids, input_ids as given (padding included) and each row's n
        new tokens after them (computed when it returns); n = max_new_tokens, or fewer with eos_token_id.

        eos_token_id (an id or a list of ids): a row that produced one has finished, its later tokens are
        pad_token_id (default: the first eos id), and decoding stops once every row has finished, as
        transformers' generate does. The host reads whether all have finished one step late, so that
        the GPU never waits for it: the step after the last one runs and is dropped (the cache then holds
        it too)."""
        if not V.is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"GraphDecoder.generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        eos = _token_ids("eos_token_id", eos_token_id)
        if pad_token_id is not None and not (V.is_int(pad_token_id) and pad_token_id >= 0):
            raise ValueError(f"GraphDecoder.generate: pad_token_id must be a token id (an int >= 0), got {pad_token_id!r}")
        if pad_token_id is not None and eos is None:
            raise ValueError("GraphDecoder.generate: pad_token_id pads the rows that finished, so it needs eos_token_id")
        if eos is not None:  # copied to the GPU before the prefill is queued (a copy after it would wait for it)
            pad = torch.tensor(eos[0] if pad_token_id is None else pad_token_id, device=self.device)
            eos = torch.tensor(eos, dtype=torch.long, device=self.device)
            finished = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
            ended = _Ended(self.device)
        nxt = self.prefill(input_ids, attention_mask).argmax(-1)
        tokens = [input_ids.to(self.device)]
        for _ in range(max_new_tokens):
            if eos is not None:
                nxt = torch.where(finished, pad, nxt)
                finished |= torch.isin(nxt, eos)
            tokens.append(nxt.view(-1, 1))
            if eos is not None:
                last = ended.check(finished, len(tokens))  # the token count when every row had finished, if known
                if last is not None:
                    del tokens[last:]
                    break
            if len(tokens) - 1 == max_new_tokens:
                break
            nxt = self.step(nxt).argmax(-1)
        out = torch.cat(tokens, dim=1)
        self.synchronize()
        return out


def _token_ids(name: str, ids) -> list | None:
    if ids is None:
        return None
    many = list(ids.flatten().tolist()) if isinstance(ids, torch.Tensor) else list(ids) \
        if isinstance(ids, (list, tuple)) else [ids]
    if not many or not all(V.is_int(i) and i >= 0 for i in many):
        raise ValueError(f"GraphDecoder.generate: {name} must be a token id or a list of them (ints >= 0), got {ids!r}")
    return [int(i) for i in many]


class _Ended:
    """Whether every row had finished, read one step late on CUDA: each step's flag goes into pinned host
    memory behind an event, and check() waits (asleep) only for the step before's, which the GPU has
    finished or nearly while it runs the step after."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.flags = [torch.zeros((), dtype=torch.bool, pin_memory=True) for _ in range(2)]
            self.events = [torch.cuda.Event(blocking=True) for _ in range(2)]
        self.pending = None  # (slot, token count) of the flag written last

    def check(self, finished, count: int):
        """Records whether all of `finished` are set (with `count` tokens so far) and returns the token count
        of an earlier record that found them all set, else None; on the CPU, this one's."""
        if not self.cuda:
            return count if bool(finished.all()) else None
        slot = 0 if self.pending is None else 1 - self.pending[0]
        self.flags[slot].copy_(finished.all(), non_blocking=True)
        self.events[slot].record()
        before, self.pending = self.pending, (slot, count)
        if before is None:
            return None
        self.events[before[0]].synchronize()
        return before[1] if bool(self.flags[before[0]]) else None
