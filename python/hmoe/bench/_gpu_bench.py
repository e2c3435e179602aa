"""Pieces shared by the GPU attention benchmarks (bench mla, bench prefill): timing by CUDA-graph
replays, error text, the normwise error, loading flashinfer, and the table cells of a row that holds
hmoe's result, flashinfer's per backend and the checks."""
from __future__ import annotations

import math
import statistics
import time

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


ROUNDS = None  # the default of --rounds: one a timed call, the implementations alternating call by call
WARMUP = 1  # the default of --warmup
# What the progress line says while a flashinfer backend is set up (time_all's notes).
FLASHINFER_NOTES = {b: "flashinfer: a backend's first use may JIT-compile for minutes" for b in ("fa2", "fa3")}


def add_timing_args(p, repeats: int) -> None:
    """--repeats (default `repeats`), --rounds, --warmup, --warmup-ms and --eager: how bench mla and
    bench prefill time their calls."""
    p.add_argument("--repeats", type=int, default=repeats, help=f"timed calls per implementation (default {repeats})")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="the implementations of a row take turns, each timing about repeats / rounds calls a round "
                        "(the order varied from round to round); the median is over all of them (default: as many "
                        "rounds as timed calls, so that the implementations alternate call by call)")
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed calls before each turn (default {WARMUP})")
    p.add_argument("--warmup-ms", type=float, default=0.0,
                   help="then more untimed calls until this much time has passed, so that each implementation "
                        "is timed in its own sustained state (clocks, power) and not in its predecessor's (default 0)")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")


def check_timing_args(p, opts) -> None:
    if (opts.repeats < 1 or (opts.rounds is not None and opts.rounds < 1) or opts.warmup < 0
            or not 0 <= opts.warmup_ms <= 60e3):
        p.error("--repeats and --rounds must be positive, --warmup >= 0, --warmup-ms from 0 to 60000")


def rounds_of(opts) -> int:
    """The rounds of turns: --rounds (by default one a timed call), at most one a timed call."""
    return max(1, min(opts.rounds or opts.repeats, opts.repeats))


def timing_meta(opts) -> dict:
    """The JSON meta's keys on the timing method: repeats, rounds, warmup and timing_text."""
    return {"repeats": opts.repeats, "rounds": rounds_of(opts), "warmup": opts.warmup, "timing": timing_text(opts)}


def timing_text(opts) -> str:
    """What the benches say about their timing method (the header and the JSON's meta)."""
    how = "eager calls (--eager)" if opts.eager else "CUDA-graph replays (eager where capture fails: see notes)"
    rounds = rounds_of(opts)
    if rounds == opts.repeats > 1:
        turns = ", the implementations of a row alternating call by call (the order varied from round to round)"
    else:
        turns = f", the implementations of a row taking turns in {rounds} rounds" if rounds > 1 else ""
    warm = f" after {opts.warmup} untimed call{'s' * (opts.warmup != 1)}" + (
        f" and {opts.warmup_ms:g} ms of them" if opts.warmup_ms else "")
    return (f"{how}; CUDA events; median over {opts.repeats} calls{turns}, each turn{warm}; L2 flushed (reading 4x "
            "its size) before each; the SM clock read right after each (ClockProbe)")


