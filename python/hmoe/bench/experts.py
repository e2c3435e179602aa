# `python -m hmoe.bench experts`: hmoe's CPU routed experts vs an HF-style torch per-expert loop, against copy bandwidth.
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import statistics
import sys
import time

from hmoe import _reference
from hmoe.bench import membw
from hmoe.bench._report import progress, table_header


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int  # H
    inter: int  # I (per-expert intermediate size)
    experts: int  # E resident in memory; routing only picks among these
    top_k: int  # K
    experts_total: int  # E of the real model, for the printed note

    def expert_bytes(self, elt: int) -> int:
        return 3 * self.hidden * self.inter * elt  # gate + up + down

    def weight_bytes(self, elt: int) -> int:
        return self.experts * self.expert_bytes(elt)


SHAPES = {
    "v2lite": Shape("v2lite", 2048, 1408, 64, 6, 64),  # DeepSeek-V2-Lite routed experts
    "v3": Shape("v3", 7168, 2048, 256, 8, 256),  # DeepSeek-V3 routed experts
}
DTYPE_NAMES = ("bf16", "fp16", "fp32")
DECODE_MAX_T = 16  # the functional API is measured on decode rows only (it may pack per call)


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


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


def make_weights(shape: Shape, dtype, seed: int, progress):
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


def make_inputs(shape: Shape, T: int, dtype, seed: int):
    """One routed batch: x, K distinct expert ids per token (uniformly random, like a random
    permutation's first K), positive routing weights summing to 1 per token."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, shape.hidden, generator=g).to(dtype)
    ids = torch.rand(T, shape.experts, generator=g).argsort(dim=1)[:, : shape.top_k].to(torch.int32)
    w = torch.rand(T, shape.top_k, generator=g) + 0.1
    return x, ids.contiguous(), (w / w.sum(dim=1, keepdim=True)).contiguous()


def time_calls(fn, inputs, hit_bytes, opts, flush):
    """Warm-up, then repeats over fresh routed batches (inputs(r)) with caches flushed between;
    stops after --time-budget seconds once min_repeats are done. Returns per-call seconds,
    per-call bytes of distinct expert weights hit, and the output of the first measured call."""
    for i in range(opts.warmup):
        t0 = time.perf_counter()
        fn(*inputs(-1 - i))
        if time.perf_counter() - t0 > 1.0:
            break  # one slow call has already paid every first-use cost
    times, hits, first = [], [], None
    start = time.perf_counter()
    for r in range(opts.repeats):
        args = inputs(r)
        flush()
        t0 = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t0
        times.append(dt)
        hits.append(hit_bytes(args[1]))
        if first is None:
            first = out
        if len(times) >= opts.min_repeats and time.perf_counter() - start > opts.time_budget:
            break
    return times, hits, first


def check(out, ref, x, tol: float) -> dict:
    """hmoe's output vs the torch loop: dtype and shape by contract, then normwise rel. error."""
    import torch

    if out.dtype != x.dtype or tuple(out.shape) != tuple(ref.shape):
        return {"ok": False, "rel_err": None, "tol": tol,
                "why": f"got {out.dtype} {tuple(out.shape)}, want {x.dtype} {tuple(ref.shape)}"}
    diff = (out.double() - ref.double()).norm().item()
    err = diff / max(ref.double().norm().item(), 1e-30)
    finite = bool(torch.isfinite(out).all())
    return {"ok": finite and math.isfinite(err) and err <= tol, "rel_err": err, "tol": tol,
            "why": "" if finite else "non-finite output"}


_pct = "{:.1%}".format
COLUMNS = [  # (title, width, row key, format)
    ("shape", 8, "shape", str), ("T", 4, "T", str), ("dtype", 5, "dtype", str), ("impl", 15, "impl", str),
    ("isa", 12, "isa", str), ("thr", 3, "threads", str), ("reps", 4, "repeats", str),
    ("ms(med)", 9, "ms", "{:.3f}".format), ("GB/s", 7, "gbps", "{:.1f}".format),
    ("GFLOP/s", 7, "gflops", "{:.0f}".format), ("vs torch", 8, "speedup", "{:.2f}x".format), ("%copy", 6, "copy_frac", _pct),
    ("busy", 4, "other_load", "{:.0%}".format), ("check", 0, "check", None),
]


def _check_cell(row: dict) -> str:
    c = row.get("check")
    if row.get("error"):
        return "FAIL error: " + row["error"]
    if c is None:
        return "ref" if row["impl"] == "torch-loop" else ""
    if c["rel_err"] is None or not c["ok"]:
        err = "nan" if c["rel_err"] is None else f"{c['rel_err']:.1e}"
        return f"FAIL rel_err {err} > {c['tol']:.0e} {c['why']}".rstrip()
    return f"ok {c['rel_err']:.1e}"


