# The GPU timing of bench mla and bench prefill faked for their CPU tests.
from hmoe.bench import _gpu_bench, membw


def fake_timing(monkeypatch, wrapper, times: dict, calls: list | None = None) -> None:
    """_gpu_bench.time_all with no graphs and no GPU: each block of timed calls runs its
    implementation once and reports times[name] microseconds for every call. The name is the
    backend of the fake flashinfer `wrapper` class that ran (its `last`), else what hmoe's fn
    returned where times has it, else "hmoe". `calls` collects (name, calls) per block."""

    def cuda_event_ms(run, repeats, before=None, after=None):
        wrapper.last = None
        got = run()
        name = wrapper.last or (got if isinstance(got, str) and got in times else "hmoe")
        if calls is not None:
            calls.append((name, repeats))
        return [times[name] / 1e3] * repeats

    monkeypatch.setattr(_gpu_bench, "prepare", lambda fn, opts: (fn, "graph", None))
    monkeypatch.setattr(membw, "cuda_event_ms", cuda_event_ms)
