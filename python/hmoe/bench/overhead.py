# `python -m hmoe.bench overhead`: host time per call of hmoe's ops on tiny shapes (what a decode step pays per layer).
from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import statistics
import sys
import time

from hmoe import _threads
from hmoe.bench._report import int_range, output_file, progress, table_header

CPU_GOAL_US = 10.0  # issue goal for the CPU ops' host time per call on the GPU machine's host
CUSTOM_OP_GOAL_US = 5.0  # issue goal: what the torch custom-op path (hmoe.ops.library) may add per call


def layers(*per):
    """A function returning the next of the per-layer argument tuples (zip of `per`), in turn: each
    row takes its own, so that a call's arguments differ from the call's before it, as in a model."""
    return itertools.cycle(list(zip(*per))).__next__


def _block_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def host_us(fn, calls: int, blocks: int, sync=None) -> dict:
    """Host microseconds per call: `blocks` blocks of `calls` back-to-back calls, each block timed
    with perf_counter (sync, if given, runs after each block, outside the timing: tiny GPU
    kernels finish long before the next block, so the queue never backs up into the host)."""
    per = []
    for _ in range(blocks):
        per.append(_block_us(fn, calls))
        if sync is not None:
            sync()
    return {"us": statistics.median(per), "us_min": min(per), "calls": calls * blocks}


def paired_us(fn, ref, calls: int, blocks: int, sync=None) -> dict:
    """host_us of fn, with a block of `ref` (the call it is compared with) beside each of its blocks, in
    alternating order (fn ref, ref fn, ...): the host's speed drifts by more than the differences asked
    about, so each pair gives one difference and one ratio, and the medians of those are reported."""
    mine, theirs = [], []
    for i in range(blocks):
        for which in ((fn, mine), (ref, theirs)) if i % 2 == 0 else ((ref, theirs), (fn, mine)):
            which[1].append(_block_us(which[0], calls))
            if sync is not None:
                sync()
    return {"us": statistics.median(mine), "us_min": min(mine), "calls": calls * blocks,
            "ref_us": statistics.median(theirs),
            "added_us": statistics.median(a - b for a, b in zip(mine, theirs)),
            "ratio": statistics.median(a / b for a, b in zip(mine, theirs))}


