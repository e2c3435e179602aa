# `python -m hmoe.bench mla`: hmoe.ops.mla_decode vs flashinfer's MLA (fa2, fa3) on shuffled paged caches, vs GPU roofs.
from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import types

from hmoe.bench import membw
from hmoe.bench import _gpu_bench
from hmoe.bench._gpu_bench import check_cell, error_text, fi_cell, hm_cell, load_flashinfer, rel_err
from hmoe.bench._report import output_file, positive_int, progress, table_header
from hmoe.ops.mla import D_CKV, D_PE
from hmoe import _reference
from hmoe.backends.flashinfer import HOPPER

DEFAULT_SHAPES = "64x4096x16,64x4096x128,128x8192x16,1x32768x128,32x2048x128,256x1024x16"
SM_SCALE = 1.0 / math.sqrt(192)  # DeepSeek's q.k head dim before absorption: 128 nope + 64 rope
# Normwise relative error allowed vs the fp64 reference (the op's own bound, by --dtype name).
TOLERANCE = {"bf16": _reference.tolerance("mla_decode", "bfloat16"),
             "fp16": _reference.tolerance("mla_decode", "float16")}
CHECK_REQUESTS = 2  # requests held to the fp64 reference; all of them would cost more than the bench
BACKENDS = ("fa2", "fa3")


class Shape(collections.namedtuple("Shape", "B S H")):  # requests (1 query token each), tokens each, heads
    name = property(lambda s: f"{s.B}x{s.S}x{s.H}")


def parse_shapes(text: str) -> list[Shape]:
    shapes = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"bad shape {item!r}: expected BxSxH, positive integers, e.g. 64x4096x16")
        shapes.append(Shape(*(int(p) for p in parts)))
    if not shapes:
        raise ValueError("no shapes given")
    return shapes


def bytes_moved(s: Shape, elt: int = 2) -> int:
    """KV read once (512 latent + 64 rope per token) + q read + out written. The page table and
    seq_lens (4 B per page or request) are left out: under 0.01% of the total."""
    return elt * (s.B * s.S * (D_CKV + D_PE) + s.B * s.H * (D_CKV + D_PE) + s.B * s.H * D_CKV)


def flops(s: Shape) -> int:
    """2 per multiply-add: Q K^T over 576 dims and P V over 512, per (request, head, token)."""
    return 2 * s.B * s.H * s.S * (D_CKV + D_PE + D_CKV)


