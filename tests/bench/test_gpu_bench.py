# Tests for the timing that bench mla and bench prefill share (hmoe.bench._gpu_bench.time_all), GPU faked.
import gc
import types
import weakref

import pytest

from hmoe.bench import _gpu_bench, membw


def opts(**kw):
    return types.SimpleNamespace(**dict(dict(repeats=7, rounds=3, warmup=1, warmup_ms=0, eager=False), **kw))


def timed(monkeypatch, us_of, fail=None):
    """time_all over three fake implementations a, b, c (a 10 us, b 15, c 12 a call, times us_of(name,
    block, base) for the block-th timed block of the row); `fail`: (name, block) whose call raises.
    Returns (blocks: [(name, timed calls, untimed calls before them)], time_all(opts) -> (results,
    outs), impl(name) -> the (run, out) of one implementation)."""
    base = {"a": 10.0, "b": 15.0, "c": 12.0}
    blocks, untimed = [], {n: 0 for n in base}

    def impl(name):
        def run():
            if fail == (name, len(blocks)):
                raise RuntimeError(f"{name} failed\ndetails")
            untimed[name] += 1
        run.name = name
        return run, f"out of {name}"

    def cuda_event_ms(run, repeats, before=None, after=None):
        name = run.name
        blocks.append((name, repeats, untimed[name]))
        untimed[name] = 0
        run()
        untimed[name] = 0
        return [us_of(name, len(blocks) - 1, base[name]) / 1e3] * repeats

    monkeypatch.setattr(_gpu_bench, "prepare", lambda fn, o: (fn, "graph", None))
    monkeypatch.setattr(membw, "cuda_event_ms", cuda_event_ms)
    return blocks, lambda o: _gpu_bench.time_all({n: (lambda n=n: impl(n)) for n in base}, o, None,
                                                 lambda m: None, "row"), impl


def test_implementations_take_turns_in_rotated_rounds(monkeypatch):
    blocks, time_all, _ = timed(monkeypatch, lambda name, block, us: us)
    results, outs = time_all(opts())
    # 7 calls as 3 + 2 + 2, each turn after 1 untimed call; the order: turn_order's
    assert blocks == [("a", 3, 1), ("b", 3, 1), ("c", 3, 1), ("c", 2, 1), ("b", 2, 1), ("a", 2, 1),
                      ("b", 2, 1), ("c", 2, 1), ("a", 2, 1)]
    assert {n: r["us"] for n, r in results.items()} == {"a": 10.0, "b": 15.0, "c": 12.0}
    assert all(len(r["us_all"]) == 7 and r["timing"] == "graph" for r in results.values())
    # each turn's samples, with its round and the implementation before it (JSON: the carry-over)
    assert [(t["round"], t["after"], t["us"]) for t in results["a"]["turns"]] == \
        [(0, None, [10.0] * 3), (1, "b", [10.0] * 2), (2, "c", [10.0] * 2)]
    assert [t["after"] for t in results["c"]["turns"]] == ["b", "c", "b"]  # c ends round 0 and opens round 1
    assert outs == {"a": "out of a", "b": "out of b", "c": "out of c"}


def test_more_rounds_than_calls_and_one_round(monkeypatch):
    blocks, time_all, _ = timed(monkeypatch, lambda name, block, us: us)
    time_all(opts(repeats=2, rounds=5, warmup=0))
    assert blocks == [("a", 1, 0), ("b", 1, 0), ("c", 1, 0), ("c", 1, 0), ("b", 1, 0), ("a", 1, 0)]
    blocks.clear()
    time_all(opts(rounds=1))
    assert blocks == [("a", 7, 1), ("b", 7, 1), ("c", 7, 1)]


def test_by_default_the_implementations_alternate_call_by_call(monkeypatch):
    blocks, time_all, _ = timed(monkeypatch, lambda name, block, us: us)
    results, _ = time_all(opts(repeats=3, rounds=None))
    assert blocks == [("a", 1, 1), ("b", 1, 1), ("c", 1, 1), ("c", 1, 1), ("b", 1, 1), ("a", 1, 1),
                      ("b", 1, 1), ("c", 1, 1), ("a", 1, 1)]
    assert [t["round"] for t in results["a"]["turns"]] == [0, 1, 2] and results["a"]["us"] == 10.0


def test_a_change_of_the_gpus_state_falls_on_every_implementation(monkeypatch):
    # every call twice as slow from the row's timed block `slow_from` on (clocks dropping, a neighbour's load)
    slow_from = 1
    blocks, time_all, _ = timed(monkeypatch, lambda name, block, us: us * (2 if block >= slow_from else 1))
    one = time_all(opts(rounds=1))[0]  # a before the change, b and c after it: a false 3x and 2.4x
    assert one["b"]["us"] / one["a"]["us"] == 3.0 and one["c"]["us"] / one["a"]["us"] == 2.4
    blocks.clear()
    slow_from = 3
    turns = time_all(opts(repeats=9, rounds=3))[0]  # a third of each one's calls before the change
    assert turns["b"]["us"] / turns["a"]["us"] == 1.5 and turns["c"]["us"] / turns["a"]["us"] == 1.2
    assert (turns["a"]["us_min"], turns["a"]["us"]) == (10.0, 20.0)