def _cell(row: dict, key: str, fmt) -> str:
    if fmt is None:
        return _check_cell(row)
    return "-" if row.get(key) is None else fmt(row[key])


def format_row(row: dict) -> str:
    return "  ".join(f"{_cell(row, k, f):<{w}}" for _, w, k, f in COLUMNS).rstrip()


def format_header() -> str:
    return table_header(COLUMNS)


def run_shape_dtype(shape, dname, opts, copy_gbps, emit, progress, flush):
    """All token counts for one (shape, dtype): weights generated once and shared by the torch
    loop and the functional API; CPUExperts prepacks its own copy."""
    import torch

    import hmoe

    wdt = torch_dtype(dname)
    xname = dname if opts.act_dtype == "same" else opts.act_dtype
    xdt = torch_dtype(xname)
    elt = torch.empty(0, dtype=wdt).element_size()
    wbytes = shape.weight_bytes(elt)
    # ours + CPUExperts' prepacked copy (padding allowed for) + the loop's and the kernel's
    # per-call buffers; the functional call is assumed not to pack every resident expert
    need = int(2.15 * wbytes) + (512 << 20)
    avail = membw.mem_available_bytes()
    if avail and need > avail:
        return {"shape": shape.name, "dtype": dname, "reason":
                f"needs ~{need / 1e9:.1f} GB (weights {wbytes / 1e9:.2f} GB x2 for the prepacked copy,"
                f" + slack), MemAvailable {avail / 1e9:.1f} GB"}
    progress(f"{shape.name} {dname}: generating {shape.experts} experts = {wbytes / 1e9:.2f} GB of weights")
    try:
        w13, w2 = make_weights(shape, wdt, opts.seed, progress)
    except (MemoryError, RuntimeError) as e:  # torch reports a failed allocation as RuntimeError
        gc.collect()
        return {"shape": shape.name, "dtype": dname, "reason": f"allocating the weights failed: {e}"}
    experts, err, isa, prepack_s = None, None, opts.isa or "auto", None
    try:
        progress(f"{shape.name} {dname}: CPUExperts prepack")
        t0 = time.perf_counter()
        experts = hmoe.CPUExperts(w13, w2, isa=opts.isa)
        prepack_s = time.perf_counter() - t0
        isa = str(experts.isa)
    except Exception as e:  # reported in the table, the torch rows still run
        err = f"CPUExperts: {type(e).__name__}: {e}"
    per_expert = shape.expert_bytes(elt)
    tol = _reference.tolerance("moe_experts_vs_torch_loop", xdt, w_dtype=wdt)
    for T in opts.tokens:
        inputs = functools.lru_cache(maxsize=None)(
            lambda r, T=T: make_inputs(shape, T, xdt, opts.seed * 1_000_003 + T * 7919 + r))
        hit_bytes = lambda ids: torch.unique(ids).numel() * per_expert  # noqa: E731
        base = {"shape": shape.name, "H": shape.hidden, "I": shape.inter, "E": shape.experts,
                "E_total": shape.experts_total, "K": shape.top_k, "T": T, "dtype": dname,
                "x_dtype": xname, "weight_bytes_resident": wbytes, "prepack_s": prepack_s,
                "packed_bytes": getattr(experts, "packed_bytes", None)}
        impls = [("torch-loop", "torch", torch.get_num_threads(),
                  lambda x, i, w, w13=w13, w2=w2: torch_expert_loop(x, i, w, w13, w2), None)]
        impls.append(("CPUExperts", isa, hmoe.get_num_threads(), experts, err))
        if T <= DECODE_MAX_T:
            impls.append(("moe_experts_cpu", isa, hmoe.get_num_threads(),
                          lambda x, i, w, w13=w13, w2=w2: hmoe.ops.moe_experts_cpu(x, i, w, w13, w2, isa=opts.isa),
                          None))
        ref_ms, ref = None, None
        for name, row_isa, threads, fn, fn_err in impls:
            row = dict(base, impl=name, isa=row_isa, threads=threads)
            if fn is None or fn_err:
                row["error"] = fn_err or "not available"
            else:
                progress(f"{shape.name} T={T} {dname}: {name}")
                load = membw.OtherLoad()
                try:
                    times, hits, out = time_calls(fn, inputs, hit_bytes, opts, flush)
                    row["other_load"] = load.fraction()
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"
                else:
                    ms = 1e3 * statistics.median(times)
                    row.update(ms=ms, ms_min=1e3 * min(times), ms_all=[1e3 * t for t in times],
                               repeats=len(times), gbps=statistics.median(h / t / 1e9 for h, t in zip(hits, times)),
                               bytes_hit_mean=statistics.mean(hits))
                    row["copy_frac"] = row["gbps"] / copy_gbps if copy_gbps else None
                    # 3 matmuls of H x I per (token, expert) pair: prefill is bound by this, not GB/s
                    row["gflops"] = 6 * shape.hidden * shape.inter * T * shape.top_k / (ms * 1e6)
                    if name == "torch-loop":
                        ref_ms, ref, row["speedup"] = ms, out, 1.0
                    else:
                        row["speedup"] = ref_ms / ms if ref_ms else None
                        row["check"] = check(out, ref, inputs(0)[0], tol) if ref is not None else None
            emit(row)
        inputs.cache_clear()
    del experts, w13, w2
    gc.collect()
    return None


