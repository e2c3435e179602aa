# What `python -m hmoe.bench experts` measures: weights, routed batches, implementations, their timed blocks, accuracy.
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time

from hmoe import _reference
from hmoe.bench import kt_peer

FLOAT_FORMATS = ("bf16", "fp16", "fp32")  # the weights as they are, in that dtype
QUANT_FORMATS = ("int8", "int4", "fp8")  # hmoe.quant of bf16 weights (a real checkpoint's dtype)
FORMATS = FLOAT_FORMATS + QUANT_FORMATS
DECODE_MAX_T = 16  # the functional API is measured on decode rows only (it may pack per call)
BLOCK_GAP_S = 0.1  # idle between two implementations' blocks: longer than kt's workers spin


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def weight_dtype_name(fmt: str) -> str:
    """The dtype of the original weights a format is made from."""
    return fmt if fmt in FLOAT_FORMATS else "bf16"


def torch_expert_loop(x, topk_ids, topk_weights, w13, w2):
    """The HF-style baseline (transformers' Mixtral / DeepseekV3 MoE loop): for each expert hit,
    gather its tokens, run the expert MLP in the weights' dtype, scale by the routing weight and
    index_add into the output. Every step rounds to that dtype, as HF does."""
    import torch
    import torch.nn.functional as F

    inter = w2.shape[2]
    xw = x.to(w13.dtype)  # a no-op by default (same dtype); the loop cannot mix dtypes
    out = torch.zeros_like(xw)
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        x_e = xw[token_idx]
        w_gate, w_up, w_down = w13[e, :inter], w13[e, inter:], w2[e]
        h = F.silu(x_e @ w_gate.T) * (x_e @ w_up.T)
        y_e = h @ w_down.T
        # HF casts the fp32 routing weights to the activation dtype before scaling
        y_e = y_e * topk_weights[token_idx, slot, None].to(y_e.dtype)
        out.index_add_(0, token_idx, y_e)
    return out.to(x.dtype)