class ClockProbe:
    """The SM clock right after each timed call: behind the call, two spins of PROBE_CYCLES clock64
    cycles (torch.cuda._sleep), each between CUDA events; MHz = the difference of their cycles over
    the difference of their times, so that the fixed cost of a launch between events drops out. The
    GPU's clocks move on a scale of milliseconds (power, heat: docs/perf/prefill.md), so the clock
    read right after a call is the one the call ended at; NVML's reported clock is no guide to it.
    Call the probe to queue one reading; mhz() after a synchronize gives them all (and forgets them).
    `ok` is False where torch has no _sleep: then it queues nothing."""

    PROBE_CYCLES = (20_000, 220_000)

    def __init__(self):
        import torch

        self.ok = callable(getattr(torch.cuda, "_sleep", None))
        self.readings = []
        self.warm = False  # whether the untimed first pair of spins has run (__call__)

    def __call__(self) -> None:
        if not self.ok:
            return
        if not self.warm:
            # One reading's spins untimed first: the first in a process also times what a first
            # launch costs (the spin kernel's lazy load), which inflates its clock.
            self._spins()
            self.warm = True
        self.readings.append(self._spins())

    def _spins(self) -> list:
        import torch

        events = []
        for cycles in self.PROBE_CYCLES:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            events.append((start, end))
        return events

    def discard(self) -> None:
        """Forgets the readings queued since the last mhz() (a turn that failed: its events may
        never complete)."""
        self.readings = []

    def mhz(self) -> list:
        """MHz of each reading queued since the last mhz() (the events must have completed)."""
        short, long = self.PROBE_CYCLES
        out = []
        for (s0, e0), (s1, e1) in self.readings:
            dt_us = 1e3 * (s1.elapsed_time(e1) - s0.elapsed_time(e0))
            out.append((long - short) / dt_us if dt_us > 0 else math.nan)
        self.readings = []
        return out


def prepare(fn, opts) -> tuple:
    """(run, timing, note): a CUDA graph of fn (which has run eagerly once: its lazy work is done)
    and its replay, unless opts.eager or capture fails (then fn itself, said in the note). The
    graph replays memory that only fn's closure holds (a flashinfer wrapper's workspace and
    buffers): the caller keeps fn alive as long as it runs the graph."""
    import torch

    if opts.eager:
        return fn, "eager", None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager timing
        return fn, "eager", f"graph capture failed ({error_text(e)}); timed eager calls"
    return graph.replay, "graph", None


def turn_order(names: list, r: int) -> list:
    """The order of round r's turns: names rotated by r // 2, reversed in odd rounds, so that an
    implementation does not always follow the same one. The GPU's clocks carry over from one turn
    to the next (they fall under a kernel that draws much power and recover under one that draws
    less), and a plain rotation keeps every implementation behind the same neighbour."""
    k = r // 2 % len(names) if names else 0
    order = names[k:] + names[:k]
    return order[::-1] if r % 2 else order


def warm_up(run, opts) -> None:
    """A turn's untimed calls: opts.warmup of them, then more, each waited for, until opts.warmup_ms
    have passed (0: none), so that each implementation is timed in its own sustained state rather
    than in the one its predecessor left."""
    for _ in range(opts.warmup):
        run()
    budget = opts.warmup_ms / 1e3
    if budget > 0:
        sync()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < budget:
            run()
            sync()


def sync() -> None:
    import torch

    torch.cuda.synchronize()