def profile_top(fn, calls: int, top: int) -> str:
    """cProfile of `calls` calls: the functions where the host time goes, by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


_noop_lib = None


def _noop_op(torch, name: str, args: str, key: str):
    """An op in the namespace hmoe_bench with `args` (a schema's argument list) whose kernel for dispatch key
    `key` (CPU, CUDA) returns its first argument, with torch's fallthrough at Autograd as hmoe.ops.library
    registers: what torch's dispatcher costs a Python kernel of that schema, nothing else."""
    global _noop_lib
    if _noop_lib is None:
        _noop_lib = torch.library.Library("hmoe_bench", "DEF")
    if not hasattr(torch.ops.hmoe_bench, name):
        _noop_lib.define(f"{name}{args} -> Tensor")
        _noop_lib.impl(name, lambda first, *rest: first, key)
        _noop_lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
    return getattr(torch.ops.hmoe_bench, name).default


def cases(torch, hmoe, device: str | None, flashinfer) -> list:
    """(name, device, shape text, fn, sync, goal) for every op measured."""
    g = torch.Generator().manual_seed(0)
    E, H, I, K, T = 8, 64, 32, 2, 1
    w13 = torch.randn(E, 2 * I, H, generator=g).bfloat16()
    w2 = torch.randn(E, H, I, generator=g).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.tensor([[1, 5]], dtype=torch.int32)
    w = torch.rand(T, K, generator=g)
    experts = hmoe.CPUExperts(w13, w2)
    logits, bias = torch.randn(T, 64, generator=g), torch.randn(64, generator=g)
    topk = dict(top_k=6, n_group=8, topk_group=3, scoring="sigmoid", routed_scaling_factor=2.5)
    tiny = f"T={T} H={H} I={I} E={E} K={K} bf16"
    out = [("grouped_topk", "cpu", "T=1 E=64 top-6 sigmoid, 8 groups",
            lambda: hmoe.ops.grouped_topk(logits, bias=bias, **topk), None, CPU_GOAL_US),
           ("moe_experts_cpu", "cpu", tiny, lambda: hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2), None, CPU_GOAL_US),
           ("CPUExperts", "cpu", tiny, lambda: experts(x, ids, w), None, CPU_GOAL_US)]
    from hmoe.ops import library

    out += [("torch.ops.hmoe.grouped_topk", "cpu", "as grouped_topk",
             lambda: library.grouped_topk(logits, 6, 8, 3, "sigmoid", bias, True, 2.5), None, ("custom", "grouped_topk")),
            ("torch.ops.hmoe.moe_experts_cpu", "cpu", "as moe_experts_cpu",
             lambda: library.moe_experts_cpu(x, ids, w, w13, w2, None), None, ("custom", "moe_experts_cpu")),
            ("torch.ops.hmoe.cpu_experts_packed", "cpu", "as CPUExperts",
             lambda: library.cpu_experts_op(experts, x, ids, w), None, ("custom", "CPUExperts"))]
    noop_cpu = _noop_op(torch, "grouped_topk_cpu", library._TOPK_ARGS, "CPU")
    out.append(("torch dispatcher, no-op kernel", "cpu", "a Python kernel that returns router_logits, grouped_topk's "
                "schema: the floor of any torch.ops path", lambda: noop_cpu(logits, 6, 8, 3, "sigmoid", bias, True, 2.5),
                None, None))
    if device is None:
        return out
    dev = torch.device(device)
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    lg, bs = logits.to(dev), bias.to(dev)
    out.append(("grouped_topk", device, "T=1 E=64 top-6 sigmoid, 8 groups",
                lambda: hmoe.ops.grouped_topk(lg, bias=bs, **topk), sync, None))
    B, Hq, S, page = 1, 16, 256, 64
    # Two layers' queries and outputs, used in turn by every mla_decode and flashinfer row: a call's
    # arguments differ from the call's before it, as in a model (hmoe's eager launch skips work for
    # arguments that repeat: cuda/common/launch.h).
    qs = [(torch.randn(B, Hq, 512, device=dev, dtype=torch.bfloat16),
           torch.randn(B, Hq, 64, device=dev, dtype=torch.bfloat16)) for _ in range(2)]
    q_nope, q_pe = qs[0]
    ckv = torch.randn(S // page, page, 512, device=dev, dtype=torch.bfloat16)
    kpe = torch.randn(S // page, page, 64, device=dev, dtype=torch.bfloat16)
    pt = torch.arange(S // page, dtype=torch.int32, device=dev).view(1, -1)
    lens = torch.full((B,), S, dtype=torch.int32, device=dev)
    shape = f"B={B} H={Hq} S={S} page={page} bf16, two layers' queries in turn"
    nxt = layers(qs)
    out.append(("mla_decode", device, shape,
                lambda: hmoe.ops.mla_decode(*nxt()[0], ckv, kpe, pt, lens, sm_scale=0.07), sync, ("fi", "run()")))
    out.append(("torch.ops.hmoe.grouped_topk", device, "as grouped_topk",
                lambda: library.grouped_topk(lg, 6, 8, 3, "sigmoid", bs, True, 2.5), sync, ("custom", "grouped_topk")))
    out.append(("torch.ops.hmoe.mla_decode", device, "as mla_decode",
                lambda nx=layers(qs): library.mla_decode(*nx()[0], ckv, kpe, pt, lens, 0.07, None), sync,
                ("custom", "mla_decode")))
    noop = _noop_op(torch, "mla_decode", library._MLA_ARGS, "CUDA")
    out.append(("torch dispatcher, no-op kernel", device, "a Python kernel that returns q_nope, mla_decode's schema: "
                "the floor of any torch.ops path", lambda: noop(q_nope, q_pe, ckv, kpe, pt, lens, 0.07, None), sync,
                None))
    os_ = [torch.empty_like(q_nope) for _ in qs]
    nxt_o = layers(qs, os_)

    def with_out():
        (qn, qp), o = nxt_o()
        return hmoe.ops.mla_decode(qn, qp, ckv, kpe, pt, lens, sm_scale=0.07, out=o)
    out.append(("mla_decode(out=)", device, shape, with_out, sync, ("fi", "run(out=)")))
    # Where mla_decode's time goes: the module entry point it calls (no Python wrapper in front), with and
    # without out=, and that entry point's argument checks alone (no launch).
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    try:
        from hmoe.ops import _cuda
        mod = _cuda.module(index, "mla_decode", sel=hmoe.ops.mla.route(index, B, Hq, S // page, page))
        cfg, tma = hmoe.ops.mla._overrides(None, None)

        nxt_e = layers(qs, os_)

        def entry(use_out=False):
            (qn, qp), o = nxt_e()
            return mod.mla_decode(qn, qp, ckv, kpe, pt, lens, 0.07, o if use_out else None, False, cfg, tma)

        def checks():
            return mod.mla_decode_check(q_nope, q_pe, ckv, kpe, pt, lens, 0.07, None)
    except Exception as e:  # noqa: BLE001 - the rows report the failure
        def entry(use_out=False, e=e):
            raise e
        checks = entry
    out += [("mla_decode: module entry", device, shape + ", no Python wrapper", entry, sync, None),
            ("mla_decode: module entry (out=)", device, shape + ", no Python wrapper", lambda: entry(True), sync,
             None),
            ("mla_decode: argument checks", device, "the module's checks of the same call, no launch", checks, sync,
             None)]
    # 128 heads: the shapes the sm90a family runs on Hopper (its launch encodes four tensor maps).
    nxt128 = layers([(torch.randn(B, 128, 512, device=dev, dtype=torch.bfloat16),
                      torch.randn(B, 128, 64, device=dev, dtype=torch.bfloat16)) for _ in range(2)])
    try:
        route = hmoe.ops.mla.route(index, B, 128, S // page, page).variant
    except Exception as e:  # noqa: BLE001 - the call's own row reports the failure
        route = f"no route: {type(e).__name__}"
    out.append(("mla_decode (128 heads)", device, f"B={B} H=128 S={S} page={page} bf16, {route}, two layers' "
                "queries in turn", lambda: hmoe.ops.mla_decode(*nxt128()[0], ckv, kpe, pt, lens, sm_scale=0.07), sync,
                ("fi", "run()")))
    if flashinfer is not None:
        for backend in ("fa2", "fa3") if torch.cuda.get_device_capability(dev) == (9, 0) else ("fa2",):
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                torch.empty(128 << 20, dtype=torch.uint8, device=dev), backend=backend)
            indptr = torch.tensor([0, S // page], dtype=torch.int32, device=dev)
            wrapper.plan(torch.arange(B + 1, dtype=torch.int32, device=dev), indptr, pt.flatten(), lens, Hq, 512, 64,
                         page, False, 0.07, torch.bfloat16, torch.bfloat16)
            fos = [torch.empty_like(q_nope) for _ in qs]
            out.append((f"flashinfer {backend} run()", device, shape + " (after plan())",
                        lambda wr=wrapper, nx=layers(qs): wr.run(*nx()[0], ckv, kpe), sync, None))

            def run_out(wr=wrapper, nx=layers(qs, fos)):
                (qn, qp), fo = nx()
                return wr.run(qn, qp, ckv, kpe, out=fo)
            out.append((f"flashinfer {backend} run(out=)", device, shape + " (after plan())", run_out, sync, None))
    return out


def references(case, todo) -> list:
    """The cases a row is timed beside (paired_us): a custom op's direct call on the same device; for
    mla_decode, flashinfer's run() of every backend with the same output handling."""
    dev, goal = case[1], case[5]
    if not isinstance(goal, tuple):
        return []
    if goal[0] == "custom":
        return [c for c in todo if c[0] == goal[1] and c[1] == dev]
    return [c for c in todo if c[0].startswith("flashinfer ") and c[0].endswith(" " + goal[1]) and c[1] == dev]


def measure(case, refs: list, opts) -> dict:
    """One row: host_us of the case, or paired_us beside each of `refs`; a failing op is a row, not a crash."""
    name, dev, shape, fn, sync, goal = case
    progress(f"{name} on {dev}")
    row = {"op": name, "device": dev, "shape": shape, "goal": goal}
    try:
        for f in [fn] + [r[3] for r in refs]:
            for _ in range(50):  # warm-up: module loads, plans, the allocator's first blocks
                f()
        if sync:
            sync()
        if not refs:
            row.update(host_us(fn, opts.calls, opts.blocks, sync))
        else:
            row["vs"] = {}
            for r in refs:
                p = paired_us(fn, r[3], opts.calls, opts.blocks, sync)
                row.update({k: p[k] for k in ("us", "us_min", "calls")})
                row["vs"][r[0]] = {k: p[k] for k in ("us", "us_min", "ref_us", "added_us", "ratio")}
        if opts.profile:
            row["profile"] = profile_top(fn, opts.profile, 25)
    except Exception as e:  # noqa: BLE001 - a failing op is a row, not a crash
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return row


def verdict(r: dict) -> str:
    if "us" not in r:
        return "ERROR: " + r.get("error", "")
    goal = r["goal"]
    if isinstance(goal, tuple) and not r.get("vs"):
        return f"no {goal[1]} row to compare" if goal[0] == "custom" else "no flashinfer to compare"
    if isinstance(goal, tuple) and goal[0] == "custom":
        v = next(iter(r["vs"].values()))
        r.update(v)
        return f"{r['added_us']:+.2f} us, <= {CUSTOM_OP_GOAL_US:.0f}: {'met' if r['added_us'] <= CUSTOM_OP_GOAL_US else 'NOT met'}"
    if isinstance(goal, tuple):  # the worst ratio over flashinfer's backends
        ref, v = max(r["vs"].items(), key=lambda kv: kv[1]["ratio"])
        r.update(v)  # the row shows the pairing its verdict comes from
        return f"{v['ratio']:.2f}x {ref.split()[1]} {goal[1]} ({'met' if v['ratio'] <= 1.0 else 'NOT met'})"
    if goal:
        return f"< {goal:.0f} us: {'met' if r['us'] < goal else 'NOT met'}"
    return ""


COLUMNS = [("op", 34, lambda r: r["op"]), ("device", 7, lambda r: r["device"]),
           ("us/call", 8, lambda r: f"{r['us']:.2f}" if "us" in r else "-"),
           ("min", 7, lambda r: f"{r['us_min']:.2f}" if "us" in r else "-"),
           ("beside", 7, lambda r: f"{r['ref_us']:.2f}" if "ref_us" in r else ""),
           ("goal", 30, lambda r: r.get("verdict", "")), ("shape", 0, lambda r: r["shape"])]


def parse_args(argv, prog):
    p = argparse.ArgumentParser(prog=prog, description=(
        "Host time per call of hmoe's ops on tiny shapes (Python checks, dispatch, allocation, the native call "
        "and the launch), against flashinfer's run() for mla_decode when flashinfer imports."))
    p.add_argument("--calls", type=int, default=200, help="calls per timed block (default 200)")
    p.add_argument("--blocks", type=int, default=25, help="timed blocks; the median block is reported (default 25)")
    p.add_argument("--threads", type=int_range(1, _threads.MAX_THREADS, " (hmoe.set_num_threads' range)"),
                   default=None, help="hmoe's CPU threads (default: hmoe.get_num_threads())")
    p.add_argument("--cpu-only", action="store_true", help="leave the GPU ops out")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print a cProfile of N calls of each op (where the host time goes)")
    p.add_argument("--json", metavar="PATH", type=output_file, help="also write every number to PATH as JSON")
    opts = p.parse_args(argv)
    if opts.calls < 1 or opts.blocks < 1 or opts.profile < 0:
        p.error("--calls and --blocks must be positive, --profile >= 0")
    return opts


def main(argv=None, prog="python -m hmoe.bench overhead") -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv, prog)
    import torch

    import hmoe
    from hmoe.bench import membw

    if opts.threads:
        hmoe.set_num_threads(opts.threads)
    device = None if opts.cpu_only or not torch.cuda.is_available() else f"cuda:{torch.cuda.current_device()}"
    flashinfer, fi_why = None, "no GPU" if device is None else None
    if device is not None:
        try:
            import flashinfer.mla  # noqa: F401
            import flashinfer
        except Exception as e:  # noqa: BLE001 - the comparison is optional
            fi_why = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    print(f"hmoe.bench overhead  cpu: {membw.cpu_model()}  gpu: "
          f"{torch.cuda.get_device_name(device) if device else 'none'}  torch {torch.__version__}  hmoe {hmoe.__version__}  "
          f"flashinfer {getattr(flashinfer, '__version__', None) or 'unavailable: ' + str(fi_why)}  "
          f"threads {hmoe.get_num_threads()}")
    print(f"us/call = host time per call, median of {opts.blocks} blocks of {opts.calls} back-to-back calls "
          f"(perf_counter; GPU ops synchronised between blocks, outside the timing); goal: CPU ops under "
          f"{CPU_GOAL_US:.0f} us, mla_decode no more than flashinfer's run() (the same output handling), a custom "
          f"op (torch.ops.hmoe) at most {CUSTOM_OP_GOAL_US:.0f} us more than the direct call. A compared row's "
          f"blocks alternate with blocks of what it is compared with; its goal column is the median over those "
          f"pairs of the difference (custom ops) or the ratio (mla_decode, the slower flashinfer backend's). The "
          f"'mla_decode: ...' rows take mla_decode apart: the module entry point it calls, without the Python "
          f"wrapper in front (with and without out=), and that entry point's argument checks alone\n")
    todo = cases(torch, hmoe, device, flashinfer)
    rows = [measure(case, references(case, todo), opts) for case in todo]
    for r in rows:
        r["verdict"] = verdict(r)
    print(table_header(COLUMNS))
    for r in rows:
        print("  ".join(f"{cell(r):<{w}}" for _, w, cell in COLUMNS).rstrip())
    if opts.profile:
        for r in rows:
            if r.get("profile"):
                print(f"\n--- profile: {r['op']} on {r['device']} ({opts.profile} calls)\n{r['profile']}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"rows": [{k: v for k, v in r.items() if k != "profile"} for r in rows]}, f, indent=1)
        progress(f"wrote {opts.json}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
