# `python -m hmoe.bench experts`: hmoe's CPU routed experts per weight format vs a torch loop and kt-kernel, against read bandwidth.
"""The command line, the machine facts (read and copy bandwidth), the loop over shapes and formats
and the JSON. What is measured and how: hmoe.bench.experts_run; the table: hmoe.bench.experts_table;
the kt-kernel peer: hmoe.bench.kt_peer."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys

from hmoe import _threads
from hmoe.bench import experts_table, kt_peer, membw
from hmoe.bench._report import int_range, output_file, positive_int, progress
from hmoe.bench.experts_run import (  # noqa: F401  (torch_dtype, torch_expert_loop, DECODE_MAX_T: the bench's API)
    DECODE_MAX_T,
    FLOAT_FORMATS,
    FORMATS,
    QUANT_FORMATS,
    Context,
    cold_floor,
    make_inputs,
    make_weights,
    run_shape_format,
    torch_dtype,
    torch_expert_loop,
    weight_dtype_name,
)
from hmoe.hardware import cpu as _cpu
from hmoe.ops import experts as _experts


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int  # H
    inter: int  # I (per-expert intermediate size)
    experts: int  # E resident in memory; routing only picks among these
    top_k: int  # K
    experts_total: int  # E of the real model, for the printed note

    def expert_bytes(self, elt: float) -> int:
        return int(3 * self.hidden * self.inter * elt)  # gate + up + down

    def weight_bytes(self, elt: float) -> int:
        return self.experts * self.expert_bytes(elt)


SHAPES = {
    "v2lite": Shape("v2lite", 2048, 1408, 64, 6, 64),  # DeepSeek-V2-Lite routed experts
    "v3": Shape("v3", 7168, 2048, 256, 8, 256),  # DeepSeek-V3 routed experts
}
DEFAULT_FORMATS = "bf16,int8,int4,fp8"
# bytes per weight of each format's values (scales are a few percent on top), for the memory estimate
_FORMAT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int8": 1, "int4": 0.5, "fp8": 1}


def memory_needed(shape: Shape, fmt: str, with_peer: bool, rounds: int = 1) -> tuple[int, str]:
    """Peak bytes one (shape, format) needs, and how that was counted: the original weights, then
    the larger of kt's stage (our bf16 copies, kt's own copy and its load-time temporaries) and
    hmoe's (the quantised weights, their packed copy, quantize's fp32 temporary), plus slack; with
    more than one round kt-kernel loads while hmoe's copies are held, so both."""
    w = shape.weight_bytes(_FORMAT_BYTES[weight_dtype_name(fmt)])
    q = shape.weight_bytes(_FORMAT_BYTES[fmt]) * 1.05
    kt = 2.5 * w if with_peer and fmt in kt_peer.KT_CLASSES else 0
    hmoe = 1.15 * q if fmt in FLOAT_FORMATS else max(2 * w, 2.2 * q)
    both = rounds > 1 and kt > 0
    extra = kt + hmoe if both else max(kt, hmoe)
    what = ("kt-kernel and the quantised and packed copies" if both
            else "kt-kernel" if kt > hmoe else "the quantised and packed copies")
    return int(w + extra) + (512 << 20), f"weights {w / 1e9:.2f} GB + {extra / 1e9:.2f} GB for {what} + slack"


def _format_list(text: str, p) -> list[str]:
    names = [d for d in text.split(",") if d]
    bad = [d for d in names if d not in FORMATS]
    if bad or not names:
        p.error(f"unknown format(s) {bad or text!r}; known: {', '.join(FORMATS)}")
    return names


def resolve_peer(requested: str) -> tuple[kt_peer.KtKernel | None, str]:
    """(kt-kernel or None, a line saying which and why). "auto": kt-kernel when it loads."""
    if requested == "none":
        return None, "peer: none (--peer none)"
    try:
        kt = kt_peer.load()
    except kt_peer.KtUnavailable as e:
        if requested == "kt-kernel":
            raise
        return None, f"peer: none (kt-kernel is not available: {e})"
    return kt, f"peer: {kt.describe()}"