def time_all(impls: dict, opts, flush, progress, label: str, notes: dict | None = None) -> tuple[dict, dict]:
    """Times the implementations of one table row on the same inputs. impls: name -> factory,
    which returns (fn, out) after one eager call of fn. All are set up first (`prepare`); then
    they take turns in `rounds_of(opts)` rounds (`turn_order`; by default one timed call a turn),
    each turn untimed calls (`warm_up`) and about repeats / rounds timed ones with the L2 flushed
    before each and the SM clock read after each (`ClockProbe`), so that a change of the GPU's
    state during the row (its clocks, a neighbour's load) falls on every implementation alike. The
    flush queued ahead keeps the GPU busy while the CPU launches, so launch latency does not enter
    the times.
    Returns ({name: result}, {name: out}): a result holds the median and min microseconds over all
    of the implementation's calls, every sample (us_all), the median clock after them (mhz) and of
    each call's time x that clock (mcycles, millions: the call's cycles, as far as the clock held
    through it; both None where the clock could not be read), each turn's (turns: its round, the
    implementation whose turn came before it, its samples and clocks), the timing and its note; or
    {"error": text} where its setup or a call failed (a failure is a table cell, never a crash; it
    has no out)."""
    results, outs, runs = {}, {}, {}
    for name, factory in impls.items():
        try:
            progress(f"{label}: {name}" + (f" ({notes[name]})" if notes and name in notes else ""))
            fn, out = factory()
            runs[name] = prepare(fn, opts) + (fn,)  # fn kept: its graph replays what fn's closure holds
            outs[name] = out
        except Exception as e:  # noqa: BLE001 - reported in the table; the others still run
            results[name] = {"error": error_text(e)}
    rounds = rounds_of(opts)
    turns = {name: [] for name in runs}
    before = None  # the implementation whose turn came last
    probe = ClockProbe()
    for r in range(rounds):
        calls = opts.repeats // rounds + (r < opts.repeats % rounds)
        for name in turn_order(list(runs), r):
            if name in results:
                continue  # failed in an earlier turn
            run = runs[name][0]
            try:
                warm_up(run, opts)
                us = [1e3 * ms for ms in membw.cuda_event_ms(run, calls, before=flush, after=probe)]
                turns[name].append({"round": r, "after": before, "us": us, "mhz": probe.mhz()})
            except Exception as e:  # noqa: BLE001 - reported in the table; the others still run
                results[name] = {"error": error_text(e)}
                outs.pop(name, None)
                probe.discard()
            before = name
    for name, (_, timing, note, _) in runs.items():
        if name not in results:
            us = [t for turn in turns[name] for t in turn["us"]]
            mhz = [f for turn in turns[name] for f in turn["mhz"] if math.isfinite(f)]
            cycles = [t * f for turn in turns[name] for t, f in zip(turn["us"], turn["mhz"]) if math.isfinite(f)]
            results[name] = {"us": statistics.median(us), "us_min": min(us), "us_all": us, "turns": turns[name],
                             "mhz": statistics.median(mhz) if mhz else None,
                             "mcycles": statistics.median(cycles) / 1e6 if cycles else None,
                             "timing": timing, "timing_note": note}
    return results, outs


def flashinfer_impls(backends, fi_skip: dict, runner) -> tuple[dict, dict]:
    """({backend: factory} for time_all, {backend: {"skipped": why}}): runner(backend) sets one up;
    a backend in fi_skip (one this GPU cannot run) gets its reason instead."""
    impls = {b: (lambda b=b: runner(b)) for b in backends if b not in fi_skip}
    return impls, {b: {"skipped": fi_skip[b]} for b in backends if b in fi_skip}


def fill_row(row: dict, results: dict, hmoe: str, backends, derive) -> None:
    """row["hmoe"] from results[hmoe] and row["flashinfer"][b] from results[b] for each backend
    that has a result (a skipped one already holds its reason): derive(result) adds what follows
    from the time; each flashinfer time gets hmoe's speedup over it."""
    res = results[hmoe]
    row["hmoe"] = derive(res) if "us" in res else dict(res)
    for backend in backends:
        if backend not in results:
            continue
        res = results[backend]
        res = derive(res) if "us" in res else dict(res)
        if "us" in res and "us" in row["hmoe"]:
            res["speedup"] = res["us"] / row["hmoe"]["us"]  # > 1: hmoe is faster
        row["flashinfer"][backend] = res


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
    """The table line (columns: (title, width, cell)), then an indented line with the SM clock after
    each implementation's calls, and one per flashinfer error and per timing note (hmoe's error is
    in its check cell)."""
    lines = ["  ".join(f"{cell(row):<{w}}" for _, w, cell in columns).rstrip()]
    results = [("hmoe", row["hmoe"])] + list(row["flashinfer"].items())
    clocks = [f"{name} {res['mhz']:.0f}" for name, res in results if res.get("mhz")]
    cycles = [f"{name} {res['mcycles']:.3g}" for name, res in results if res.get("mcycles")]
    if clocks:
        lines.append("    SM clock right after each call, MHz (median): " + ", ".join(clocks)
                     + "; time x clock, M cycles (median): " + ", ".join(cycles))
    for name, res in results:
        lines += [f"    {name}: {res[k]}" for k in ("error", "timing_note") if res.get(k) and (name, k) != ("hmoe", "error")]
    return "\n".join(lines)


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