def parse_args(argv, prog):
    p = argparse.ArgumentParser(prog=prog, description=(
        "Time hmoe's CPU routed experts (CPUExperts; moe_experts_cpu on decode rows) against an "
        "HF-style torch per-expert loop, and relate the expert weights streamed per call to the "
        "machine's memory copy bandwidth."))
    p.add_argument("--shapes", default="v2lite,v3", help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--tokens", default="1,4,128,512", help="comma list of T (tokens per call)")
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="weight dtypes (comma list of bf16, fp16, fp32)")
    p.add_argument("--act-dtype", default="same", choices=("same",) + DTYPE_NAMES,
                   help="activation dtype; default: the weights' dtype")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 10; --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; --quick 1)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop repeating a measurement after this many seconds, once 3 calls are done (default 20)")
    p.add_argument("--threads", type=int, default=None, help="threads for hmoe and torch (default: hmoe.get_num_threads())")
    p.add_argument("--isa", default=None, help="force an hmoe CPU ISA level (default: the best this machine runs)")
    p.add_argument("--experts-resident", type=int, default=32,
                   help="v3 experts held in memory and routed to (of 256; default 32: 256 in bf16 are 22.5 GB)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="copy-bandwidth buffer in MiB (default: >= 1 GiB and >= 8x LLC; --quick 256)")
    p.add_argument("--no-flush", action="store_true", help="do not evict caches between timed calls")
    p.add_argument("--quick", action="store_true", help="few repeats and a small copy buffer (CI smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write every number to PATH as JSON")
    p.add_argument("--shape-custom", metavar="H,I,E,K", help=argparse.SUPPRESS)  # tests: tiny shapes
    opts = p.parse_args(argv)
    opts.repeats = opts.repeats or (2 if opts.quick else 10)
    opts.warmup = opts.warmup if opts.warmup is not None else (1 if opts.quick else 2)
    opts.time_budget = opts.time_budget if opts.time_budget is not None else (2.0 if opts.quick else 20.0)
    opts.min_repeats = min(opts.repeats, 1 if opts.quick else 3)
    try:
        opts.tokens = [int(t) for t in opts.tokens.split(",") if t]
        opts.dtypes = [d for d in opts.dtypes.split(",") if d]
        if opts.shape_custom:
            H, I, E, K = (int(v) for v in opts.shape_custom.split(","))
            opts.shape_list = [Shape("custom", H, I, E, K, E)]
        else:
            names = [s for s in opts.shapes.split(",") if s]
            bad = [s for s in names if s not in SHAPES]
            if bad:
                p.error(f"unknown shape(s) {bad}; known: {', '.join(SHAPES)}")
            v3_e = opts.experts_resident
            opts.shape_list = [dataclasses.replace(SHAPES[s], experts=v3_e) if s == "v3" else SHAPES[s] for s in names]
    except ValueError as e:
        p.error(str(e))
    bad = [d for d in opts.dtypes if d not in DTYPE_NAMES]
    if bad:
        p.error(f"unknown dtype(s) {bad}; known: {', '.join(DTYPE_NAMES)}")
    if any(t < 1 for t in opts.tokens) or opts.repeats < 1 or (opts.threads is not None and opts.threads < 1):
        p.error("--tokens, --repeats and --threads must be positive")
    for s in opts.shape_list:
        if not (s.top_k <= s.experts <= s.experts_total):
            p.error(f"{s.name}: need top_k ({s.top_k}) <= resident experts ({s.experts}) <= {s.experts_total}")
    return opts


def main(argv=None, prog="python -m hmoe.bench experts") -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv, prog)
    import torch

    import hmoe

    if opts.threads:
        hmoe.set_num_threads(opts.threads)
    # the baseline gets the same number of threads as hmoe, or the comparison means nothing
    torch.set_num_threads(hmoe.get_num_threads())
    copy_bytes = (opts.copy_mib << 20) if opts.copy_mib else ((256 << 20) if opts.quick else None)
    busy = membw.cpu_busy_fraction()
    if busy is not None and busy > 0.2:
        progress(f"WARNING: the CPUs were {100 * busy:.0f}% busy before the bench started; timings will be noisy")
    progress("measuring memory copy bandwidth")
    copy = membw.measure_copy_bandwidth(copy_bytes, repeats=3 if opts.quick else 5)
    meta = {"cpu": membw.cpu_model(), "mem_total_bytes": membw.mem_total_bytes(),
            "llc_bytes": membw.llc_bytes(), "torch": torch.__version__,
            "hmoe": getattr(hmoe, "__version__", "?"), "threads_hmoe": hmoe.get_num_threads(),
            "threads_torch": torch.get_num_threads(), "isa_requested": opts.isa,
            "repeats": opts.repeats, "warmup": opts.warmup, "time_budget_s": opts.time_budget,
            "cache_flush": not opts.no_flush, "cpu_busy_before": busy, "timing": "time.perf_counter per call; median over repeats"}
    print(f"hmoe.bench experts  cpu: {meta['cpu']}  torch {meta['torch']}  hmoe {meta['hmoe']}  "
          f"threads: hmoe {meta['threads_hmoe']}, torch {meta['threads_torch']}")
    if busy is not None and busy > 0.2:
        print(f"WARNING: other load kept the CPUs {100 * busy:.0f}% busy before the run: timings are noisy")
    print(f"copy bandwidth: {copy['gbps']:.1f} GB/s  (torch copy_ of a {copy['bytes_buffer'] / 2**30:.2f} GiB buffer, "
          f"{copy['threads']} threads; counts bytes read + bytes written; GB = 1e9 B)")
    for s in opts.shape_list:
        note = f"; {s.experts} of {s.experts_total} experts resident, routing only to those" \
            if s.experts < s.experts_total else ""
        print(f"{s.name}: H={s.hidden} I={s.inter} E={s.experts} top-{s.top_k}{note}")
    print("GB/s = bytes of the distinct experts' weights hit by a call / its time (median over calls); "
          "%copy = GB/s / copy bandwidth;\nGFLOP/s = 6*H*I*T*K / median time (prefill is compute-bound); "
          "vs torch = torch-loop median ms / this median ms;\n"
          "busy = CPU share other processes took meanwhile (over ~10% makes timings unreliable);\n"
          "check = normwise rel. error vs the torch loop (FAIL when over the dtype's tolerance)\n")
    print(format_header(), flush=True)
    rows, skipped = [], []

    def emit(row):
        rows.append(row)
        print(format_row(row), flush=True)

    flush = membw.CacheFlusher(enabled=not opts.no_flush)
    for shape in opts.shape_list:
        for dname in opts.dtypes:
            skip = run_shape_dtype(shape, dname, opts, copy["gbps"], emit, progress, flush)
            if skip:
                skipped.append(skip)
                print(f"skip {skip['shape']} {skip['dtype']}: {skip['reason']}", flush=True)
    # measured again at the end: on a shared host the bandwidth itself can move during a run
    copy_end = membw.measure_copy_bandwidth(copy_bytes, repeats=3 if opts.quick else 5) if rows else None
    if copy_end and abs(copy_end["gbps"] / copy["gbps"] - 1) > 0.15:
        print(f"\nWARNING: copy bandwidth moved during the run: {copy['gbps']:.1f} GB/s at the start, "
              f"{copy_end['gbps']:.1f} GB/s at the end (%copy uses the start)")
    noisy = [r for r in rows if (r.get("other_load") or 0) > 0.1]
    if noisy:
        print(f"\nWARNING: other processes took over 10% of the CPUs during {len(noisy)} of {len(rows)} "
              "measurements (column busy): rerun on an idle machine before trusting those times")
    failures = sum(1 for r in rows if r.get("error") or (r.get("check") and not r["check"]["ok"]))
    verdict = (f"{failures} FAILED" if failures else
               "all hmoe results match the torch loop" if rows else "nothing measured")
    print(f"\n{len(rows)} rows, {len(skipped)} skipped, {verdict}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "copy_bandwidth": copy, "copy_bandwidth_end": copy_end,
                       "shapes": [dataclasses.asdict(s) for s in opts.shape_list],
                       "results": rows, "skipped": skipped, "failures": failures}, f, indent=1)
        progress(f"wrote {opts.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
