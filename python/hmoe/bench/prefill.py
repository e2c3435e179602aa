# `python -m hmoe.bench prefill`: hmoe.ops.ragged_prefill (or paged_prefill, --kv paged) vs flashinfer's ragged
# (paged) prefill (fa2, fa3), against the matmul floor.
from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
import types

from hmoe import _reference
from hmoe.backends.flashinfer import HOPPER
from hmoe.bench import membw
from hmoe.bench import _gpu_bench
from hmoe.bench._gpu_bench import check_cell, error_text, fi_cell, hm_cell, load_flashinfer, rel_err
from hmoe.bench._report import output_file, progress, table_header

# Named batches of sequences (queries = keys per request: a prompt's prefill): 16k tokens each.
PRESETS = {"4x4096": [4096] * 4, "mix16k": [5000, 3000, 2600, 2000, 1500, 1000, 700, 400, 184]}
DEFAULT_SHAPES = "4x4096,mix16k"
DEFAULT_DIMS = "192x128,128x128"
TOLERANCE = {"bf16": _reference.tolerance("prefill", "bfloat16"), "fp16": _reference.tolerance("prefill", "float16")}
BACKENDS = ("fa2", "fa3")


class Case(collections.namedtuple("Case", "name lens dqk dv H Hkv causal kv page queries",
                                   defaults=("ragged", 64, None))):
    """One table row: requests of `lens` keys, head dims, heads, mask; the keys ragged (k, v) or in a
    paged cache of `page`-token pages (kv "paged"); each request's queries its last `queries` tokens
    (None: all of them, a whole prompt's prefill; else a chunk after a cached prefix)."""
    label = property(lambda c: f"{c.name} {c.dqk}x{c.dv} H{c.H}/{c.Hkv}" + ("" if c.causal else " full")
                     + (f" paged{c.page}" if c.kv == "paged" else "") + (f" q{c.queries}" if c.queries else ""))

    @property
    def q_lens(self) -> list[int]:
        return [L if self.queries is None else min(self.queries, L) for L in self.lens]


def parse_lens(item: str) -> list[int]:
    """A preset name, or '+'-joined terms 'L' or 'NxL' (N requests of L tokens): '2x1000+37'."""
    if item in PRESETS:
        return list(PRESETS[item])
    lens = []
    for term in item.lower().split("+"):
        n, _, L = term.rpartition("x")
        if not L.isdigit() or (n and not n.isdigit()) or int(L) < 1 or (n and int(n) < 1):
            raise ValueError(f"bad shape {item!r}: expected a preset ({', '.join(PRESETS)}) or '+'-joined L or NxL "
                             "terms of positive integers, e.g. 4x4096 or 3000+1000+2x512")
        lens += [int(L)] * (int(n) if n else 1)
    return lens


def parse_dims(text: str) -> list[tuple[int, int]]:
    from hmoe.ops.prefill import HEAD_DIMS

    dims = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        a, _, b = item.lower().partition("x")
        if not (a.isdigit() and b.isdigit()) or (int(a), int(b)) not in HEAD_DIMS:
            raise ValueError(f"bad head dims {item!r}: expected QKxV, one of "
                             f"{', '.join(f'{x}x{y}' for x, y in HEAD_DIMS)}")
        dims.append((int(a), int(b)))
    if not dims:
        raise ValueError("no head dims given")
    return dims