def parse_args(argv, prog):
    p = argparse.ArgumentParser(prog=prog, description=(
        "Time hmoe's CPU routed experts (CPUExperts; moe_experts_cpu on decode rows) per weight format against "
        "an HF-style torch per-expert loop and kt-kernel, cold and back to back, relate the weight bytes a "
        "call streams to the machine's read bandwidth and check every output against fp64 math."))
    p.add_argument("--shapes", default="v2lite,v3", help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--tokens", default="1,4,128,512", help="comma list of T (tokens per call)")
    p.add_argument("--formats", "--dtypes", dest="formats", default=DEFAULT_FORMATS, metavar="FORMATS",
                   help=f"weight formats, comma list of {', '.join(FORMATS)} (default {DEFAULT_FORMATS}): bf16/fp16/"
                        "fp32 are float weights as they are, int8/int4/fp8 hmoe.quant of bf16 weights; "
                        "--dtypes is the older name")
    p.add_argument("--act-dtype", default="same", choices=("same",) + FLOAT_FORMATS,
                   help="activation dtype; default: the weights' dtype (bf16 for the quantised formats)")
    p.add_argument("--int8-group", default="row", choices=("row", "32", "64", "128"),
                   help="int8 scale group along K (default: one scale per output row)")
    p.add_argument("--int4-group", type=int, default=128, choices=(32, 64, 128), help="int4 scale group (default 128)")
    p.add_argument("--peer", default="auto", choices=("auto", "kt-kernel", "none"),
                   help="other implementation in the same run (default auto: kt-kernel when it loads, else none)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed calls per measurement (default 10; --quick 2)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="rounds of every implementation's blocks, kt-kernel's first and last in turn; the ratios "
                        "are then medians over the rounds of each round's ratio (default 1)")
    p.add_argument("--warmup", type=int_range(0), default=None, help="untimed calls first (default 2; --quick 1)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop repeating cold calls after this many seconds, once 3 are done (default 20)")
    p.add_argument("--idle-ms", type=float, default=100.0,
                   help="idle before each cold call (default 100: every thread pool, kt's included, asleep)")
    p.add_argument("--threads", type=int_range(1, _threads.MAX_THREADS, " (hmoe.set_num_threads' range)"), default=None,
                   help="threads for hmoe, torch and kt-kernel (default: hmoe.get_num_threads())")
    p.add_argument("--peer-threads", type=positive_int, default=None,
                   help="threads for kt-kernel's worker pool (default: --threads; its own control thread comes on top)")
    p.add_argument("--isa", default=None, choices=[lv["name"] for lv in _cpu.levels()],
                   help="force an hmoe CPU ISA level (default: the best this machine runs, or $HMOE_CPU_ISA)")
    p.add_argument("--experts-resident", type=int, default=32,
                   help="v3 experts held in memory and routed to (of 256; default 32: 256 in bf16 are 22.5 GB)")
    p.add_argument("--copy-mib", type=positive_int, default=None,
                   help="bandwidth probes' buffer in MiB (default: >= 1 GiB and >= 8x LLC; --quick 256)")
    p.add_argument("--no-flush", action="store_true", help="do not evict caches before cold calls (the idle stays)")
    p.add_argument("--quick", action="store_true", help="few repeats and a small probe buffer (CI smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", type=output_file, help="also write every number to PATH as JSON")
    p.add_argument("--shape-custom", metavar="H,I,E,K", help=argparse.SUPPRESS)  # tests: tiny shapes
    opts = p.parse_args(argv)
    opts.repeats = opts.repeats if opts.repeats is not None else (2 if opts.quick else 10)
    opts.warmup = opts.warmup if opts.warmup is not None else (1 if opts.quick else 2)
    opts.time_budget = opts.time_budget if opts.time_budget is not None else (2.0 if opts.quick else 20.0)
    opts.min_repeats = min(opts.repeats, 1 if opts.quick else 3)
    opts.int8_group = None if opts.int8_group == "row" else int(opts.int8_group)
    opts.formats = _format_list(opts.formats, p)
    try:
        opts.tokens = [int(t) for t in opts.tokens.split(",") if t]
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
    if not opts.tokens or any(t < 1 for t in opts.tokens) or opts.idle_ms < 0:
        p.error("--tokens must be positive, --idle-ms not negative")
    for s in opts.shape_list:
        if not (s.top_k <= s.experts <= s.experts_total):
            p.error(f"{s.name}: need top_k ({s.top_k}) <= resident experts ({s.experts}) <= {s.experts_total}")
    _check_cpu_settings(opts, p)
    return opts


def _check_cpu_settings(opts, p) -> None:
    """What the library would refuse only after the bandwidth probes, refused before any work: the ISA
    level (--isa or $HMOE_CPU_ISA; the choice of variant that CPUExperts makes, and caches) and, without
    --threads, $HMOE_NUM_THREADS (read by hmoe.get_num_threads)."""
    try:
        _experts.select(opts.isa)
    except (ValueError, RuntimeError) as e:  # RuntimeError: no variant can run, or its module is broken
        msg = str(e)
        if opts.isa is not None:
            rest = msg.removeprefix(f"isa={opts.isa!r}")
            p.error(f"--isa {opts.isa}{rest}" if rest != msg else f"--isa {opts.isa}: {msg}")
        p.error(msg)
    if opts.threads is None:
        try:
            _threads.get_num_threads()
        except ValueError as e:
            p.error(f"{e}; set it to a valid count, unset it or pass --threads")


def _probe_bytes(opts) -> int | None:
    """The bandwidth probes' buffer: --copy-mib, else 256 MiB with --quick, else membw's default."""
    return (opts.copy_mib << 20) if opts.copy_mib is not None else ((256 << 20) if opts.quick else None)


def _bandwidths(opts, meta):
    nbytes = _probe_bytes(opts)
    repeats = 3 if opts.quick else 5
    progress("measuring memory read and copy bandwidth")
    return (membw.measure_read_bandwidth(nbytes, repeats=repeats, threads=meta["threads_hmoe"]),
            membw.measure_copy_bandwidth(nbytes, repeats=repeats))


def main(argv=None, prog="python -m hmoe.bench experts") -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv, prog)
    import torch

    import hmoe

    if opts.threads:
        hmoe.set_num_threads(opts.threads)
    opts.threads = hmoe.get_num_threads()
    opts.peer_threads = opts.peer_threads or opts.threads
    # the baseline gets the same number of threads as hmoe, or the comparison means nothing
    torch.set_num_threads(opts.threads)
    try:
        kt, peer_line = resolve_peer(opts.peer)
    except kt_peer.KtUnavailable as e:
        print(f"{prog}: --peer kt-kernel: kt-kernel is not available: {e}", file=sys.stderr)
        return 2
    busy = membw.cpu_busy_fraction()
    if busy is not None and busy > 0.2:
        progress(f"WARNING: the CPUs were {100 * busy:.0f}% busy before the bench started; timings will be noisy")
    meta = {"cpu": membw.cpu_model(), "mem_total_bytes": membw.mem_total_bytes(),
            "llc_bytes": membw.llc_bytes(), "torch": torch.__version__,
            "hmoe": getattr(hmoe, "__version__", "?"), "threads_hmoe": hmoe.get_num_threads(),
            "threads_torch": torch.get_num_threads(), "threads_kt": opts.peer_threads if kt else None,
            "isa_requested": opts.isa, "formats": opts.formats, "x_dtype": opts.act_dtype,
            "int8_group": opts.int8_group, "int4_group": opts.int4_group,
            "peer": ({"name": "kt-kernel", "version": kt.version, "variant": kt.variant, "loaded": kt.how,
                      "classes": {f: kt_peer.pick_class(kt, f)[0] for f in kt_peer.KT_CLASSES
                                  if _offers(kt, f)}} if kt else None),
            "peer_note": peer_line, "repeats": opts.repeats, "rounds": opts.rounds, "warmup": opts.warmup,
            "time_budget_s": opts.time_budget, "cache_flush": not opts.no_flush, "idle_ms": opts.idle_ms,
            "block_gap_ms": 100, "cpu_busy_before": busy,
            "timing": "time.perf_counter per call; medians over calls; cold: eviction + idle before each call, "
                      "b2b: the same batches back to back"}
    read, copy = _bandwidths(opts, meta)
    gap = membw.CacheFlusher(enabled=not opts.no_flush, idle_s=opts.idle_ms / 1e3)
    progress("timing a cold call on tiny experts")
    meta["cold_floor"] = cold_floor(opts, gap)
    print(f"hmoe.bench experts  cpu: {meta['cpu']}  torch {meta['torch']}  hmoe {meta['hmoe']}  "
          f"threads: hmoe {meta['threads_hmoe']}, torch {meta['threads_torch']}"
          + (f", kt-kernel {opts.peer_threads}" if kt else ""))
    print(peer_line)
    if kt:
        print("kt-kernel's formats: " + "; ".join(_peer_format(kt, f, opts) for f in opts.formats))
    if busy is not None and busy > 0.2:
        print(f"WARNING: other load kept the CPUs {100 * busy:.0f}% busy before the run: timings are noisy")
    print(f"read bandwidth: {read['gbps']:.1f} GB/s  (the decode ceiling: {read['method']}, "
          f"{read['bytes_buffer'] / 2**30:.2f} GiB, {read['threads']} threads; bytes read; GB = 1e9 B)")
    print(f"copy bandwidth: {copy['gbps']:.1f} GB/s  (for reference: torch copy_ of a "
          f"{copy['bytes_buffer'] / 2**30:.2f} GiB buffer, {copy['threads']} threads; bytes read + bytes written)")
    floor = meta["cold_floor"]
    print(f"cold floor: {floor['cold_us']:.0f} us a cold call, {floor['b2b_us']:.0f} us back to back ({floor['what']}: "
          "what a cold call costs apart from its weights, in every cold row)")
    for s in opts.shape_list:
        note = f"; {s.experts} of {s.experts_total} experts resident, routing only to those" \
            if s.experts < s.experts_total else ""
        print(f"{s.name}: H={s.hidden} I={s.inter} E={s.experts} top-{s.top_k}{note}")
    groups = f"int8 {'per row' if opts.int8_group is None else f'group {opts.int8_group}'}, int4 group {opts.int4_group}"
    print(f"formats: {', '.join(opts.formats)} ({groups}; fp8: (128, 128) blocks; quantised from bf16 weights)")
    print(experts_table.legend(opts.idle_ms, not opts.no_flush, kt is not None, opts.rounds) + "\n")
    print(experts_table.format_header(), flush=True)
    rows, skipped = [], []

    def emit(row):
        rows.append(row)
        print(experts_table.format_row(row), flush=True)

    ctx = Context(opts=opts, read_gbps=read["gbps"], emit=emit, progress=progress, gap=gap, kt=kt)
    for shape in opts.shape_list:
        weights = None  # (dtype name, w13, w2): the quantised formats share the bf16 weights
        for fmt in opts.formats:
            need, how = memory_needed(shape, fmt, kt is not None, opts.rounds)
            avail = membw.mem_available_bytes()
            wname = weight_dtype_name(fmt)
            if weights is not None and weights[0] != wname:
                weights = None
                gc.collect()
            held = 0 if weights is None else shape.weight_bytes(_FORMAT_BYTES[wname])
            if avail and need - held > avail:
                skip = {"shape": shape.name, "format": fmt,
                        "reason": f"needs ~{need / 1e9:.1f} GB ({how}), MemAvailable {avail / 1e9:.1f} GB"}
                skipped.append(skip)
                print(f"skip {shape.name} {fmt}: {skip['reason']}", flush=True)
                continue
            if weights is None:
                progress(f"{shape.name}: generating {shape.experts} experts of {wname} weights")
                try:
                    weights = (wname, *make_weights(shape, torch_dtype(wname), opts.seed, progress))
                except (MemoryError, RuntimeError) as e:  # torch reports a failed allocation as RuntimeError
                    gc.collect()
                    skip = {"shape": shape.name, "format": fmt, "reason": f"allocating the weights failed: {e}"}
                    skipped.append(skip)
                    print(f"skip {shape.name} {fmt}: {skip['reason']}", flush=True)
                    continue
            run_shape_format(shape, fmt, weights[1], weights[2], ctx)
            gc.collect()
        weights = None
        gc.collect()
    return _finish(opts, meta, read, copy, rows, skipped)