def make_inputs(s: Shape, page_size: int, dtype, device, seed: int):
    """Random q and a paged cache where every request holds exactly S tokens in shuffled pages
    (a random permutation of all pages), as a serving engine's allocator leaves them."""
    import torch

    per_req = -(-s.S // page_size)
    g = torch.Generator(device=device).manual_seed(seed)
    # drawn in the target dtype: an fp32 temporary of the largest cache would double its footprint
    rnd = lambda *size: torch.randn(size, generator=g, device=device, dtype=dtype)  # noqa: E731
    perm = torch.randperm(s.B * per_req, generator=torch.Generator().manual_seed(seed + 1))
    return types.SimpleNamespace(
        q_nope=rnd(s.B, s.H, D_CKV), q_pe=rnd(s.B, s.H, D_PE),
        ckv=rnd(s.B * per_req, page_size, D_CKV), kpe=rnd(s.B * per_req, page_size, D_PE),
        page_table=perm.to(torch.int32).view(s.B, per_req).to(device),
        seq_lens=torch.full((s.B,), s.S, dtype=torch.int32, device=device))


def reference(inp, n: int, sm_scale: float):
    """out [n, H, 512] (float64) of the first n requests: hmoe._reference.mla_decode (fp64
    from the gathered pages, the math every implementation is held to)."""
    return _reference.mla_decode(inp.q_nope[:n], inp.q_pe[:n], inp.ckv, inp.kpe, inp.page_table[:n],
                         inp.seq_lens[:n], sm_scale)[0].double()


def floor_us(s: Shape, copy_gbps: float, peak_tflops: float) -> tuple[float, str]:
    """The shape's floor in microseconds and what sets it: its bytes at the copy bandwidth or its
    FLOPs at the bf16 matmul rate, both measured in the same run, whichever takes longer."""
    by_bytes = bytes_moved(s) / (copy_gbps * 1e3)
    by_flops = flops(s) / (peak_tflops * 1e6)
    return (by_bytes, "bytes") if by_bytes >= by_flops else (by_flops, "FLOPs")


def derive(res: dict, s: Shape, copy_gbps: float, peak_tflops: float) -> dict:
    """A timing result (_gpu_bench.time_all) with what follows from its median: GB/s, TFLOP/s, the
    share of the copy bandwidth, the floor and the time over it."""
    med = res["us"]
    gbps = bytes_moved(s) / (med * 1e3)
    floor, by = floor_us(s, copy_gbps, peak_tflops)
    return dict(res, gbps=gbps, tflops=flops(s) / (med * 1e6), copy_frac=gbps / copy_gbps,
                floor_us=floor, floor_by=by, x_floor=med / floor)


def hmoe_runner(inp, opts):
    import hmoe

    out = inp.q_nope.new_empty(inp.q_nope.shape)
    fn = lambda: hmoe.ops.mla_decode(inp.q_nope, inp.q_pe, inp.ckv, inp.kpe, inp.page_table,  # noqa: E731
                                     inp.seq_lens, sm_scale=SM_SCALE, variant=opts.variant, out=out)
    # eager first: does hmoe.prewarm's lazy work and the shape's plan, raising here, not mid-capture
    # (not hmoe.prewarm itself: it also loads the CPU experts, whose failure is no MLA failure)
    fn()
    return fn, out


def hmoe_route(inp, opts) -> tuple[str, str | None]:
    """The variant that runs this shape (hmoe.ops.mla.route: the device's, or the portable one for a
    shape it declines) and what its plan chose (None for a flashinfer backend)."""
    from hmoe.ops import mla

    B, H, _ = inp.q_nope.shape
    try:
        sel = mla.route(opts.device.index, B, H, inp.page_table.shape[1], inp.ckv.shape[1], opts.variant)
        if sel.backend:
            return sel.variant, None
        return sel.variant, mla.plan(opts.device.index, B, H, inp.page_table.shape[1], inp.ckv.shape[1],
                                     variant=opts.variant).describe()
    except Exception as e:  # noqa: BLE001 - a note; the timing already stands
        return "?", f"unknown ({error_text(e)})"


def flashinfer_runner(fi, backend: str, inp, page_size: int, use_graph: bool):
    """flashinfer.mla.BatchMLAPagedAttentionWrapper on the same cache: its ckv/kpe layout is ours
    ([pages, page_size, dim]); its page table is CSR: kv_indices lists page ids request after
    request, kv_indptr[b] is where request b's begin (in pages), kv_len_arr the token counts."""
    import torch

    B, H, _ = inp.q_nope.shape
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=inp.q_nope.device)  # 1 query/request
    kv_indptr, kv_indices = qo_indptr * inp.page_table.shape[1], inp.page_table.flatten()
    bufs = {}
    if use_graph:  # capture needs the wrapper's metadata in buffers that keep their address
        bufs = {"use_cuda_graph": True, "qo_indptr": torch.empty_like(qo_indptr), "kv_indptr": torch.empty_like(kv_indptr),
                "kv_indices": torch.empty_like(kv_indices), "kv_len_arr": torch.empty_like(inp.seq_lens)}
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=inp.q_nope.device)
    wrapper = fi.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend, **bufs)
    wrapper.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=inp.seq_lens,
                 num_heads=H, head_dim_ckv=D_CKV, head_dim_kpe=D_PE, page_size=page_size, causal=False,
                 sm_scale=SM_SCALE, q_data_type=inp.q_nope.dtype, kv_data_type=inp.ckv.dtype)
    out = torch.empty_like(inp.q_nope)
    fn = lambda: wrapper.run(inp.q_nope, inp.q_pe, inp.ckv, inp.kpe, out=out)  # noqa: E731
    fn()  # a backend's first use JIT-compiles here, outside any timing
    return fn, out