def flops(c: Case) -> int:
    """2 per multiply-add of Q K^T (Dqk) and P V (Dv) over the (query, key) pairs the mask keeps: a
    causal request of lk keys and its last lq tokens as queries has lq (lk - lq) + lq (lq + 1) / 2
    (L (L + 1) / 2 for a whole prompt), a full one lq lk."""
    pairs = sum(lq * (lk - lq) + lq * (lq + 1) // 2 if c.causal else lq * lk for lq, lk in zip(c.q_lens, c.lens))
    return 2 * pairs * c.H * (c.dqk + c.dv)


def bytes_moved(c: Case, elt: int = 2) -> int:
    """q, k and v read once, out written once (a paged cache's unused page tails left out)."""
    return elt * (sum(c.q_lens) * c.H * (c.dqk + c.dv) + sum(c.lens) * c.Hkv * (c.dqk + c.dv))


def _indptr(lens, device):
    """int32 [len(lens) + 1]: 0, then the running sums of lens."""
    import torch

    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def make_inputs(c: Case, dtype, device, seed: int):
    """Random q, k, v and the index arrays; for kv "paged" also the same keys in a paged cache whose
    pages are a random permutation of all of them (as a serving engine's allocator leaves them):
    k_cache, v_cache [P, page, Hkv, D], page_table [B, max pages] (unused entries 0), kv_lens and
    n_pages (the pages of each request)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *size: torch.randn(size, generator=g, device=device, dtype=dtype)  # noqa: E731
    Tq, Tk = sum(c.q_lens), sum(c.lens)
    inp = types.SimpleNamespace(q=rnd(Tq, c.H, c.dqk), k=rnd(Tk, c.Hkv, c.dqk), v=rnd(Tk, c.Hkv, c.dv),
                                qo_indptr=_indptr(c.q_lens, device), kv_indptr=_indptr(c.lens, device))
    if c.kv == "paged":
        inp.n_pages = n_pages = [-(-L // c.page) for L in c.lens]
        perm = torch.randperm(sum(n_pages), generator=torch.Generator().manual_seed(seed + 1)).to(device)
        inp.page_table = torch.zeros(len(c.lens), max(n_pages), dtype=torch.int32, device=device)
        inp.k_cache = inp.k.new_zeros(sum(n_pages), c.page, c.Hkv, c.dqk)
        inp.v_cache = inp.v.new_zeros(sum(n_pages), c.page, c.Hkv, c.dv)
        first = 0
        for b, (L, n) in enumerate(zip(c.lens, n_pages)):
            pages, k0 = perm[first:first + n], int(inp.kv_indptr[b])
            inp.page_table[b, :n] = pages.to(torch.int32)
            for src, cache in ((inp.k, inp.k_cache), (inp.v, inp.v_cache)):
                padded = src.new_zeros(n * c.page, *src.shape[1:])
                padded[:L] = src[k0:k0 + L]
                cache[pages] = padded.view(n, c.page, *src.shape[1:])
            first += n
        inp.kv_lens = torch.tensor(c.lens, dtype=torch.int32, device=device)
    return inp


def check_heads(H: int) -> list[int]:
    """The query heads held to the fp64 reference: first, middle, last (all of them would cost more
    than the bench)."""
    return sorted({0, H // 2, H - 1})


def reference(inp, c: Case, heads):
    """out [T, len(heads), Dv] (fp64) of the given heads: hmoe._reference.prefill, on the GPU (a paged
    case's cache holds the ragged k and v)."""
    return _reference.prefill(inp.q, inp.k, inp.v, inp.qo_indptr, inp.kv_indptr, c.dqk ** -0.5, c.causal,
                              heads=heads)[0]


def derive(res: dict, c: Case, peak_tflops: float) -> dict:
    """A timing result (_gpu_bench.time_all) with what follows from its median: TFLOP/s, the floor
    (FLOPs at the measured matmul rate) and the time over it."""
    med = res["us"]
    floor = flops(c) / (peak_tflops * 1e6)
    return dict(res, tflops=flops(c) / (med * 1e6), floor_us=floor, x_floor=med / floor)


def hmoe_runner(inp, c: Case, variant):
    import hmoe

    out = inp.q.new_empty(inp.q.shape[0], c.H, c.dv)
    if c.kv == "paged":
        fn = lambda: hmoe.ops.paged_prefill(inp.q, inp.k_cache, inp.v_cache, inp.page_table,  # noqa: E731
                                            inp.kv_lens, inp.qo_indptr, causal=c.causal, sm_scale=c.dqk ** -0.5,
                                            variant=variant, out=out)
    else:
        fn = lambda: hmoe.ops.ragged_prefill(inp.q, inp.k, inp.v, inp.qo_indptr, inp.kv_indptr,  # noqa: E731
                                             causal=c.causal, sm_scale=c.dqk ** -0.5, variant=variant, out=out)
    fn()  # eager first: the module's lazy work and the shape's plan, not mid-capture
    return fn, out


def hmoe_plan(inp, c: Case, opts, variant) -> str | None:
    from hmoe.ops import prefill

    try:
        return prefill.plan(opts.device.index, inp.q.shape[0], len(c.lens), c.H, c.Hkv, c.dqk, c.dv,
                            variant=variant).describe()
    except Exception as e:  # noqa: BLE001 - the plan is a note; the timing already stands
        return f"unknown ({error_text(e)})"


def flashinfer_runner(fi, backend: str, inp, c: Case, use_graph: bool):
    """flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper on the same tensors (NHD layout: ours),
    or for kv "paged" its BatchPrefillWithPagedKVCacheWrapper on the same cache."""
    import torch

    if c.kv == "paged":
        return flashinfer_paged_runner(fi, backend, inp, c, use_graph)
    bufs = {}
    if use_graph:  # capture needs the indptr in buffers that keep their address
        bufs = {"use_cuda_graph": True, "qo_indptr_buf": torch.empty_like(inp.qo_indptr),
                "kv_indptr_buf": torch.empty_like(inp.kv_indptr)}
    # fa2 splits long requests' keys and keeps the partial outputs here (1.1 GB for 16k tokens x 128 heads)
    workspace = torch.empty(2 << 30, dtype=torch.uint8, device=inp.q.device)
    wrapper = fi.prefill.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend, **bufs)
    wrapper.plan(inp.qo_indptr, inp.kv_indptr, c.H, c.Hkv, c.dqk, head_dim_vo=c.dv, causal=c.causal,
                 sm_scale=c.dqk ** -0.5, q_data_type=inp.q.dtype, kv_data_type=inp.k.dtype)
    out = inp.q.new_empty(inp.q.shape[0], c.H, c.dv)
    fn = lambda: wrapper.run(inp.q, inp.k, inp.v, out=out)  # noqa: E731
    fn()  # a backend's first use JIT-compiles here, outside any timing
    return fn, out


def flashinfer_paged_runner(fi, backend: str, inp, c: Case, use_graph: bool):
    """BatchPrefillWithPagedKVCacheWrapper on hmoe's cache (NHD pages). Its page table is CSR:
    kv_indices lists the pages request after request, kv_indptr[b] where request b's begin (in
    pages), last_page_len the tokens of each request's last page. Its kernels need K and V pages of
    one stride, so where Dv < Dqk it reads V from a Dv-wide view of Dqk-wide rows (the same values;
    each row's Dv elements still contiguous)."""
    import torch

    v_cache = inp.v_cache
    if c.dv != c.dqk:
        v_cache = inp.k_cache.new_zeros(inp.k_cache.shape)[..., :c.dv]
        v_cache.copy_(inp.v_cache)
    dev = inp.q.device
    kv_indptr = _indptr(inp.n_pages, dev)
    kv_indices = torch.cat([inp.page_table[b, :n] for b, n in enumerate(inp.n_pages)])
    last = torch.tensor([L - (n - 1) * c.page for L, n in zip(c.lens, inp.n_pages)], dtype=torch.int32, device=dev)
    bufs = {}
    if use_graph:  # capture needs the index arrays in buffers that keep their address
        bufs = {"use_cuda_graph": True, "qo_indptr_buf": torch.empty_like(inp.qo_indptr),
                "paged_kv_indptr_buf": torch.empty_like(kv_indptr), "paged_kv_indices_buf": torch.empty_like(kv_indices),
                "paged_kv_last_page_len_buf": torch.empty_like(last)}
    workspace = torch.empty(2 << 30, dtype=torch.uint8, device=dev)  # as the ragged runner's
    wrapper = fi.prefill.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend, **bufs)
    wrapper.plan(inp.qo_indptr, kv_indptr, kv_indices, last, c.H, c.Hkv, c.dqk, c.page, head_dim_vo=c.dv,
                 causal=c.causal, sm_scale=c.dqk ** -0.5, q_data_type=inp.q.dtype, kv_data_type=inp.k.dtype)
    out = inp.q.new_empty(inp.q.shape[0], c.H, c.dv)
    fn = lambda: wrapper.run(inp.q, (inp.k_cache, v_cache), out=out)  # noqa: E731
    fn()  # a backend's first use JIT-compiles here, outside any timing
    return fn, out


