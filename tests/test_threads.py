"""The CPU thread pool under misuse: forked children (os.fork, fork-started Pools), absurd thread
counts, and thread creation failing."""
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import hmoe

from .ops.experts_reference import random_problem

# The workers of a pool that has run a job wait on a condition variable; a forked child that
# used that pool would wait forever, so every fork test has a deadline.
DEADLINE_S = 60


@pytest.fixture
def two_threads():
    before = hmoe.get_num_threads()
    hmoe.set_num_threads(2)
    yield
    hmoe.set_num_threads(before)


def _problem():
    return random_problem(48, 64, 32, 6, 2, torch.float32, torch.bfloat16)


def _wait(pid: int) -> int:
    """The child's exit status; kills it and fails when it does not finish in time."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung in its first hmoe call (killed after {DEADLINE_S} s)")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Python 3.12 warns about fork with threads
def test_os_fork_child_runs_cpu_ops(two_threads):
    x, ids, w, w13, w2 = _problem()
    experts = hmoe.CPUExperts(w13, w2)
    want = experts(x, ids, w)  # the parent's workers now exist and sleep
    want_f = hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2)
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only when both ops ran and agree with the parent
        code = 1
        try:
            ok = torch.equal(experts(x, ids, w), want)
            ok = ok and torch.equal(hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2), want_f)
            ok = ok and torch.equal(experts(x, ids, w), want)  # its own pool, reused
            code = 0 if ok else 2
        finally:
            os._exit(code)
    assert _wait(pid) == 0
    assert torch.equal(experts(x, ids, w), want)  # the parent's pool is untouched


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a process allowed on at least two cores")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_forked_child_counts_its_own_cores(monkeypatch):
    # The default thread count (the cores this process may use) is asked once per process: a child
    # confined to one core after the fork asks again, and the parent keeps its count.
    import hmoe._threads as threads

    monkeypatch.setattr(threads, "_num_threads", None)
    monkeypatch.delenv("HMOE_NUM_THREADS", raising=False)
    before = hmoe.get_num_threads()
    assert before == len(os.sched_getaffinity(0))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            code = 0 if hmoe.get_num_threads() == 1 else 2
        finally:
            os._exit(code)
    assert _wait(pid) == 0
    assert hmoe.get_num_threads() == before


_POOL_STATE = {}


def _pool_job(i: int) -> bool:
    s = _POOL_STATE
    return torch.equal(s["experts"](s["x"], s["ids"], s["w"]), s["want"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fork_started_pool_runs_cpu_ops(two_threads):
    x, ids, w, w13, w2 = _problem()
    experts = hmoe.CPUExperts(w13, w2)
    _POOL_STATE.update(experts=experts, x=x, ids=ids, w=w, want=experts(x, ids, w))
    pool = multiprocessing.get_context("fork").Pool(2)
    try:
        got = pool.map_async(_pool_job, range(4)).get(timeout=DEADLINE_S)
    except multiprocessing.TimeoutError:
        pytest.fail(f"fork-started Pool workers hung in their first hmoe call ({DEADLINE_S} s)")
    finally:
        pool.terminate()
        pool.join()
        _POOL_STATE.clear()
    assert got == [True] * 4


@pytest.mark.parametrize("n", [0, -1, 2 ** 31, 10 ** 6, 1025, True, 2.0, "4", None])
def test_set_num_threads_refuses_garbage(n):
    before = hmoe.get_num_threads()
    with pytest.raises(ValueError, match="positive whole number of threads, at most 1024"):
        hmoe.set_num_threads(n)
    assert hmoe.get_num_threads() == before


@pytest.mark.parametrize("value", ["2147483648", "99999", "0", "abc", "-3", "1.5"])
def test_env_thread_count_refused_clearly_by_every_cpu_op(monkeypatch, value):
    import hmoe._threads as threads

    monkeypatch.setattr(threads, "_num_threads", None)
    monkeypatch.setenv("HMOE_NUM_THREADS", value)
    x, ids, w, w13, w2 = _problem()
    for call in (lambda: hmoe.CPUExperts(w13, w2), lambda: hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2)):
        with pytest.raises(ValueError, match="HMOE_NUM_THREADS"):
            call()


def test_the_bound_is_usable():
    before = hmoe.get_num_threads()
    try:
        hmoe.set_num_threads(hmoe._threads.MAX_THREADS)
        assert hmoe.get_num_threads() == hmoe._threads.MAX_THREADS == 1024  # taken, not clamped or ignored
    finally:
        hmoe.set_num_threads(before)
    assert hmoe.get_num_threads() == before


def run_child(code: str, timeout: int, **env_extra) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that imports the hmoe under test (and tests/ from the checkout),
    with the default thread count."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = os.path.dirname(os.path.dirname(os.path.abspath(hmoe.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, root]), **env_extra)
    env.pop("HMOE_NUM_THREADS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=root)


CHILD_THREAD_FAILURE = textwrap.dedent("""
    import resource, sys, torch, hmoe
    from tests.ops.experts_reference import random_problem
    # Experts large enough that the kernels want every thread they are given.
    x, ids, w, w13, w2 = random_problem(256, 256, 256, 64, 2, torch.float32, torch.float32)
    experts = hmoe.CPUExperts(w13, w2)
    want = experts(x, ids, w)
    vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
    # Room for a few more 8 MiB thread stacks, not for 200.
    resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
    hmoe.set_num_threads(200)
    try:
        experts(x, ids, w)
        print("NO ERROR")
    except RuntimeError as e:
        print("ERROR:", e)
    hmoe.set_num_threads(2)
    print("AFTER:", torch.equal(experts(x, ids, w), want))