def run_shape(s: Shape, opts, fi, fi_skip: dict, copy_gbps: float, peak_tflops: float, flush, progress) -> dict:
    """One table row: hmoe and each flashinfer backend timed on the same inputs, taking turns; then the checks."""
    import torch

    row = {"shape": s.name, "B": s.B, "S": s.S, "H": s.H, "dtype": opts.dtype, "page_size": opts.page_size,
           "bytes": bytes_moved(s), "flops": flops(s), "intensity": flops(s) / bytes_moved(s),
           "hmoe": {}, "flashinfer": {}, "checks": []}
    progress(f"{s.name}: building a {s.B * s.S * (D_CKV + D_PE) * 2 / 1e9:.2f} GB paged cache")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[opts.dtype]
    inp = make_inputs(s, opts.page_size, dtype, opts.device, opts.seed)
    fi_impls, row["flashinfer"] = _gpu_bench.flashinfer_impls(
        BACKENDS if fi is not None else (), fi_skip,
        lambda b: flashinfer_runner(fi, b, inp, opts.page_size, use_graph=not opts.eager))
    impls = {"hmoe": lambda: hmoe_runner(inp, opts), **fi_impls}
    results, outs = _gpu_bench.time_all(impls, opts, flush, progress, s.name, notes=_gpu_bench.FLASHINFER_NOTES)
    _gpu_bench.fill_row(row, results, "hmoe", BACKENDS, lambda res: derive(res, s, copy_gbps, peak_tflops))
    if "error" not in row["hmoe"]:
        row["hmoe"]["variant"], row["hmoe"]["plan"] = hmoe_route(inp, opts)
    torch.cuda.synchronize()
    n, tol = min(CHECK_REQUESTS, s.B), TOLERANCE[opts.dtype]
    ref = reference(inp, n, SM_SCALE)
    _gpu_bench.check_outputs(row, outs, lambda out: rel_err(out[:n], ref), tol)
    inp = outs = ref = None  # freed before empty_cache
    torch.cuda.empty_cache()
    return row


COLUMNS = [  # (title, width, cell)
    ("shape BxSxH", 13, lambda r: r["shape"]), ("variant", 8, lambda r: r["hmoe"].get("variant", "-")),
    ("t", 5, lambda r: r["hmoe"].get("timing", "-")),
    ("us(med)", 9, hm_cell("us", ".1f")), ("GB/s", 6, hm_cell("gbps", ".0f")), ("TFLOP/s", 7, hm_cell("tflops", ".1f")),
    ("%copy", 6, hm_cell("copy_frac", ".1%")),
    ("floor us", 13, lambda r: f"{r['hmoe']['floor_us']:.1f} ({r['hmoe']['floor_by']})" if "floor_us" in r["hmoe"] else "-"),
    ("x floor", 7, hm_cell("x_floor", ".2f")),
    ("fa2 us", 9, fi_cell("fa2", "us")), ("x fa2", 6, fi_cell("fa2", "speedup")),
    ("fa3 us", 9, fi_cell("fa3", "us")), ("x fa3", 6, fi_cell("fa3", "speedup")),
    ("check", 0, check_cell),
]


def format_header() -> str:
    return table_header(COLUMNS)


def format_row(row: dict) -> str:
    return _gpu_bench.format_row(row, COLUMNS)


