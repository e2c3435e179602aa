"""Pieces shared by the GPU attention benchmarks (bench mla, bench prefill): timing by CUDA-graph
replays, error text, the normwise error, loading flashinfer, and the table cells of a row that holds
hmoe's result, flashinfer's per backend and the checks."""
from __future__ import annotations

import math
import statistics

from hmoe.bench import membw


def rel_err(x, ref) -> float:
    """Normwise relative error ||x - ref|| / ||ref|| in fp64; inf when x is not finite."""
    x = x.double().to(ref.device)
    if not bool(x.isfinite().all()):
        return math.inf
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def error_text(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def load_flashinfer(submodule: str):
    """(flashinfer, None) once flashinfer.<submodule> imports, or (None, why): any exception, as a
    flashinfer built for another torch fails otherwise."""
    import importlib

    try:
        import flashinfer

        importlib.import_module(f"flashinfer.{submodule}")
    except Exception as e:  # noqa: BLE001
        return None, error_text(e)
    return flashinfer, None


def time_calls(fn, opts, flush) -> dict:
    """Median microseconds over opts.repeats (after opts.warmup) with the L2 flushed before each:
    CUDA-graph replays (fn has run eagerly once: its lazy work is done) unless opts.eager or capture
    fails (then eager calls, said in timing_note). The flush queued ahead keeps the GPU busy while
    the CPU launches, so launch latency does not enter the times."""
    import torch

    graph, timing, note = None, "eager", None
    if not opts.eager:
        try:
            graph, timing = torch.cuda.CUDAGraph(), "graph"
            with torch.cuda.graph(graph):
                fn()
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager timing
            graph, timing, note = None, "eager", f"graph capture failed ({error_text(e)}); timed eager calls"
    run = graph.replay if graph is not None else fn
    for _ in range(opts.warmup):
        run()
    us = [1e3 * ms for ms in membw.cuda_event_ms(run, opts.repeats, before=flush)]
    return {"us": statistics.median(us), "us_min": min(us), "us_all": us, "timing": timing, "timing_note": note}


def check_cell(row: dict) -> str:
    if "error" in row["hmoe"]:
        return "FAIL hmoe: " + row["hmoe"]["error"]
    bad = [c for c in row["checks"] if c["counts"] and not c["ok"]]
    if bad:
        return "FAIL " + ", ".join(f"{c['what']} {c['rel_err']:.1e} > {c['tol']:.0e}" for c in bad)
    good = ", ".join(f"{c['what'].replace('hmoe vs ', '')} {c['rel_err']:.1e}" for c in row["checks"] if c["counts"])
    off = [c["what"] for c in row["checks"] if not c["counts"] and not c["ok"]]
    return f"ok {good}" + (f" (flashinfer off: {', '.join(off)})" if off else "")


def fi_cell(backend: str, key: str, us_fmt: str = ".1f"):
    """A cell of flashinfer's `backend`: its microseconds ("us") or hmoe's speedup over it ("speedup")."""
    def cell(row: dict) -> str:
        res = row["flashinfer"].get(backend) or {}
        if key == "speedup" or not res:
            return f"{res['speedup']:.2f}x" if res.get("speedup") else "-"
        return format(res["us"], us_fmt) if "us" in res else ("error" if "error" in res else "n/a")
    return cell


def hm_cell(key: str, fmt: str):
    """A cell of hmoe's result `key`, formatted, or "-"."""
    return lambda r: format(r["hmoe"][key], fmt) if r["hmoe"].get(key) is not None else "-"


def format_row(row: dict, columns) -> str:
    """The table line (columns: (title, width, cell)), then an indented line per flashinfer error and
    per timing note (hmoe's error is in its check cell)."""
    lines = ["  ".join(f"{cell(row):<{w}}" for _, w, cell in columns).rstrip()]
    for name, res in [("hmoe", row["hmoe"])] + list(row["flashinfer"].items()):
        lines += [f"    {name}: {res[k]}" for k in ("error", "timing_note") if res.get(k) and (name, k) != ("hmoe", "error")]
    return "\n".join(lines)


def time_implementations(row: dict, label: str, progress, hmoe_run, flashinfer_run, backends, fi_skip: dict,
                         measure) -> dict:
    """Fills row["hmoe"] and row["flashinfer"][backend]: each implementation timed by measure(fn) on
    the same inputs (hmoe_run() and flashinfer_run(backend) return (fn, out) after one eager call);
    a failure is a table cell, never a crash. Returns the outputs by implementation."""
    outs = {}
    try:
        progress(f"{label}: hmoe")
        fn, out = hmoe_run()
        row["hmoe"], outs["hmoe"] = measure(fn), out
    except Exception as e:  # noqa: BLE001 - reported in the table; flashinfer still runs
        row["hmoe"] = {"error": error_text(e)}
    for backend in backends:
        if backend in fi_skip:
            row["flashinfer"][backend] = {"skipped": fi_skip[backend]}
            continue
        try:
            progress(f"{label}: flashinfer {backend} (a backend's first use may JIT-compile for minutes)")
            fn, out = flashinfer_run(backend)
            res = measure(fn)
            if "us" in row["hmoe"]:
                res["speedup"] = res["us"] / row["hmoe"]["us"]  # > 1: hmoe is faster
            row["flashinfer"][backend], outs[backend] = res, out
        except Exception as e:  # noqa: BLE001 - a flashinfer failure is a table cell, never a crash
            row["flashinfer"][backend] = {"error": error_text(e)}
    return outs


def check_outputs(row: dict, outs: dict, ref_err, tol: float) -> None:
    """row["checks"]: every implementation against the reference (ref_err(out) -> normwise error), and
    hmoe against each flashinfer backend over the whole output at twice the tolerance (two roundings
    of the same math differ by up to twice one's error; it counts against hmoe only where that
    backend itself matched the reference); row["failed"]."""
    def check(what, err, tol, counts):  # counts False: says something about flashinfer, not hmoe
        row["checks"].append({"what": what, "rel_err": err, "tol": tol, "ok": err <= tol, "counts": counts})
        return err <= tol

    ok = {impl: check(f"{impl} vs ref", ref_err(out), tol, impl == "hmoe") for impl, out in outs.items()}
    for backend in (b for b in outs if b != "hmoe" and "hmoe" in outs):
        check(f"hmoe vs {backend}", rel_err(outs["hmoe"], outs[backend].double()), 2 * tol, ok[backend])
    row["failed"] = "error" in row["hmoe"] or any(c["counts"] and not c["ok"] for c in row["checks"])