""")


def test_thread_creation_failure_is_a_clear_error_and_the_pool_survives():
    p = run_child(CHILD_THREAD_FAILURE, 300, MALLOC_ARENA_MAX="1")  # no per-thread malloc arenas
    assert p.returncode == 0, p.stdout + p.stderr
    err = next(line for line in p.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR")))
    assert "could not start CPU worker thread" in err and "set_num_threads" in err, err
    assert "AFTER: True" in p.stdout, p.stdout


CHILD_WORKER_MASKS = textwrap.dedent("""
    import os, time, torch, hmoe
    from tests.ops.experts_reference import random_problem
    hmoe.set_num_threads(2)
    x, ids, w, w13, w2 = random_problem(64, 512, 256, 8, 2, torch.float32, torch.bfloat16)
    experts = hmoe.CPUExperts(w13, w2)  # about 6 MB of weights: both threads take part
    allowed = os.sched_getaffinity(0)

    def worker_masks():
        time.sleep(0.05)  # the workers spin 50 us after a job, then sleep
        masks = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith("hmoe-cpu-"):
                masks[name] = os.sched_getaffinity(int(tid))
        assert masks, "no hmoe-cpu-N worker thread found"
        return masks

    experts(x, ids, w)
    for name, mask in worker_masks().items():
        assert mask < allowed and len(mask) == len(allowed) - 1, (name, sorted(mask), sorted(allowed))
    # The caller moves from one CPU to another between jobs (as a thread does after a sleep): the workers
    # are kept off the CPU it calls from now (the caller moves their masks before it wakes them, and each
    # worker again before it sleeps), never left on it.
    for cpu in sorted(allowed)[:2]:
        os.sched_setaffinity(0, {cpu})  # this thread only
        experts(x, ids, w)
        for name, mask in worker_masks().items():
            assert mask == allowed - {cpu}, (name, cpu, sorted(mask), sorted(allowed))
    print("OK")
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least two CPUs this process may use")
def test_sleeping_workers_keep_off_the_callers_cpu():
    # A worker about to sleep takes the CPU of the job's caller out of its mask, so that waking it
    # cannot put it on the caller's CPU (cpp/common/thread_pool.cpp, AwayFromCaller): each named
    # worker may use every CPU of this process but one. In a fresh process: each experts ISA module
    # has its own pool, and the pools that other tests used keep their own masks.
    p = run_child(CHILD_WORKER_MASKS, 120)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


CHILD_DAEMON_AT_EXIT = textwrap.dedent("""
    import threading, time, torch, hmoe
    from tests.ops.experts_reference import random_problem
    hmoe.set_num_threads(2)

    # Into buffers kept alive: a new output freed after every call would send the threads through
    # torch's tensor deallocation, which releases and retakes the GIL itself and aborts a finalising
    # interpreter the same way (THPVariable_clear), whatever hmoe does.
    def calls(fn, x, ids, w):
        out = torch.empty_like(x)
        while True:
            fn(x, ids, w, out=out)

    # Long calls (tens of milliseconds: the finalisation begins inside the native work) and short
    # ones (microseconds: it begins while the arguments are read, where torch's is_neg() released
    # the GIL and aborted every exit)
    for T, H, I in ((1024, 512, 256), (2, 32, 16)):
        x, ids, w, w13, w2 = random_problem(T, H, I, 16, 6, torch.bfloat16, torch.bfloat16)
        experts = hmoe.CPUExperts(w13, w2)
        op = lambda x, ids, w, out, w13=w13, w2=w2: hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2, out=out)
        for fn in (experts, op):
            threading.Thread(target=calls, args=(fn, x, ids, w), daemon=True).start()
    time.sleep(0.3)
    print("main done", flush=True)  # the interpreter finalises with the daemon threads inside calls
""")