def plot_roofline(rows: list, copy_gbps: float, peak_tflops: float, path: str, title: str) -> None:
    """Roofline PNG, log-log: x arithmetic intensity (FLOP/byte), y TFLOP/s; the bandwidth roof
    from the measured copy bandwidth, the compute roof from the measured bf16 matmul."""
    import matplotlib

    matplotlib.use("Agg")  # GPU servers have no display
    import matplotlib.pyplot as plt

    xs = [r["intensity"] for r in rows] + [peak_tflops * 1e3 / copy_gbps]  # + the ridge point
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.loglog(grid, [min(copy_gbps * x / 1e3, peak_tflops) for x in grid], "k-", lw=1.5,
              label=f"roof: copy {copy_gbps:.0f} GB/s, bf16 matmul {peak_tflops:.0f} TFLOP/s")
    for impl, marker, color in (("hmoe", "o", "tab:red"), ("fa2", "s", "tab:blue"), ("fa3", "^", "tab:green")):
        pts = [(r["intensity"], res["tflops"], r["shape"]) for r in rows
               for res in [r["hmoe"] if impl == "hmoe" else r["flashinfer"].get(impl) or {}] if "tflops" in res]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, zorder=3,
                       label="hmoe mla_decode" if impl == "hmoe" else f"flashinfer {impl}")
        for k, (x, y, label) in enumerate(sorted(pts) if impl == "hmoe" else ()):  # stagger labels of a cluster
            near = sum(abs(math.log(x / q[0])) < 0.15 for q in sorted(pts)[:k])
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(14, 14 - 12 * near), fontsize=7,
                        arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"})
    ax.set(xlabel="arithmetic intensity (FLOP/byte)", ylabel="TFLOP/s", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def parse_args(argv, prog):
    p = argparse.ArgumentParser(prog=prog, description=(
        "Time hmoe.ops.mla_decode against flashinfer's BatchMLAPagedAttentionWrapper (fa2, fa3) on the "
        "same shuffled paged caches, relate it to the GPU's copy bandwidth and matmul peak, check every output."))
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of BxSxH (default {DEFAULT_SHAPES})")
    p.add_argument("--dtype", default="bf16", choices=tuple(TOLERANCE))
    p.add_argument("--page-size", type=int, default=64, help="tokens per cache page (default 64)")
    p.add_argument("--variant", default=None, help="force an hmoe CUDA variant (passed to mla_decode; a shape its family "
                   "declines fails its row with the reason). Default: hmoe's choice per shape (the variant column)")
    p.add_argument("--config", type=int, default=None,
                   help="force the kernel's tile configuration (an index, see hmoe.ops.mla.plan; sets HMOE_MLA_CONFIG)")
    p.add_argument("--no-tma", action="store_true",
                   help="load the cache with cp.async where the TMA would be used (sets HMOE_MLA_TMA=0)")
    p.add_argument("--no-flashinfer", action="store_true", help="time hmoe only")
    _gpu_bench.add_timing_args(p, repeats=30)
    p.add_argument("--copy-mib", type=positive_int, default=None, help="copy-bandwidth buffer in MiB (default 2048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", type=output_file, help="also write every number to PATH as JSON")
    p.add_argument("--plot", metavar="PATH.png", type=output_file,
                   help="write a roofline plot (needs matplotlib)")
    opts = p.parse_args(argv)
    try:
        opts.shape_list = parse_shapes(opts.shapes)
    except ValueError as e:
        p.error(str(e))
    if opts.page_size < 1:
        p.error("--page-size must be positive")
    _gpu_bench.check_timing_args(p, opts)
    return opts


def main(argv=None, prog="python -m hmoe.bench mla") -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv, prog)
    import os

    import torch

    # The plan reads these (hmoe.ops.mla.plan): the knobs for tuning runs.
    if opts.config is not None:
        os.environ["HMOE_MLA_CONFIG"] = str(opts.config)
    if opts.no_tma:
        os.environ["HMOE_MLA_TMA"] = "0"
    if not torch.cuda.is_available():
        print(f"hmoe.bench mla: no usable CUDA device (torch.cuda.is_available() is False; torch {torch.__version__}, "
              f"built for CUDA {torch.version.cuda or 'none: a CPU-only build'}).\nThis benchmark times GPU kernels: "
              "run it on a machine with an NVIDIA GPU; `python -m hmoe.compat check` says what hmoe sees.", file=sys.stderr)
        return 2
    if opts.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("hmoe.bench mla: --plot needs matplotlib (pip install matplotlib); or leave --plot out", file=sys.stderr)
            return 2
    import hmoe
    from hmoe.ops import _cuda

    opts.device = dev = torch.device("cuda", torch.cuda.current_device())  # pick one with CUDA_VISIBLE_DEVICES
    props = torch.cuda.get_device_properties(dev)
    cc = (props.major, props.minor)
    fi, fi_why = (None, "--no-flashinfer") if opts.no_flashinfer else load_flashinfer("mla")
    fi_skip = {"fa3": f"needs sm_90, this GPU is sm_{cc[0]}{cc[1]}"} if fi is not None and cc != HOPPER else {}
    try:
        sel = _cuda.select("mla_decode", dev.index, opts.variant)
        selection = f"{sel.variant} ({sel.reason})"
    except Exception as e:  # noqa: BLE001 - the rows show the error too
        selection = f"none: {error_text(e)}"
    progress("measuring copy bandwidth and bf16 matmul peak")
    copy = membw.gpu_copy_bandwidth(dev, (opts.copy_mib << 20) if opts.copy_mib else None)
    peak = membw.gpu_matmul_tflops(dev)
    meta = {"gpu": props.name, "cc": f"{cc[0]}.{cc[1]}", "sms": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None), "torch": torch.__version__, "cuda": torch.version.cuda,
            "hmoe": getattr(hmoe, "__version__", "?"), "hmoe_variant": selection,
            "flashinfer": getattr(fi, "__version__", None), "flashinfer_unavailable": fi_why, "flashinfer_skipped": fi_skip,
            "dtype": opts.dtype, "page_size": opts.page_size, "sm_scale": SM_SCALE,
            **_gpu_bench.timing_meta(opts)}
    print(f"hmoe.bench mla  gpu: {props.name} (sm_{cc[0]}{cc[1]}, {props.multi_processor_count} SMs, L2 "
          f"{(meta['l2_bytes'] or 0) / 2**20:.0f} MiB)  torch {torch.__version__}  hmoe {meta['hmoe']}  flashinfer "
          f"{meta['flashinfer'] or 'unavailable: ' + str(fi_why)}" + "".join(f"; {b} skipped: {w}" for b, w in fi_skip.items()))
    print(f"hmoe variant: {selection} (the variant column: what ran each shape);  {opts.dtype}, page size "
          f"{opts.page_size}, sm_scale 1/sqrt(192), shuffled pages;  timing: {meta['timing']}")
    print(f"copy bandwidth: {copy['gbps']:.0f} GB/s (torch copy_ of a {copy['bytes_buffer'] / 2**30:.2f} GiB buffer; "
          f"bytes read + written; GB = 1e9 B);  bf16 matmul {peak['n']}^3: {peak['tflops']:.0f} TFLOP/s")
    print("GB/s = (KV B*S*576 + q B*H*576 + out B*H*512) * 2 B / median time; TFLOP/s = B*H*S*(576+512)*2 / time;\n"
          "%copy = GB/s / copy bandwidth; floor = the longer of bytes / copy bandwidth and FLOPs / matmul rate, x floor = "
          "time / floor;\nx faN = flashinfer faN time / hmoe time (> 1: hmoe faster); t = timing;\n"
          f"check = normwise rel. error vs an fp64 reference (first {CHECK_REQUESTS} requests) and vs flashinfer "
          "(all requests); FAIL over tolerance\n")
    print(format_header(), flush=True)
    flush, rows = membw.GpuL2Flusher(dev), []
    for s in opts.shape_list:
        rows.append(run_shape(s, opts, fi, fi_skip, copy["gbps"], peak["tflops"], flush, progress))
        print(format_row(rows[-1]), flush=True)
    plans = [f"  {r['shape']}: {r['hmoe']['variant']}: {r['hmoe']['plan']}" for r in rows if r["hmoe"].get("plan")]
    if plans:
        print("\nhmoe's plan per shape (hmoe.ops.mla.plan):\n" + "\n".join(plans))
    failures = sum(r["failed"] for r in rows)
    print(f"\n{len(rows)} shapes, {f'{failures} FAILED' if failures else 'all hmoe outputs check out'}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "copy_bandwidth": copy, "matmul": peak, "results": rows,
                       "failures": failures}, f, indent=1)
        progress(f"wrote {opts.json}")
    if opts.plot:
        plot_roofline(rows, copy["gbps"], peak["tflops"], opts.plot,
                      f"MLA decode {opts.dtype}, page {opts.page_size}, {props.name}: hmoe vs flashinfer")
        progress(f"wrote {opts.plot}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
