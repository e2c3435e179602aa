"""Absorbed MLA decode for transformers' DeepSeek-V2/V3 attention: what GraphDecoder(attention="hmoe")
runs in its decode steps.

transformers' DeepseekV2Attention / DeepseekV3Attention cache the compressed latents (the cache's keys
are kv_a_layernorm(kv_nope) [B, 1, L, kv_lora_rank], its values the roped k_pe [B, 1, L, rope]) and
expand the whole cache through kv_b_proj at every step before attending. The absorbed form attends on
the latents themselves: with kv_b_proj's weight viewed as [H, nope + v, R] = [W_UK; W_UV],

    q_abs = q_nope W_UK                         [B, H, R]   (rounded to the model's dtype)
    out   = mla_decode(q_abs, q_pe, cache)     [B, H, R]   (hmoe.ops.mla_decode and its precision contract)
    o     = out W_UV^T                          [B, H, v], then o_proj

which is the same attention (q_nope . k_nope = q_abs . latent, P V = (P latent) W_UV^T) with the rounding
points of an MLA decode kernel instead of those of the expanded keys and values. The projections are the
module's own. The latent's RMSNorm, the rotary embedding of q_pe and k_pe and the cache append run as one
hmoe.ops.mla_rope_append where the module's are transformers' DeepSeek RMSNorm and rotary functions (their
math, rounded once per value: see that op) and its cache layer holds the latents as static tensors;
otherwise they are the module's own (the functions of its transformers version) and cache.update. On a
CUDA device the attention is hmoe.ops.mla_decode over the static cache viewed as pages of PAGE tokens; on
the CPU both ops are the same math in fp32 with torch (the reference the tests compare with).
Row b's tokens are at slots 0 .. seq_lens[b] - 1 of its cache row and its new token goes to the next
one (mla_decode attends to the first seq_lens tokens of each row and takes no mask): GraphDecoder puts
each padded prompt's tokens at the front of its row, so rows of different lengths need no mask.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from .. import _reference
from ..ops import linear, mla

PAGE = 64  # tokens per page of the static cache viewed as mla_decode's paged cache
_LATENT_MODULE_ATTRS = ("kv_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj", "kv_lora_rank",
                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_heads", "scaling", "layer_idx")


def attention_modules(model) -> list:
    """The model's DeepSeek MLA attention modules (transformers' DeepseekV2Attention / DeepseekV3Attention,
    recognised by their latent projections)."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in _LATENT_MODULE_ATTRS)]