CHILD_CALL_WHILE_FINALISING = textwrap.dedent("""
    import os, torch, hmoe
    from tests.ops.experts_reference import random_problem
    x, ids, w, w13, w2 = random_problem(8, 64, 32, 4, 2, torch.float32, torch.bfloat16)
    experts = hmoe.CPUExperts(w13, w2)

    class Finaliser:  # deleted while the main thread finalises the interpreter
        def __del__(self):
            os.write(1, f"del {bool(experts(x, ids, w).isfinite().all())}\\n".encode())

    finaliser = Finaliser()
""")


def test_daemon_thread_inside_a_call_at_exit():
    # A daemon thread whose call outlives the main thread asks for the GIL while the interpreter
    # finalises; CPython ends it with pthread_exit there, whose unwinding through pybind11's
    # gil_scoped_release destructor (noexcept) was std::terminate: SIGABRT at every such exit.
    for _ in range(2):
        p = run_child(CHILD_DAEMON_AT_EXIT, 120)
        assert p.returncode == 0 and "main done" in p.stdout, (p.returncode, p.stdout + p.stderr)
        assert "terminate" not in p.stderr, p.stderr
    # The thread that finalises the interpreter is not parked: its calls (from __del__) return.
    p = run_child(CHILD_CALL_WHILE_FINALISING, 60)
    assert p.returncode == 0 and "del True" in p.stdout, (p.returncode, p.stdout + p.stderr)


CHILD_FEWER_THREADS = textwrap.dedent("""
    import os, time, torch, hmoe
    from tests.ops.experts_reference import random_problem
    x, ids, w, w13, w2 = random_problem(64, 512, 256, 8, 2, torch.float32, torch.bfloat16)
    experts = hmoe.CPUExperts(w13, w2)  # about 4 MB of w13 a call: work for 8 threads
    hmoe.set_num_threads(8)
    want = experts(x, ids, w)  # workers hmoe-cpu-1 .. 7 exist from now on
    hmoe.set_num_threads(2)

    def switches():  # context switches of the workers this job size no longer uses
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith("hmoe-cpu-") and int(name[9:]) >= 2:
                with open(f"/proc/self/task/{tid}/status") as f:
                    out[name] = sum(int(l.split()[1]) for l in f if "ctxt_switches" in l)
        return out

    assert torch.equal(experts(x, ids, w), want)
    time.sleep(0.05)
    before = switches()
    for _ in range(100):
        assert torch.equal(experts(x, ids, w), want)
    time.sleep(0.05)
    after = switches()
    woken = {n: after[n] - before[n] for n in before}
    # hmoe-cpu-2 .. 7 at least (packing at the default count, more cores than 8 start more workers)
    assert len(woken) >= 6 and max(woken.values()) <= 4, woken
    print("OK")
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_workers_beyond_the_thread_count_stay_asleep():
    # After set_num_threads(n) lowered the count, the workers above n used to be woken by every
    # job (and each spun 50 us before sleeping again): 1021 of them after set_num_threads(1024)
    # made a 2-thread call on 2 cores about 30% slower for the rest of the process.
    p = run_child(CHILD_FEWER_THREADS, 120)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


_FORK_DURING_LOAD = textwrap.dedent("""
    import os, sys, threading, time
    import hmoe._native as native

    entered, check = threading.Event(), native.check_module

    def slow_check(mod, name):  # the loading thread stays inside the load for a second
        entered.set()
        time.sleep(1.0)
        return check(mod, name)

    native.check_module = slow_check
    loader = threading.Thread(target=native.load, args=("cpu_core",))
    loader.start()
    assert entered.wait(30)
    pid = os.fork()  # while the other thread is inside the load
    if pid == 0:
        code = 1
        try:
            code = 0 if native.load("cpu_core") is not None and native.is_loaded("cpu_core") else 2
        finally:
            os._exit(code)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            loader.join()
            sys.exit(os.waitstatus_to_exitcode(status))
        time.sleep(0.02)
    os.kill(pid, 9)
    print("the child hung in its first load")
    sys.exit(3)
""")


def test_fork_while_another_thread_loads_a_native_module():
    # A fork that landed inside another thread's load handed the child hmoe._native's lock held by
    # a thread it does not have: its first load (every op's first call) waited forever. The fork
    # now waits for the load to finish. In a fresh interpreter: this one has cpu_core loaded.
    r = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORK_DURING_LOAD],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