def _peer_format(kt, fmt, opts) -> str:
    try:
        name, handover = kt_peer.pick_class(kt, fmt)
    except kt_peer.KtUnsupported:
        return f"{fmt} none"
    return f"{fmt} {name} ({kt_peer.WEIGHTS_NOTE[handover].format(g=opts.int4_group)})"


def _offers(kt, fmt) -> bool:
    try:
        kt_peer.pick_class(kt, fmt)
    except kt_peer.KtUnsupported:
        return False
    return True


def _finish(opts, meta, read, copy, rows, skipped) -> int:
    # measured again at the end: on a shared host the bandwidth itself can move during a run
    read_end = (membw.measure_read_bandwidth(_probe_bytes(opts), repeats=3 if opts.quick else 5,
                                             threads=meta["threads_hmoe"]) if rows else None)
    if read_end and abs(read_end["gbps"] / read["gbps"] - 1) > 0.15:
        print(f"\nWARNING: read bandwidth moved during the run: {read['gbps']:.1f} GB/s at the start, "
              f"{read_end['gbps']:.1f} GB/s at the end (%read uses the start)")
    noisy = [r for r in rows if (r.get("other_load") or 0) > 0.1]
    if noisy:
        print(f"\nWARNING: other processes took over 10% of the CPUs during {len(noisy)} of {len(rows)} "
              "measurements (column busy): rerun on an idle machine before trusting those times")
    failures = sum(1 for r in rows if r.get("error") or (r.get("check") and r["check"]["ok"] is False))
    unchecked = sum(1 for r in rows if r.get("check") and r["check"]["ok"] is None)
    verdict = (f"{failures} FAILED" if failures else
               "every hmoe result within its contract tolerance" if rows else "nothing measured")
    if unchecked and not failures:
        verdict += f" ({unchecked} without a contract reference)"
    print(f"\n{len(rows)} rows, {len(skipped)} skipped, {verdict}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "read_bandwidth": read, "read_bandwidth_end": read_end, "copy_bandwidth": copy,
                       "shapes": [dataclasses.asdict(s) for s in opts.shape_list],
                       "results": rows, "skipped": skipped, "failures": failures}, f, indent=1)
        progress(f"wrote {opts.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