def test_failures_are_results_and_the_others_still_run(monkeypatch):
    blocks, time_all, impl = timed(monkeypatch, lambda name, block, us: us, fail=("b", 4))  # b's second turn
    results, outs = time_all(opts())
    assert results["b"] == {"error": "RuntimeError: b failed"} and "b" not in outs
    assert [n for n, _, _ in blocks] == ["a", "b", "c", "c", "a", "c", "a"]  # b failed in its warm-up, then sat out
    assert results["a"]["us"] == 10.0 and len(results["c"]["us_all"]) == 7

    def broken():
        raise ValueError("no such variant\nmore")

    results, outs = _gpu_bench.time_all({"x": broken, "c": lambda: impl("c")}, opts(), None, lambda m: None, "row")
    assert results["x"] == {"error": "ValueError: no such variant"} and outs == {"c": "out of c"}
    assert results["c"]["us"] == 12.0


def test_turn_order_varies_who_goes_before_whom():
    names = ["a", "b", "c", "d"]
    orders = [_gpu_bench.turn_order(names, r) for r in range(4)]
    assert orders == [["a", "b", "c", "d"], ["d", "c", "b", "a"], ["b", "c", "d", "a"], ["a", "d", "c", "b"]]
    sequence = [n for order in orders for n in order]
    before = {n: {p for p, q in zip(sequence, sequence[1:]) if q == n and p != n} for n in names}
    assert all(len(b) >= 2 for b in before.values()), before  # a plain rotation: always the same one
    assert _gpu_bench.turn_order(["x"], 5) == ["x"] and _gpu_bench.turn_order([], 1) == []


