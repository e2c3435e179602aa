"""The experts modules' host jobs (what a CUDA host function or the doorbell thread runs), driven here
on the CPU (through ctypes, and by ringing the doorbell from Python): the same result as a direct call,
and a failure kept as an error with a NaN output."""
import contextlib
import ctypes

import pytest
import torch

import hmoe

from ..ops.experts_reference import random_problem

RUN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@contextlib.contextmanager
def host_job(experts, x, ids, w, out, threads):
    """(module, job handle, run) for a host job of `experts` over these buffers, freed afterwards; run() runs it."""
    mod = experts._mod
    fn, job = mod.host_job_create(x, ids, w, experts._w13, experts._w2, *experts._dims, out, threads)
    try:
        yield mod, job, lambda: RUN(fn)(job)
    finally:
        mod.host_job_free(job)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_host_job_runs_the_experts(x_dtype):
    x, ids, w, w13, w2 = random_problem(5, 48, 40, 6, 2, x_dtype, torch.bfloat16)
    experts = hmoe.CPUExperts(w13, w2)
    out = torch.full_like(x, float("nan"))
    with host_job(experts, x, ids, w, out, 2) as (mod, job, run):
        run()
        assert mod.host_job_error(job) == ""
        assert torch.equal(out, experts(x, ids, w))
        x.copy_(torch.randn_like(x))  # the job reads its buffers at each run
        run()
        assert torch.equal(out, experts(x, ids, w))


def test_host_job_failure_is_an_error_and_nan():
    x, ids, w, w13, w2 = random_problem(3, 32, 16, 4, 2, torch.float16, torch.float32)
    experts = hmoe.CPUExperts(w13, w2)
    out = torch.zeros_like(x)
    with host_job(experts, x, ids, w, out, 1) as (mod, job, run):
        ids[1, 0] = 7  # outside [0, 4)
        run()
        assert torch.isnan(out).all()
        assert "topk_ids holds 7 (token 1, slot 0)" in mod.host_job_error(job)
        assert mod.host_job_error(job) == ""  # read once


def test_host_job_checks_its_buffers():
    x, ids, w, w13, w2 = random_problem(3, 32, 16, 4, 2, torch.float32, torch.float32)
    experts = hmoe.CPUExperts(w13, w2)
    mod = experts._mod
    with pytest.raises(ValueError, match="out has shape"):
        mod.host_job_create(x, ids, w, experts._w13, experts._w2, *experts._dims, torch.empty(2, 32), 1)
    with pytest.raises(ValueError, match="out overlaps x"):
        mod.host_job_create(x, ids, w, experts._w13, experts._w2, *experts._dims, x, 1)
    with pytest.raises(ValueError, match="null handle"):
        mod.host_job_error(0)


def test_host_job_records_its_run_times():
    x, ids, w, w13, w2 = random_problem(3, 32, 16, 4, 2, torch.float32, torch.float32)
    experts = hmoe.CPUExperts(w13, w2)
    out = torch.empty_like(x)
    with host_job(experts, x, ids, w, out, 1) as (mod, job, run):
        assert mod.host_job_times(job) == []
        for _ in range(3):
            run()
        times = mod.host_job_times(job)
        assert len(times) == 3 and all(0 < t < 1e6 for t in times)  # microseconds
        assert mod.host_job_times(job) == []  # read once
        for _ in range(1030):  # the last 1024 runs are kept
            run()
        assert len(mod.host_job_times(job)) == 1024
        ids[0, 0] = 9  # a failed run is timed too
        run()
        assert len(mod.host_job_times(job)) == 1 and mod.host_job_error(job)


def ring(flags, timeout=10.0):
    """What the stream does on a doorbell (cpp/common/doorbell.h), from Python: ready = 1, wait for
    done == 1, done = 0."""
    import time

    flags[0] = 1
    end = time.monotonic() + timeout
    while int(flags[16]) != 1:
        assert time.monotonic() < end, "the doorbell was not answered"
        time.sleep(1e-5)
    assert int(flags[0]) == 0  # the server took the ring before running
    flags[16] = 0


def test_doorbell_runs_the_job_each_ring():
    x, ids, w, w13, w2 = random_problem(4, 48, 40, 6, 2, torch.bfloat16, torch.bfloat16)
    experts = hmoe.CPUExperts(w13, w2)
    out = torch.full_like(x, float("nan"))
    flags = torch.zeros(32, dtype=torch.int32)
    with host_job(experts, x, ids, w, out, 2) as (mod, job, _):
        mod.host_job_listen(job, flags)
        with pytest.raises(ValueError, match="already listens"):
            mod.host_job_listen(job, flags)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            out.fill_(float("nan"))
            ring(flags)
            assert torch.equal(out, experts(x, ids, w))
        assert len(mod.host_job_times(job)) == 3
        ids[0, 1] = 6  # outside [0, 6): the run fails, the bell is still answered
        ring(flags)
        assert torch.isnan(out).all() and "topk_ids holds 6" in mod.host_job_error(job)


def test_doorbells_of_several_jobs_and_after_idle():
    """Two jobs on the server, rung in turn, then again after the server's idle sleeps set in (> 2 ms of
    quiet); a freed job's bell is no longer polled while the other still answers."""
    import time

    jobs = []
    with contextlib.ExitStack() as stack:
        for seed in range(2):
            x, ids, w, w13, w2 = random_problem(2 + seed, 32, 16, 4, 2, torch.float32, torch.float32)
            experts = hmoe.CPUExperts(w13, w2)
            out = torch.zeros_like(x)
            flags = torch.zeros(32, dtype=torch.int32)
            mod, job, _ = stack.enter_context(host_job(experts, x, ids, w, out, 1))
            mod.host_job_listen(job, flags)
            jobs.append((experts, x, ids, w, out, flags))
        for pause in (0.0, 0.05, 0.0):
            time.sleep(pause)
            for experts, x, ids, w, out, flags in jobs:
                out.zero_()
                ring(flags)
                assert torch.equal(out, experts(x, ids, w))
        mod.host_job_wake()
    with pytest.raises(ValueError, match="at least 32"):
        experts = jobs[0][0]
        with host_job(experts, *jobs[0][1:4], torch.zeros_like(jobs[0][1]), 1) as (mod, job, _):
            mod.host_job_listen(job, torch.zeros(16, dtype=torch.int32))