def unsupported(modules: list, device, dtype, batch: int, cache_len: int) -> str:
    """Why the absorbed decode cannot run these modules on `device` in `dtype` ("" when it can), for
    GraphDecoder's calls: `batch` rows over a static cache of `cache_len` tokens a row."""
    if not modules:
        return "the model has no DeepSeek MLA attention modules (kv_a_proj_with_mqa, kv_b_proj)"
    if device.type == "cpu":
        return ""
    if device.type != "cuda":
        return f"the model is on {device}: hmoe's MLA decode runs on CUDA devices (and on the CPU in torch)"
    m = modules[0]
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the model is {str(dtype).removeprefix('torch.')}: hmoe.ops.mla_decode takes bf16 or fp16"
    if (m.kv_lora_rank, m.qk_rope_head_dim) != (mla.D_CKV, mla.D_PE):
        return (f"kv_lora_rank {m.kv_lora_rank} and qk_rope_head_dim {m.qk_rope_head_dim}: hmoe.ops.mla_decode "
                f"takes DeepSeek's {mla.D_CKV} and {mla.D_PE}")
    if not 1 <= m.num_heads <= mla.MAX_HEADS:
        return f"{m.num_heads} heads: hmoe.ops.mla_decode takes 1 to {mla.MAX_HEADS}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:  # the variant the decoder's calls run (the route of their shape; cached): none, and the reason is why
        mla.route(index, batch, m.num_heads, -(-cache_len // PAGE), PAGE)
    except Exception as e:  # noqa: BLE001 - any failure to choose a variant is a reason to keep the model's
        return f"hmoe.ops.mla_decode cannot run on {device}: {type(e).__name__}: {e}"
    return ""


def choose(modules: list, attention: str, device, dtype, batch: int, cache_len: int) -> tuple[bool, str]:
    """(whether GraphDecoder's decode steps run absorbed, why) for its `attention` argument ("auto",
    "hmoe" or "model") and its calls' shape (unsupported); "hmoe" on modules it cannot run is a
    ValueError that says why."""
    if attention == "model":
        return False, "attention='model'"
    why = unsupported(modules, device, dtype, batch, cache_len)
    if why and attention == "hmoe":
        raise ValueError(f"GraphDecoder: attention='hmoe' cannot run this model: {why}")
    if why:
        return False, why
    if device.type != "cuda":
        if attention == "auto":
            return False, "auto chooses hmoe's MLA decode on CUDA devices only (attention='hmoe' runs it on the CPU in torch)"
        return True, f"absorbed MLA decode of {len(modules)} attention modules (torch, fp32)"
    return True, f"absorbed MLA decode of {len(modules)} attention modules through hmoe.ops.mla_decode"


def _rope(m, q_pe, k_pe, position_embeddings):
    """The module's own rotary embedding (the functions of its modeling file, so of its transformers
    version): DeepSeek-V2's complex frequencies, or V3's cos/sin in interleaved or half-split layout."""
    mod = sys.modules[type(m).__module__]
    if hasattr(mod, "apply_rotary_emb"):
        return mod.apply_rotary_emb(q_pe, k_pe, position_embeddings.to(q_pe.device))
    cos, sin = position_embeddings
    if getattr(m.config, "rope_interleave", False):
        return mod.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
    return mod.apply_rotary_pos_emb(q_pe, k_pe, cos, sin)


def rope_layout(m) -> str | None:
    """The hmoe.ops.mla_rope_append layout of the rotary embedding the module's modeling file applies
    (None: a file whose functions hmoe does not know)."""
    mod = sys.modules[type(m).__module__]
    if hasattr(mod, "apply_rotary_emb"):  # DeepSeek-V2: x as complex pairs times the frequencies
        return "interleaved"
    if getattr(m.config, "rope_interleave", False):
        return "interleaved_to_half" if hasattr(mod, "apply_rotary_pos_emb_interleave") else None
    return "half" if hasattr(mod, "apply_rotary_pos_emb") else None


def _rope_table(position_embeddings, layout: str, rows: int, dim: int):
    """(cos, sin) [1 or rows, dim], the factor of each output position, from the model's position
    embeddings (V2's complex frequencies [..., dim / 2], V3's cos and sin [..., dim]); None when they are
    not shaped like that."""
    if layout == "interleaved":
        f = position_embeddings
        if not (torch.is_tensor(f) and f.is_complex() and f.shape[-1] * 2 == dim):
            return None
        f = f.reshape(-1, dim // 2)
        cos, sin = f.real.repeat_interleave(2, -1), f.imag.repeat_interleave(2, -1)
    else:
        if not (isinstance(position_embeddings, tuple) and len(position_embeddings) == 2):
            return None
        cos, sin = (t.reshape(-1, t.shape[-1]).contiguous() for t in position_embeddings)
        if cos.shape[-1] != dim or sin.shape != cos.shape:
            return None
    return (cos, sin) if cos.shape[0] in (1, rows) else None


def _linear(lin, x):
    """lin(x) for a decode step's x [B, 1, K]: through hmoe.ops.decode_linear where it applies (a bias-free
    nn.Linear, linear.applies), a library matmul otherwise."""
    if type(lin) is torch.nn.Linear and lin.bias is None:
        x2 = x.reshape(x.shape[0], x.shape[-1])
        if linear.applies(x2, lin.weight):
            return linear.decode_linear(x2, lin.weight).view(x.shape[0], 1, -1)
    return lin(x)


def _norm_of(m):
    """(weight, eps) of the module's latent RMSNorm when it is transformers' DeepSeek RMSNorm (or hmoe's
    FusedRMSNorm of it), else None."""
    norm = m.kv_a_layernorm
    if type(norm).__name__ not in ("DeepseekV2RMSNorm", "DeepseekV3RMSNorm", "FusedRMSNorm"):
        return None
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    return (w, float(eps)) if torch.is_tensor(w) and w.shape == (m.kv_lora_rank,) and eps is not None else None


def _attend_cpu(q_abs, q_pe, keys, values, seq_lens, scale):
    """Softmax attention over the first seq_lens[b] latents of row b, in fp32 (the CPU path)."""
    ckv, kpe = keys[:, 0].float(), values[:, 0].float()  # [B, L, R], [B, L, rope]
    s = (q_abs.float() @ ckv.transpose(1, 2) + q_pe.float() @ kpe.transpose(1, 2)) * scale  # [B, H, L]
    pos = torch.arange(ckv.shape[1], device=s.device).view(1, 1, -1)
    s = s.masked_fill(pos >= seq_lens.view(-1, 1, 1).to(s.device), float("-inf"))
    return (torch.softmax(s, dim=-1) @ ckv).to(q_abs.dtype)


class AbsorbedDecode:
    """The absorbed decode of `modules` for batches of `batch` sequences over a static cache of
    `cache_len` tokens (a multiple of PAGE on CUDA). seq_lens ([batch] int32, the tokens each row
    attends to, this step's included) is set by the caller before each step, outside any graph."""

    def __init__(self, modules: list, batch: int, cache_len: int, device):
        self.modules = modules
        self.cuda = device.type == "cuda"
        if self.cuda and cache_len % PAGE:
            raise ValueError(f"AbsorbedDecode: the static cache holds {cache_len} tokens, not a multiple of {PAGE}")
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.appends = 0  # layer steps whose inputs went through mla_rope_append (or its torch math)
        self._counters = []  # the token counters of the cache layers appended to in this step
        self._table = (None, None, None)  # (the model's position embeddings, layout, their rope table)
        if self.cuda:
            self.page_table = torch.arange(batch * cache_len // PAGE, dtype=torch.int32, device=device).view(batch, -1)

    @contextlib.contextmanager
    def active(self):
        """Inside the block, the modules' single-token calls run absorbed (an instance forward that leaves
        every other call to the forward the module had: the class's, or an instance forward set before,
        which the block puts back)."""
        saved = [m.__dict__.get("forward") for m in self.modules]  # an instance forward someone else set
        self._counters = []
        for m in self.modules:
            m.forward = self._forward_of(m)
        try:
            yield
        finally:
            for m, f in zip(self.modules, saved):
                if f is None:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = f

    def finish_step(self) -> None:
        """Counts the step's token in the cache layers it appended to without cache.update (one kernel
        for all of them); called at the end of each step's forward, inside any graph capture."""
        if self._counters:
            torch._foreach_add_(self._counters, 1)
            self._counters = []

    def _forward_of(self, m):
        fallback = m.__dict__.get("forward") or type(m).forward.__get__(m)

        def forward(hidden_states, *args, **kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            pe = kwargs.get("position_embeddings")
            if hidden_states.shape[1] != 1 or cache is None or pe is None or args:
                return fallback(hidden_states, *args, **kwargs)
            return self._step(m, hidden_states, cache, pe), None

        return forward

    def _appended(self, m, q, kv, cache, position_embeddings):
        """(q_pe [B, H, rope], keys, values) after the step's latent and k_pe went into the cache's keys
        and values, in one hmoe.ops.mla_rope_append on CUDA (its math in fp32 torch on the CPU); None
        where the module's norm, rotary embedding or cache are not the ones that op reproduces."""
        layers = getattr(cache, "layers", ())
        layer = layers[m.layer_idx] if m.layer_idx < len(layers) else None
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        B, R, rope = q.shape[0], m.kv_lora_rank, m.qk_rope_head_dim
        norm, layout = _norm_of(m), rope_layout(m)
        if norm is None or layout is None or not (torch.is_tensor(keys) and torch.is_tensor(values)):
            return None
        if keys.shape[:2] != (B, 1) or keys.shape[-1] != R or values.shape != keys.shape[:3] + (rope,) or \
                not (keys.is_contiguous() and values.is_contiguous()):
            return None
        if self._table[0] is not position_embeddings or self._table[1] != layout:  # once per step, not per layer
            self._table = (position_embeddings, layout, _rope_table(position_embeddings, layout, B, rope))
        table = self._table[2]
        if table is None:
            return None
        counter = getattr(layer, "cumulative_length", None)  # transformers' static layers that count their tokens
        if torch.is_tensor(counter):
            self._counters.append(counter)
        self.appends += 1
        if self.cuda:
            q_pe = mla.mla_rope_append(q, kv, norm[0], *table, keys.view(-1, PAGE, R), values.view(-1, PAGE, rope),
                                       self.page_table, self.seq_lens, eps=norm[1], rope_layout=layout)
        else:
            q_pe, latent, k_pe = _reference.mla_rope_append(q, kv, norm[0], *table, norm[1], layout,
                                                            compute=torch.float32)
            rows, pos = torch.arange(B), self.seq_lens.long() - 1
            keys[rows, 0, pos], values[rows, 0, pos] = latent, k_pe
        return q_pe, keys, values

    def _step(self, m, h, cache, position_embeddings):
        B, H = h.shape[0], m.num_heads
        nope, rope, R, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
        if getattr(m, "q_proj", None) is not None:
            q = _linear(m.q_proj, h)
        else:
            q = _linear(m.q_b_proj, m.q_a_layernorm(_linear(m.q_a_proj, h)))
        q = q.view(B, H, nope + rope)
        kv = _linear(m.kv_a_proj_with_mqa, h).view(B, R + rope)
        appended = self._appended(m, q, kv, cache, position_embeddings)
        if appended is None:  # the module's own norm, rotary embedding and cache update
            kv_nope, k_pe = torch.split(kv, [R, rope], dim=-1)
            kv_nope = m.kv_a_layernorm(kv_nope).view(B, 1, 1, R)
            q_pe, k_pe = _rope(m, q[..., nope:].unsqueeze(2), k_pe.view(B, 1, 1, rope), position_embeddings)
            q_pe = q_pe.reshape(B, H, rope)
            keys, values = cache.update(kv_nope, k_pe, m.layer_idx)
            # update wrote every row at one slot, the longest row's: each row's own slot (rows of prompts of
            # different lengths), where a shorter row's stray write lies beyond its tokens until overwritten
            rows, pos = torch.arange(B, device=keys.device), self.seq_lens.long() - 1
            keys[rows, 0, pos], values[rows, 0, pos] = kv_nope.view(B, R).to(keys.dtype), k_pe.view(B, rope).to(values.dtype)
        else:
            q_pe, keys, values = appended
        if keys.dim() != 4 or keys.shape[1] != 1 or keys.shape[-1] != R or values.shape[-1] != rope:
            raise RuntimeError(f"hmoe absorbed MLA decode: layer {m.layer_idx}'s cache holds keys {tuple(keys.shape)} "
                               f"and values {tuple(values.shape)}, not the latents [B, 1, L, {R}] and [B, 1, L, {rope}] "
                               "this transformers version was expected to cache; use GraphDecoder(attention='model')")
        w = m.kv_b_proj.weight.view(H, nope + dv, R)
        q_abs = torch.matmul(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)  # [B, H, R]
        if self.cuda:
            out = mla.mla_decode(q_abs.contiguous(), q_pe.contiguous(), keys.view(-1, PAGE, R),
                                 values.view(-1, PAGE, rope), self.page_table, self.seq_lens, sm_scale=m.scaling)
        else:
            out = _attend_cpu(q_abs, q_pe, keys, values, self.seq_lens, m.scaling)
        o = torch.matmul(out.transpose(0, 1), w[:, nope:].transpose(1, 2))  # [H, B, v]
        return _linear(m.o_proj, o.transpose(0, 1).reshape(B, 1, H * dv))