def test_warm_up_by_calls_then_by_time(monkeypatch):
    clock, calls, syncs = [0.0], [], []
    monkeypatch.setattr(_gpu_bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(_gpu_bench, "sync", lambda: syncs.append(len(calls)))

    def run():  # a call of 4 ms
        calls.append(1)
        clock[0] += 0.004

    _gpu_bench.warm_up(run, opts(warmup=2, warmup_ms=0))
    assert (len(calls), syncs) == (2, [])
    calls.clear()
    _gpu_bench.warm_up(run, opts(warmup=2, warmup_ms=10))  # 2 calls, then 3 more to pass 10 ms
    assert len(calls) == 5 and syncs == [2, 3, 4, 5]


def test_fill_row_derives_and_compares():
    row = {"hmoe": {}, "flashinfer": {"fa3": {"skipped": "needs sm_90"}}}
    results = {"hmoe v": {"us": 10.0}, "fa2": {"us": 15.0}, "fa3": {"error": "never run"}}
    _gpu_bench.fill_row(row, results, "hmoe v", ("fa2", "fa3", "fa4"), lambda r: dict(r, double=2 * r["us"]))
    assert row["hmoe"] == {"us": 10.0, "double": 20.0}
    assert row["flashinfer"] == {"fa2": {"us": 15.0, "double": 30.0, "speedup": 1.5}, "fa3": {"error": "never run"}}
    row = {"hmoe": {}, "flashinfer": {}}
    _gpu_bench.fill_row(row, {"hmoe": {"error": "E"}, "fa2": {"us": 15.0}}, "hmoe", ("fa2",), lambda r: r)
    assert row["hmoe"] == {"error": "E"} and row["flashinfer"]["fa2"] == {"us": 15.0}


@pytest.mark.parametrize("argv, message", [(["--rounds", "0"], "--rounds"), (["--repeats", "0"], "--repeats"),
                                           (["--warmup", "-1"], "--warmup"), (["--warmup-ms", "-1"], "--warmup-ms"),
                                           (["--warmup-ms", "nan"], "--warmup-ms")])
def test_timing_args(argv, message, capsys):
    import argparse

    p = argparse.ArgumentParser(prog="prog")
    _gpu_bench.add_timing_args(p, repeats=20)
    o = p.parse_args([])
    assert (o.repeats, o.rounds, o.warmup, o.warmup_ms, o.eager) == (20, None, 1, 0.0, False)
    assert _gpu_bench.rounds_of(o) == 20  # by default the implementations alternate call by call
    text = _gpu_bench.timing_text(o)
    assert "median over 20 calls, the implementations of a row alternating call by call" in text
    assert "each turn after 1 untimed call;" in text and "SM clock read right after each" in text
    three = p.parse_args(["--rounds", "3", "--warmup", "2"])
    assert _gpu_bench.rounds_of(three) == 3
    assert "taking turns in 3 rounds, each turn after 2 untimed calls;" in _gpu_bench.timing_text(three)
    assert "after 1 untimed call and 250 ms of them" in _gpu_bench.timing_text(p.parse_args(["--warmup-ms", "250"]))
    assert "turns" not in _gpu_bench.timing_text(p.parse_args(["--rounds", "1"]))
    assert _gpu_bench.rounds_of(p.parse_args(["--rounds", "50"])) == 20  # never more rounds than calls
    with pytest.raises(SystemExit) as e:
        _gpu_bench.check_timing_args(p, p.parse_args(argv))
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_each_implementation_outlives_its_graph(monkeypatch):
    # a graph replays memory that only fn's closure holds (a flashinfer wrapper's workspace): freed,
    # the next implementation's allocations took it and the replays read garbage or faulted
    class Fn:  # an implementation's fn, holding what its graph uses
        def __call__(self):
            return None

    made, alive = [], []

    def factory():
        fn = Fn()
        made.append(weakref.ref(fn))
        return fn, None

    def cuda_event_ms(run, repeats, before=None, after=None):
        gc.collect()
        alive.append(all(ref() is not None for ref in made))
        return [1e-3] * repeats

    monkeypatch.setattr(_gpu_bench, "prepare", lambda fn, o: ((lambda: None), "graph", None))  # a graph's replay
    monkeypatch.setattr(membw, "cuda_event_ms", cuda_event_ms)
    results, _ = _gpu_bench.time_all({"a": factory, "b": factory}, opts(), None, lambda m: None, "row")
    assert len(made) == 2 and alive == [True] * 6 and results["a"]["us"] == 1.0


class FakeGpu:
    """A GPU timeline for ClockProbe: a recorded event takes the time so far; _sleep(cycles) spins for
    cycles at `mhz` plus a launch's fixed cost (`launch_us`), which the probe must not count, and the
    first call also loads its kernel (`load_us`)."""

    def __init__(self, monkeypatch, mhz, launch_us=3.0, load_us=0.0):
        import torch

        self.t_us, self.mhz, self.launch_us, self.load_us = 0.0, mhz, launch_us, load_us
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = gpu.t_us

            def elapsed_time(self, end):  # ms, as torch's
                return (end.t - self.t) / 1e3

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", self.sleep, raising=False)

    def sleep(self, cycles):
        self.t_us += self.load_us + self.launch_us + cycles / self.mhz
        self.load_us = 0.0


def test_clock_probe_reads_the_sm_clock_without_the_launch_cost(monkeypatch):
    gpu = FakeGpu(monkeypatch, mhz=1755.0)
    probe = _gpu_bench.ClockProbe()
    assert probe.ok
    probe()
    gpu.mhz = 1980.0
    probe()
    got = probe.mhz()
    assert got == pytest.approx([1755.0, 1980.0], rel=1e-12)  # the 3 us of each launch drop out
    assert probe.mhz() == [] and probe.readings == []  # read once


def test_clock_probe_first_reading_does_not_time_the_kernel_load(monkeypatch):
    # The spin kernel's first launch pays its load (lazily loaded modules): timed, it would shorten
    # the difference of the two spins and inflate the first clock read.
    FakeGpu(monkeypatch, mhz=1755.0, load_us=100.0)
    probe = _gpu_bench.ClockProbe()
    probe()
    assert probe.mhz() == pytest.approx([1755.0], rel=1e-12)


def test_clock_probe_without_torch_sleep_queues_nothing(monkeypatch):
    import torch

    monkeypatch.delattr(torch.cuda, "_sleep", raising=False)
    probe = _gpu_bench.ClockProbe()
    probe()
    assert not probe.ok and probe.mhz() == []


def test_time_all_keeps_the_clock_after_each_call(monkeypatch):
    gpu = FakeGpu(monkeypatch, mhz=1500.0)
    clocks = {"a": 1800.0, "b": 1500.0}

    def cuda_event_ms(run, repeats, before=None, after=None):
        out = []
        for _ in range(repeats):
            run()
            gpu.mhz = clocks[run.name]  # the clock the call ended at
            after()
            out.append(0.01)
        return out

    def impl(name):
        def run():
            return None
        run.name = name
        return run, None

    monkeypatch.setattr(_gpu_bench, "prepare", lambda fn, o: (fn, "graph", None))
    monkeypatch.setattr(membw, "cuda_event_ms", cuda_event_ms)
    results, _ = _gpu_bench.time_all({n: (lambda n=n: impl(n)) for n in clocks}, opts(repeats=4, rounds=2), None,
                                     lambda m: None, "row")
    assert results["a"]["mhz"] == pytest.approx(1800.0) and results["b"]["mhz"] == pytest.approx(1500.0)
    assert results["a"]["mcycles"] == pytest.approx(0.018) and results["b"]["mcycles"] == pytest.approx(0.015)
    assert [len(t["mhz"]) for t in results["a"]["turns"]] == [2, 2]
    row = {"hmoe": results["a"], "flashinfer": {"fa3": results["b"], "fa2": {"skipped": "no"}}}
    assert _gpu_bench.format_row(row, [("x", 1, lambda r: "x")]).splitlines()[1] == \
        "    SM clock right after each call, MHz (median): hmoe 1800, fa3 1500; time x clock, M cycles (median): " \
        "hmoe 0.018, fa3 0.015"