def run_case(c: Case, opts, fi, fi_skip: dict, peak_tflops: float, flush, progress) -> list[dict]:
    """The case's table rows, one per hmoe variant of opts.variants (None: hmoe's choice), each
    beside the same flashinfer timings: every variant and backend is timed on the same inputs,
    taking turns (_gpu_bench.time_all); then the checks of each row."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[opts.dtype]
    inp = make_inputs(c, dtype, opts.device, opts.seed)
    heads, tol = check_heads(c.H), TOLERANCE[opts.dtype]
    names = {variant: f"hmoe {variant}" if variant else "hmoe" for variant in opts.variants}
    impls = {names[v]: (lambda v=v: hmoe_runner(inp, c, v)) for v in opts.variants}
    backends = getattr(opts, "backend_list", BACKENDS) if fi is not None else ()
    fi_impls, skipped = _gpu_bench.flashinfer_impls(
        backends, fi_skip, lambda b: flashinfer_runner(fi, b, inp, c, use_graph=not opts.eager))
    impls.update(fi_impls)
    results, outs = _gpu_bench.time_all(impls, opts, flush, progress, c.label, notes=_gpu_bench.FLASHINFER_NOTES)
    fi_outs = {b: outs[b] for b in backends if b in outs}
    torch.cuda.synchronize()
    ref, rows = reference(inp, c, heads), []
    for variant in opts.variants:
        row = {"case": c.label, "variant": variant or "hmoe", "lens": c.lens, "dqk": c.dqk, "dv": c.dv, "H": c.H,
               "Hkv": c.Hkv, "causal": c.causal, "dtype": opts.dtype, "flops": flops(c), "bytes": bytes_moved(c),
               "hmoe": {}, "flashinfer": {b: dict(r) for b, r in skipped.items()}, "checks": []}
        _gpu_bench.fill_row(row, results, names[variant], backends, lambda res: derive(res, c, peak_tflops))
        if "error" not in row["hmoe"]:
            row["hmoe"]["plan"] = hmoe_plan(inp, c, opts, variant)
        checked = dict(fi_outs, **({"hmoe": outs[names[variant]]} if names[variant] in outs else {}))
        _gpu_bench.check_outputs(row, checked, lambda out: rel_err(out[:, heads], ref), tol)
        rows.append(row)
    inp = outs = fi_outs = ref = checked = None  # freed before empty_cache
    torch.cuda.empty_cache()
    return rows


COLUMNS = [  # (title, width, cell)
    ("case", 27, lambda r: r["case"]), ("variant", 8, lambda r: r.get("variant", "-")),
    ("t", 5, lambda r: r["hmoe"].get("timing", "-")),
    ("us(med)", 8, hm_cell("us", ".0f")), ("TFLOP/s", 7, hm_cell("tflops", ".0f")), ("floor us", 8, hm_cell("floor_us", ".0f")),
    ("x floor", 7, hm_cell("x_floor", ".2f")),
    ("fa2 us", 7, fi_cell("fa2", "us", ".0f")), ("x fa2", 6, fi_cell("fa2", "speedup")),
    ("fa3 us", 7, fi_cell("fa3", "us", ".0f")), ("x fa3", 6, fi_cell("fa3", "speedup")),
    ("check", 0, check_cell),
]


def format_header() -> str:
    return table_header(COLUMNS)


def format_row(row: dict) -> str:
    return _gpu_bench.format_row(row, COLUMNS)


def hmoe_variants(index: int, forced: str | None, op: str = "ragged_prefill") -> tuple[list, str]:
    """The hmoe variants a run times on cuda:<index> and a line that says what each is: those of
    `forced` (a comma list), else every family of this build that runs `op` there, hmoe's choice
    first. A variant that cannot run stays in the list: its rows show why."""
    from hmoe import _build_info
    from hmoe.ops import _cuda

    names = [v.strip() for v in forced.split(",") if v.strip()] if forced else None
    if names is None:
        try:
            names = [_cuda.select(op, index).variant]
        except Exception as e:  # noqa: BLE001 - the rows show the error too
            return [None], f"none: {error_text(e)}"
        names += sorted(f for f in _build_info.cuda_kernels_for(op) if f != names[0])
    said, runs = [], []
    for name in names:
        try:
            sel = _cuda.select(op, index, name)
            said.append(f"{name} ({sel.reason.removeprefix(f'forced by variant={name}: ')})")
            runs.append(name)
        except Exception as e:  # noqa: BLE001 - a family that cannot run here is left out unless forced
            said.append(f"{name} (cannot run: {error_text(e)})")
            if forced:
                runs.append(name)
    return runs or [None], ", ".join(said)


def parse_args(argv, prog):
    p = argparse.ArgumentParser(prog=prog, description=(
        "Time hmoe.ops.ragged_prefill against flashinfer's BatchPrefillWithRaggedKVCacheWrapper (fa2, fa3) on the "
        "same tensors (with --kv paged: paged_prefill against BatchPrefillWithPagedKVCacheWrapper on the same "
        "shuffled paged cache), count FLOPs (causal: only the pairs the mask keeps), relate them to the bf16 matmul rate "
        "measured in the same run (the floor), check every output against an fp64 reference."))
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"comma list of batches: a preset ({', '.join(PRESETS)}) or '+'-joined L / NxL request lengths "
                        f"(default {DEFAULT_SHAPES})")
    p.add_argument("--dims", default=DEFAULT_DIMS, help=f"comma list of QKxV head dims (default {DEFAULT_DIMS})")
    p.add_argument("--heads", type=int, default=128, help="query heads (default 128, DeepSeek's MLA prefill)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--no-causal", action="store_true", help="full attention instead of causal")
    p.add_argument("--kv", default="ragged", choices=("ragged", "paged"),
                   help="the keys ragged (ragged_prefill, default) or in a paged cache of shuffled pages (paged_prefill)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per cache page with --kv paged (default 64)")
    p.add_argument("--queries", type=int, default=None,
                   help="each request's queries are its last N tokens (a chunked prefill after a cached prefix; "
                        "default: all of them)")
    p.add_argument("--dtype", default="bf16", choices=tuple(TOLERANCE))
    _gpu_bench.add_timing_args(p, repeats=20)
    p.add_argument("--variant", default=None,
                   help="comma list of hmoe CUDA variants to time, each its own row (passed to the op); "
                        "default: every variant of this build that runs on the GPU, hmoe's choice first")
    p.add_argument("--config", type=int, default=None,
                   help="force the kernel's tile configuration (an index, see hmoe.ops.prefill.plan; sets "
                        "HMOE_PREFILL_CONFIG for every variant timed)")
    p.add_argument("--no-flashinfer", action="store_true", help="time hmoe only")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"flashinfer backends to time, comma list of {', '.join(BACKENDS)} (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", type=output_file, help="also write every number to PATH as JSON")
    opts = p.parse_args(argv)
    try:
        lens = [(item, parse_lens(item)) for item in (t.strip() for t in opts.shapes.split(",")) if item]
        if not lens:
            raise ValueError("no shapes given")
        dims = parse_dims(opts.dims)
    except ValueError as e:
        p.error(str(e))
    opts.backend_list = [b.strip() for b in opts.backends.split(",") if b.strip()]
    if not set(opts.backend_list) <= set(BACKENDS):
        p.error(f"--backends must name some of {', '.join(BACKENDS)}")
    kv_heads = opts.kv_heads or opts.heads
    if opts.heads < 1 or kv_heads < 1 or opts.heads % kv_heads:
        p.error("--heads must be a positive multiple of --kv-heads")
    if opts.page_size < 1 or (opts.queries is not None and opts.queries < 1):
        p.error("--page-size and --queries must be positive")
    _gpu_bench.check_timing_args(p, opts)
    opts.op = f"{opts.kv}_prefill"
    opts.cases = [Case(name, L, dqk, dv, opts.heads, kv_heads, not opts.no_causal, opts.kv, opts.page_size,
                       opts.queries) for dqk, dv in dims for name, L in lens]
    return opts


def main(argv=None, prog="python -m hmoe.bench prefill") -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv, prog)
    import os

    import torch

    if opts.config is not None:
        os.environ["HMOE_PREFILL_CONFIG"] = str(opts.config)
    if not torch.cuda.is_available():
        print(f"hmoe.bench prefill: no usable CUDA device (torch.cuda.is_available() is False; torch {torch.__version__}, "
              f"built for CUDA {torch.version.cuda or 'none: a CPU-only build'}).\nThis benchmark times GPU kernels: "
              "run it on a machine with an NVIDIA GPU; `python -m hmoe.compat check` says what hmoe sees.", file=sys.stderr)
        return 2
    import hmoe

    opts.device = dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    cc = (props.major, props.minor)
    fi, fi_why = (None, "--no-flashinfer") if opts.no_flashinfer else load_flashinfer("prefill")
    fi_skip = {"fa3": f"needs sm_90, this GPU is sm_{cc[0]}{cc[1]}"} if fi is not None and cc != HOPPER else {}
    opts.variants, selection = hmoe_variants(dev.index, opts.variant, opts.op)
    progress("measuring the bf16 matmul rate")
    peak = membw.gpu_matmul_tflops(dev)
    meta = {"gpu": props.name, "cc": f"{cc[0]}.{cc[1]}", "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "hmoe": getattr(hmoe, "__version__", "?"), "hmoe_variant": selection,
            "flashinfer": getattr(fi, "__version__", None), "flashinfer_unavailable": fi_why,
            "flashinfer_skipped": fi_skip, "dtype": opts.dtype, "op": opts.op,
            "page_size": opts.page_size if opts.kv == "paged" else None, "queries": opts.queries,
            "check_heads": "first, middle and last query head", **_gpu_bench.timing_meta(opts)}
    print(f"hmoe.bench prefill  gpu: {props.name} (sm_{cc[0]}{cc[1]}, {props.multi_processor_count} SMs)  torch "
          f"{torch.__version__}  hmoe {meta['hmoe']}  flashinfer {meta['flashinfer'] or 'unavailable: ' + str(fi_why)}"
          + "".join(f"; {b} skipped: {w}" for b, w in fi_skip.items()))
    keys = f"paged cache, page size {opts.page_size}, shuffled pages" if opts.kv == "paged" else "ragged k/v"
    queries = f"each request's last {opts.queries} tokens" if opts.queries else "every token"
    print(f"hmoe.ops.{opts.op} ({keys}; queries: {queries}) variants: {selection};  {opts.dtype}, sm_scale "
          f"1/sqrt(Dqk);  timing: {meta['timing']}")
    print(f"bf16 matmul {peak['n']}^3: {peak['tflops']:.0f} TFLOP/s (the floor's rate)\n"
          "TFLOP/s = 2 x (query, key) pairs the mask keeps x H x (Dqk + Dv) / time; floor = those FLOPs at the matmul "
          "rate;\nx floor = time / floor; x faN = flashinfer faN time / hmoe time (> 1: hmoe faster); t = timing;\n"
          "check = normwise rel. error vs an fp64 reference (first, middle, last head) and vs flashinfer (all "
          "heads); FAIL over tolerance\n")
    print(format_header(), flush=True)
    flush, rows = membw.GpuL2Flusher(dev), []
    for c in opts.cases:
        for row in run_case(c, opts, fi, fi_skip, peak["tflops"], flush, progress):
            rows.append(row)
            print(format_row(row), flush=True)
    plans = [f"  {r['case']} {r['variant']}: {r['hmoe']['plan']}" for r in rows if r["hmoe"].get("plan")]
    if plans:
        print("\nhmoe's plan per case (hmoe.ops.prefill.plan):\n" + "\n".join(plans))
    failures = sum(r["failed"] for r in rows)
    print(f"\n{len(rows)} cases, {f'{failures} FAILED' if failures else 'all hmoe outputs check out'}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "matmul": peak, "results": rows, "failures": failures}, f, indent=1)
        progress(f"wrote {opts.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
