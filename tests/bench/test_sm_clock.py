"""membw.SmClock and clock_text: the SM clock sampled from NVML while timed GPU work runs (a fake
reader in place of NVML)."""
import itertools
import time

from hmoe.bench import membw
from hmoe.hardware import gpu


def sample(monkeypatch, reader, why=None, seconds=0.02):
    monkeypatch.setattr(gpu, "sm_clock_reader", lambda ordinal: (reader, why))
    with membw.SmClock(0, period_s=1e-4) as clock:
        time.sleep(seconds)
    assert clock._thread is None or not clock._thread.is_alive()
    return clock.summary()


def test_samples_while_the_work_runs(monkeypatch):
    clocks = itertools.cycle([(1755, 0x4), (1740, 0x1 | 0x4), (1980, 0)])
    s = sample(monkeypatch, lambda: next(clocks))
    assert s["sm_clock_samples"] >= 3, s
    assert (s["sm_mhz"], s["sm_mhz_min"], s["sm_mhz_max"]) == (1755, 1740, 1980)
    assert s["sm_clock_reasons"] == ["idle", "power cap"] and "sm_clock_note" not in s
    assert membw.clock_text(s) == " at 1755 MHz (SM clock: power cap)"
    assert membw.clock_text({"sm_mhz": 1980, "sm_clock_reasons": ["idle"]}) == " at 1980 MHz (SM clock)"


def test_nvml_failing_mid_run_keeps_the_samples_and_says_so(monkeypatch):
    left = iter([(1500, 0), (1600, 0)])

    def read():
        try:
            return next(left)
        except StopIteration:
            raise RuntimeError("GPU is lost") from None
    s = sample(monkeypatch, read)
    assert s["sm_clock_samples"] == 2 and s["sm_mhz"] == 1550
    assert s["sm_clock_note"] == "NVML stopped answering (RuntimeError: GPU is lost)"


def test_without_nvml_the_result_says_why(monkeypatch):
    s = sample(monkeypatch, None, why="nvidia-ml-py is not installed", seconds=0)
    assert s == {"sm_mhz": None, "sm_clock_note": "nvidia-ml-py is not installed"}
    assert membw.clock_text(s) == ""