def make_weights(shape, dtype, seed: int, progress):
    """Random (never zero) weights with 1/sqrt(fan_in) scale so activations stay O(1) in fp16.
    Filled one expert at a time: a full-size fp32 temporary would not fit next to V3."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, I, E = shape.hidden, shape.inter, shape.experts
    w13 = torch.empty(E, 2 * I, H, dtype=dtype)
    w2 = torch.empty(E, H, I, dtype=dtype)
    for e in range(E):
        w13[e].normal_(0.0, H**-0.5, generator=g)
        w2[e].normal_(0.0, I**-0.5, generator=g)
        if (e + 1) % 16 == 0 and e + 1 < E:
            progress(f"  weights: {e + 1}/{E} experts")
    return w13, w2


def make_inputs(shape, T: int, dtype, seed: int):
    """One routed batch: x, K distinct expert ids per token (uniformly random, like a random
    permutation's first K), positive routing weights summing to 1 per token."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, shape.hidden, generator=g).to(dtype)
    ids = torch.rand(T, shape.experts, generator=g).argsort(dim=1)[:, : shape.top_k].to(torch.int32)
    w = torch.rand(T, shape.top_k, generator=g) + 0.1
    return x, ids.contiguous(), (w / w.sum(dim=1, keepdim=True)).contiguous()


def quantise(fmt: str, w13, w2, opts):
    """hmoe.quant of both weights (int8: --int8-group, None = per row; int4: --int4-group; fp8:
    (128, 128) blocks)."""
    from hmoe import quant

    kw = {} if fmt == "fp8" else {"group_size": opts.int8_group if fmt == "int8" else opts.int4_group}
    return quant.quantize(w13, fmt, **kw), quant.quantize(w2, fmt, **kw)


def reference(x, topk_ids, topk_weights, w13, w2, *, contract: bool = False):
    """fp64 [T, H]: hmoe._reference.moe_experts (float tensors or QuantizedWeights; contract=False:
    nothing rounded, quantised weights dequantised; True: rounded where hmoe's precision contract
    rounds), called one expert at a time: it turns all the weights it is given into fp64 at once,
    11 GB for V3's 32 resident experts."""
    import torch

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in torch.unique(topk_ids).tolist():
        tokens, slots = torch.where(topk_ids == e)
        only_e = torch.zeros(len(tokens), 1, dtype=topk_ids.dtype)  # expert e is expert 0 of the one-expert weights
        out.index_add_(0, tokens, _reference.moe_experts(x[tokens], only_e, topk_weights[tokens, slots].unsqueeze(1),
                                                         _one_expert(w13, e), _one_expert(w2, e), contract=contract))
    return out


def _one_expert(w, e: int):
    """Expert e of [E, N, K] weights as [1, N, K] (QuantizedWeights: same format, groups, blocks)."""
    from hmoe import quant

    if not isinstance(w, quant.QuantizedWeights):
        return w[e : e + 1]
    return quant.QuantizedWeights(w.format, w.data[e : e + 1], w.scales[e : e + 1], (1, *w.shape[1:]),
                                  group_size=w.group_size, block=w.block)


def rel_err(out, ref) -> float | None:
    """Normwise relative error of out against ref (inf for non-finite output, None for a wrong shape)."""
    import torch

    if out is None or tuple(out.shape) != tuple(ref.shape):
        return None
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return (out.double() - ref).norm().item() / max(ref.norm().item(), 1e-30)


def check(out, ref, x, tol: float, **extra) -> dict:
    """An output against a contract reference: dtype and shape by contract, then the error."""
    if out.dtype != x.dtype or tuple(out.shape) != tuple(ref.shape):
        return {"ok": False, "rel_err": None, "tol": tol, **extra,
                "why": f"got {out.dtype} {tuple(out.shape)}, want {x.dtype} {tuple(ref.shape)}"}
    err = rel_err(out, ref)
    finite = math.isfinite(err)
    return {"ok": finite and err <= tol, "rel_err": err, "tol": tol, **extra, "why": "" if finite else "non-finite output"}


@dataclasses.dataclass
class Context:
    """What every (shape, format) run shares."""
    opts: object
    read_gbps: float
    emit: object  # emit(row): prints and keeps a row
    progress: object
    gap: object  # the idle (and cache eviction) before each cold call
    kt: kt_peer.KtKernel | None


def time_block(fn, inputs, opts, gap):
    """One implementation's block of calls on one routed-batch sequence: warm-up, then cold calls
    (inputs(r) for r = 0, 1, ..., gap() before each; stops after --time-budget once min_repeats are
    done), then the same batches back to back (one untimed call first so that the block does not
    start from the last gap). Returns (cold s, back-to-back s, output of the first cold call)."""
    for i in range(opts.warmup):
        t0 = time.perf_counter()
        fn(*inputs(-1 - i))
        if time.perf_counter() - t0 > 1.0:
            break  # one slow call has already paid every first-use cost
    cold, first = [], None
    start = time.perf_counter()
    for r in range(opts.repeats):
        args = inputs(r)
        gap()
        t0 = time.perf_counter()
        out = fn(*args)
        cold.append(time.perf_counter() - t0)
        if first is None:
            first = out
        if len(cold) >= opts.min_repeats and time.perf_counter() - start > opts.time_budget:
            break
    fn(*inputs(len(cold) - 1))
    b2b = []
    for r in range(len(cold)):
        args = inputs(r)
        t0 = time.perf_counter()
        fn(*args)
        b2b.append(time.perf_counter() - t0)
    return cold, b2b, first


def cold_floor(opts, gap) -> dict:
    """What a cold call costs apart from streaming its weights: a CPUExperts call on tiny bf16
    experts (H=256, I=128, 8 experts, top-2, T=1: 1.5 MB of weights, 0.4 MB a call) timed as the
    rows' cold calls are (gap() before each) and back to back, in microseconds. Where the caches
    and the idle vCPUs go cold while the process sleeps, this is the part of a small decode row's
    cold time that no kernel streams away."""
    import torch

    import hmoe

    gen = torch.Generator().manual_seed(opts.seed)
    w13 = (torch.randn(8, 256, 256, generator=gen) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(8, 256, 128, generator=gen) * 0.05).to(torch.bfloat16)
    experts = hmoe.CPUExperts(w13, w2, isa=opts.isa)
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
    batches = [(torch.randperm(8, generator=gen)[:2].view(1, 2).to(torch.int32), torch.full((1, 2), 0.5))
               for _ in range(5 if opts.quick else 15)]
    calls = len(batches)  # every one of them, whatever the time budget
    block_opts = argparse.Namespace(**{**vars(opts), "repeats": calls, "min_repeats": calls, "warmup": 1})
    cold, b2b, _ = time_block(lambda ids, w: experts(x, ids, w), lambda r: batches[r % calls], block_opts, gap)
    return {"cold_us": 1e6 * statistics.median(cold), "b2b_us": 1e6 * statistics.median(b2b), "calls": len(cold),
            "what": "CPUExperts, bf16, H=256 I=128 E=8 top-2, T=1"}


def timing_fields(cold, b2b, hits, bytes_per_expert, read_gbps, shape, T) -> dict:
    """A row's numbers from a block's times; hits[r] = distinct experts of batch r."""
    bytes_hit = [h * bytes_per_expert for h in hits[: len(cold)]]
    ms, b2b_ms = 1e3 * statistics.median(cold), 1e3 * statistics.median(b2b)
    gbps = statistics.median(b / t for b, t in zip(bytes_hit, cold)) / 1e9
    b2b_gbps = statistics.median(b / t for b, t in zip(bytes_hit, b2b)) / 1e9
    return {"repeats": len(cold), "ms": ms, "ms_min": 1e3 * min(cold), "ms_all": [1e3 * t for t in cold],
            "b2b_ms": b2b_ms, "b2b_ms_min": 1e3 * min(b2b), "b2b_ms_all": [1e3 * t for t in b2b],
            "bytes_per_expert": bytes_per_expert, "bytes_hit_mean": statistics.mean(bytes_hit),
            "gbps": gbps, "b2b_gbps": b2b_gbps,
            "read_frac": gbps / read_gbps if read_gbps else None,
            "b2b_read_frac": b2b_gbps / read_gbps if read_gbps else None,
            # 3 matmuls of H x I per (token, expert) pair: prefill is bound by this, not GB/s
            "gflops": 6 * shape.hidden * shape.inter * T * shape.top_k / (ms * 1e6)}


def measure(row, fn, inputs, hits, bytes_per_expert, ctx, shape, T):
    """Times one implementation's block into row; returns the first cold call's output (None on error)."""
    from hmoe.bench import membw

    ctx.progress(f"{shape.name} T={T} {row['format']}: {row['impl']}")
    time.sleep(BLOCK_GAP_S)
    load = membw.OtherLoad()
    try:
        cold, b2b, out = time_block(fn, inputs, ctx.opts, ctx.gap)
    except Exception as e:  # reported in the table; the other implementations still run
        row["error"] = f"{type(e).__name__}: {e}"
        return None
    row["other_load"] = load.fraction()
    row.update(timing_fields(cold, b2b, hits, bytes_per_expert, ctx.read_gbps, shape, T))
    return out


def run_kt(shape, fmt, w13, w2, inputs, hits, base, ctx):
    """kt-kernel's block per T, before anything of hmoe's exists; kt is torn down before returning.
    Returns {T: (row, first output)}."""
    opts, kt = ctx.opts, ctx.kt
    rows = {T: dict(base[T], impl="kt-kernel", isa=kt.variant, threads=opts.peer_threads, x_dtype="bf16")
            for T in opts.tokens}
    try:
        name, _ = kt_peer.pick_class(kt, fmt)
    except kt_peer.KtUnsupported as e:
        return {T: (dict(row, unsupported=str(e)), None) for T, row in rows.items()}
    ctx.progress(f"{shape.name} {fmt}: kt-kernel {name} loads the weights")
    try:
        t0 = time.perf_counter()
        experts = kt_peer.KtExperts(kt, fmt, w13, w2, top_k=shape.top_k, threads=opts.peer_threads,
                                    max_tokens=max(opts.tokens), int4_group=opts.int4_group)
        load_s = time.perf_counter() - t0
    except Exception as e:
        return {T: (dict(row, impl=f"kt {name}", error=f"kt-kernel {name}: {type(e).__name__}: {e}"), None)
                for T, row in rows.items()}
    out = {}
    try:
        for T in opts.tokens:
            row = dict(rows[T], impl=f"kt {name}", kt_class=name, kt_weights=experts.weights_note, prepack_s=load_s)
            kt_inputs = functools.lru_cache(maxsize=None)(lambda r, T=T: experts.prepare(*inputs[T](r)))
            first = measure(row, experts, kt_inputs, hits[T], experts.bytes_per_expert, ctx, shape, T)
            out[T] = (row, first)
    finally:
        experts.close()
        time.sleep(BLOCK_GAP_S)
    return out


def hmoe_impls(fmt, w13, w2, opts, progress, shape):
    """The implementations measured in-process, [(impl, isa, fn, error, bytes per expert)]: hmoe's
    CPUExperts and, for float formats, the torch loop and moe_experts_cpu; then the quantised
    weights (None for float formats) and the CPUExperts facts for the rows."""
    import hmoe

    quantised, isa, experts, err, step = None, opts.isa or "auto", None, None, "hmoe.quant"
    try:
        if fmt in QUANT_FORMATS:
            progress(f"{shape.name} {fmt}: hmoe.quant")
            quantised = quantise(fmt, w13, w2, opts)
        step = "CPUExperts"
        progress(f"{shape.name} {fmt}: CPUExperts prepack")
        t0 = time.perf_counter()
        experts = hmoe.CPUExperts(*(quantised or (w13, w2)), isa=opts.isa)
        prepack_s = time.perf_counter() - t0
        isa = str(experts.isa)
    except Exception as e:  # e.g. a format this hmoe does not take yet: a row error, the rest still runs
        err, prepack_s = f"{step}: {type(e).__name__}: {e}", None
    row_major = 3 * shape.hidden * shape.inter * w13.element_size()
    packed = experts.packed_bytes // shape.experts if experts is not None else None
    impls = []
    if fmt in FLOAT_FORMATS:
        impls.append(("torch-loop", "torch", lambda x, i, w: torch_expert_loop(x, i, w, w13, w2), None, row_major))
    impls.append(("CPUExperts", isa, experts, err, packed))
    if fmt in FLOAT_FORMATS:
        impls.append(("moe_experts_cpu", isa,
                      lambda x, i, w: hmoe.ops.moe_experts_cpu(x, i, w, w13, w2, isa=opts.isa), None, row_major))
    info = {"prepack_s": prepack_s, "packed_bytes": experts.packed_bytes if experts is not None else None,
            "hmoe_format": getattr(experts, "format", fmt if experts is not None else None)}
    return impls, quantised, info


def run_shape_format(shape, fmt, w13, w2, ctx):
    """Every T for one (shape, format): kt-kernel's blocks first (then torn down), then the torch
    loop's and hmoe's, each in its own block; with --rounds N all of that N times, kt-kernel's blocks
    first in even rounds and last in odd ones (hmoe packs its weights once); rows are printed per T
    once all are measured, merged over the rounds (merge_rounds)."""
    import torch

    opts = ctx.opts
    xname = weight_dtype_name(fmt) if opts.act_dtype == "same" else opts.act_dtype
    xdt = torch_dtype(xname)
    inputs = {T: functools.lru_cache(maxsize=None)(
        lambda r, T=T: make_inputs(shape, T, xdt, opts.seed * 1_000_003 + T * 7919 + r)) for T in opts.tokens}
    hits = {T: [torch.unique(inputs[T](r)[1]).numel() for r in range(opts.repeats)] for T in opts.tokens}
    base = {T: {"shape": shape.name, "H": shape.hidden, "I": shape.inter, "E": shape.experts,
                "E_total": shape.experts_total, "K": shape.top_k, "T": T, "format": fmt,
                "weights_from": weight_dtype_name(fmt), "x_dtype": xname} for T in opts.tokens}
    if fmt == "int8":
        group = {"group_size": opts.int8_group}
    elif fmt == "int4":
        group = {"group_size": opts.int4_group}
    else:
        group = {}
    impls = quantised = info = None
    rounds = {T: [] for T in opts.tokens}  # per T, per round: [(row, first cold output)]
    for rnd in range(opts.rounds):
        kt_first = rnd % 2 == 0
        peer = run_kt(shape, fmt, w13, w2, inputs, hits, base, ctx) if ctx.kt is not None and kt_first else {}
        if impls is None:
            impls, quantised, info = hmoe_impls(fmt, w13, w2, opts, ctx.progress, shape)
        measured = {T: _measure_impls(impls, dict(base[T], **group), info, inputs[T], hits[T], ctx, shape, T)
                    for T in opts.tokens}
        if ctx.kt is not None and not kt_first:
            peer = run_kt(shape, fmt, w13, w2, inputs, hits, base, ctx)
        for T in opts.tokens:
            if T in peer:
                measured[T].append(peer[T])
            _ratios([row for row, _ in measured[T]])
            rounds[T].append(measured[T])
    for T in opts.tokens:
        merged = [(merge_rounds([r[i][0] for r in rounds[T]], hits[T], ctx.read_gbps, shape, T), rounds[T][0][i][1])
                  for i in range(len(rounds[T][0]))]
        _accuracy(merged, inputs[T](0), w13, w2, quantised)
        for row, _ in merged:
            ctx.emit(row)
    for f in inputs.values():
        f.cache_clear()


def _measure_impls(impls, base, info, inputs, hits, ctx, shape, T) -> list:
    """The blocks of the torch loop and hmoe's implementations at T: [(row, first cold output)]."""
    measured = []
    for name, isa, fn, err, per_expert in impls:
        if name == "moe_experts_cpu" and T > DECODE_MAX_T:
            continue
        row = dict(base, impl=name, isa=isa, threads=ctx.opts.threads)
        if name != "torch-loop":
            row.update(info)
        out = None
        if fn is None or err:
            row["error"] = err or "not available"
        else:
            out = measure(row, fn, inputs, hits, per_expert, ctx, shape, T)
        measured.append((row, out))
    return measured


def merge_rounds(rows, hits, read_gbps, shape, T) -> dict:
    """One implementation's rows of every round as one row: the first round's, with its times over
    every round's calls, and its ratios (vs torch, vs kt) the medians over the rounds of each round's
    ratio (the two blocks of a round ran close together, so the host's drift moves both alike); the
    rounds' own values stay in "rounds_ms", "speedup_rounds", "vs_kt_rounds"."""
    failed = next((r for r in rows if r.get("error") or r.get("unsupported")), None)
    if len(rows) == 1 or failed is not None:  # a failed round's row says what failed
        return dict(failed or rows[0], rounds=len(rows))
    row = dict(rows[0])
    cold = [t / 1e3 for r in rows for t in r["ms_all"]]
    b2b = [t / 1e3 for r in rows for t in r["b2b_ms_all"]]
    call_hits = [h for r in rows for h in hits[: r["repeats"]]]
    row.update(timing_fields(cold, b2b, call_hits, row["bytes_per_expert"], read_gbps, shape, T))
    row["rounds"] = len(rows)
    row["rounds_ms"] = [r["ms"] for r in rows]
    loads = [r["other_load"] for r in rows if r.get("other_load") is not None]
    row["other_load"] = max(loads) if loads else None
    for key in ("speedup", "vs_kt"):
        per = [r.get(key) for r in rows]
        row[f"{key}_rounds"] = per
        row[key] = statistics.median(per) if all(v is not None for v in per) else None
    return row


def _accuracy(measured, batch, w13, w2, quantised):
    """err_fp64 of every row against the original weights; hmoe's rows also get the check against
    hmoe._reference's contract reference for the weights hmoe was given (the quantised ones for
    int8/int4/fp8), or ok=None with the reason where hmoe has no such reference."""
    x, ids, weights = batch
    if not any(out is not None for _, out in measured):
        return
    ref = reference(x, ids, weights, w13, w2)
    for row, out in measured:
        if out is not None:
            row["err_fp64"] = rel_err(out, ref)
    hmoe_rows = [(row, out) for row, out in measured if out is not None and row["impl"] in ("CPUExperts", "moe_experts_cpu")]
    if not hmoe_rows:
        return
    given = quantised or (w13, w2)
    fmt = getattr(given[0], "format", None) or given[0].dtype
    try:
        tol = _reference.tolerance("moe_experts", x.dtype, w_dtype=fmt)
        contract_ref = reference(x, ids, weights, *given, contract=True)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        why = f"hmoe._reference has no contract reference for {fmt} weights ({type(e).__name__}: {e})".splitlines()[0]
        for row, _ in hmoe_rows:
            row["check"] = {"ok": None, "rel_err": None, "tol": None, "why": why}
        return
    for row, out in hmoe_rows:
        row["check"] = check(out, contract_ref, x, tol, tokens=x.shape[0])


def _ratios(rows):
    """vs torch and vs kt: the torch loop's and kt-kernel's cold ms over each row's."""
    by = {r["impl"].split()[0]: r.get("ms") for r in rows if not r.get("error")}
    torch_ms, kt_ms = by.get("torch-loop"), by.get("kt")
    for r in rows:
        if r.get("ms"):
            r["speedup"] = torch_ms / r["ms"] if torch_ms else None
            r["vs_kt"] = kt_ms / r["ms"] if kt_ms else None
