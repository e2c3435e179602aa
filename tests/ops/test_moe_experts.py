"""moe_experts_cpu / CPUExperts against fp64 references on every ISA variant this CPU runs."""
import itertools
import threading

import pytest
import torch

import hmoe
from hmoe import dispatch
from hmoe.hardware import cpu as hcpu
from hmoe.ops import experts as ops_experts

from hmoe import _reference

from .experts_reference import random_problem, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def runnable_isas():
    info = hcpu.cpu_info(request_amx=True)
    built = hmoe.build_info()["cpu_modules"]
    names = {e["isa"] for e in built.values() if e["op"] == "experts"}
    return [lv["name"] for lv in hcpu.levels() if lv["name"] in names
            and not hcpu.missing_requirements(lv, info)]


ISAS = runnable_isas()


def check(y, x, ids, w, w13, w2):
    assert y.dtype == x.dtype and y.shape == x.shape
    ref_c = _reference.moe_experts(x, ids, w, w13, w2, contract=True)
    ref_p = _reference.moe_experts(x, ids, w, w13, w2, contract=False)
    assert rel_err(y, ref_c) < _reference.tolerance("moe_experts", x.dtype, w_dtype=w13.dtype, contract=True)
    assert rel_err(y, ref_p) < _reference.tolerance("moe_experts", x.dtype, w_dtype=w13.dtype, contract=False)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("x_dtype,w_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_all_dtype_combinations(isa, x_dtype, w_dtype):
    # T = 3 takes the decode (row-dot) path of moe_experts_cpu, T = 40 the packed path;
    # CPUExperts always runs packed. Odd H and I exercise every tail.
    for T, H, I, E, K in [(3, 67, 37, 6, 2), (40, 45, 50, 5, 3)]:
        x, ids, w, w13, w2 = random_problem(T, H, I, E, K, x_dtype, w_dtype)
        check(hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2, isa=isa), x, ids, w, w13, w2)
        check(hmoe.CPUExperts(w13, w2, isa=isa)(x, ids, w), x, ids, w, w13, w2)


@pytest.mark.parametrize("isa", ISAS)
def test_random_shapes(isa):
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    for _ in range(6):
        H, I = (int(v) for v in torch.randint(1, 130, (2,), generator=g))
        E = int(torch.randint(1, 9, (1,), generator=g))
        K = int(torch.randint(1, E + 1, (1,), generator=g))
        T = int(torch.randint(1, 70, (1,), generator=g))
        xd, wd = DTYPES[int(torch.randint(0, 3, (1,), generator=g))], DTYPES[int(torch.randint(0, 3, (1,), generator=g))]
        x, ids, w, w13, w2 = random_problem(T, H, I, E, K, xd, wd, ids_dtype=torch.int64, gen=g)
        check(hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2, isa=isa), x, ids, w, w13, w2)
        check(hmoe.CPUExperts(w13, w2, isa=isa)(x, ids, w), x, ids, w, w13, w2)


@pytest.mark.parametrize("isa", ISAS)
def test_many_rows_per_expert(isa):
    # Enough rows per expert for 32-row tiles (AMX) and several register tiles.
    x, ids, w, w13, w2 = random_problem(150, 96, 80, 3, 2, torch.bfloat16, torch.bfloat16)
    check(hmoe.CPUExperts(w13, w2, isa=isa)(x, ids, w), x, ids, w, w13, w2)
    check(hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2, isa=isa), x, ids, w, w13, w2)


@pytest.mark.parametrize("isa", ISAS)
def test_every_output_written(isa):
    x, ids, w, w13, w2 = random_problem(9, 33, 21, 4, 2, torch.float32, torch.float16)
    out = torch.full((9, 33), float("nan"))  # poisoned
    got = hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2, isa=isa, out=out)
    assert got.data_ptr() == out.data_ptr()
    check(out, x, ids, w, w13, w2)
    out.fill_(float("nan"))
    assert hmoe.CPUExperts(w13, w2, isa=isa)(x, ids, w, out=out).data_ptr() == out.data_ptr()
    check(out, x, ids, w, w13, w2)


@pytest.mark.parametrize("isa", ISAS)
def test_nan_stays_in_its_token(isa):
    x, ids, w, w13, w2 = random_problem(12, 40, 24, 4, 2, torch.float32, torch.bfloat16)
    x[5, 3] = float("nan")
    for y in (hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2, isa=isa), hmoe.CPUExperts(w13, w2, isa=isa)(x, ids, w)):
        assert torch.isnan(y[5]).all()
        keep = torch.arange(12) != 5
        ref = _reference.moe_experts(x[keep], ids[keep], w[keep], w13, w2)
        assert rel_err(y[keep], ref) < _reference.tolerance("moe_experts", torch.float32, w_dtype=torch.bfloat16)


def test_duplicate_ids_and_zero_tokens():
    x, ids, w, w13, w2 = random_problem(4, 32, 16, 3, 3, torch.float32, torch.float32)
    ids[:] = torch.tensor([0, 0, 2], dtype=ids.dtype)
    check(hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2), x, ids, w, w13, w2)
    y = hmoe.ops.moe_experts_cpu(x[:0], ids[:0], w[:0], w13, w2)
    assert y.shape == (0, 32) and y.dtype == torch.float32
    assert hmoe.CPUExperts(w13, w2)(x[:0], ids[:0], w[:0]).shape == (0, 32)


def empty_slots(x, ids, w, gen):
    """About a third of the slots set to -1 (empty), token 1's all of them; NaN where nothing may be read:
    the empty slots' weights and token 1's row of x."""
    ids[torch.rand(ids.shape, generator=gen) < 0.35] = -1
    ids[1] = -1
    w[ids < 0] = float("nan")
    x[1] = float("nan")


@pytest.mark.parametrize("isa", ISAS)
def test_empty_slots(isa):
    # T = 3 takes the decode (row-dot) path of moe_experts_cpu, T = 40 the packed path; a token whose
    # slots are all empty gets exact zeros, a batch of only empty slots as well.
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    for T, H, I, E, K in [(3, 67, 37, 6, 3), (40, 45, 50, 5, 3)]:
        for ids_dtype in (torch.int32, torch.int64):
            x, ids, w, w13, w2 = random_problem(T, H, I, E, K, torch.bfloat16, torch.bfloat16, ids_dtype=ids_dtype,
                                                gen=g)
            empty_slots(x, ids, w, g)
            experts = hmoe.CPUExperts(w13, w2, isa=isa)
            keep = torch.arange(T) != 1
            for y in (hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2, isa=isa), experts(x, ids, w)):
                assert torch.equal(y[1], torch.zeros_like(y[1]))
                check(y[keep], x[keep], ids[keep], w[keep], w13, w2)
            ids.fill_(-1)
            out = torch.full_like(x, float("nan"))  # poisoned
            assert torch.equal(experts(x, ids, w, out=out), torch.zeros_like(x))
            assert torch.equal(hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2, isa=isa), torch.zeros_like(x))


def test_only_minus_one_is_empty():
    x, ids, w, w13, w2 = random_problem(4, 32, 16, 3, 2, torch.float32, torch.float32)
    ids[2, 1] = -2
    with pytest.raises(ValueError, match=r"topk_ids holds -2 \(token 2, slot 1\).*not -1"):
        hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2)


def test_threads_and_concurrent_callers():
    x, ids, w, w13, w2 = random_problem(64, 128, 96, 8, 2, torch.bfloat16, torch.bfloat16)
    experts = hmoe.CPUExperts(w13, w2)
    expected = experts(x, ids, w)
    expected_f = hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2)
    # The single-caller results against the references: comparing the concurrent ones with them alone
    # would pass a kernel that returned zeros (or anything else) on every call.
    check(expected, x, ids, w, w13, w2)
    check(expected_f, x, ids, w, w13, w2)
    old = hmoe.get_num_threads()
    try:
        hmoe.set_num_threads(1)
        assert torch.equal(experts(x, ids, w), expected)
        hmoe.set_num_threads(3)
        results, errors = [], []

        def worker():
            try:
                for _ in range(5):
                    results.append((experts(x, ids, w), expected))
                    results.append((hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2), expected_f))
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert len(results) == 40
        # every thread count computes the same blocks (test_thread_counts_split_the_same_blocks): a call
        # that shared the pool with other callers gives the single caller's result to the bit
        for r, want in results:
            assert torch.equal(r, want)
    finally:
        hmoe.set_num_threads(old)
    with pytest.raises(ValueError, match="positive"):
        hmoe.set_num_threads(0)


@pytest.mark.parametrize("isa", ISAS)
def test_thread_counts_split_the_same_blocks(isa):
    # Enough blocks per phase that the tasks span several blocks and the last ones are split
    # further (moe_experts.cpp make_tasks): every thread count covers every block exactly once,
    # with the same result to the bit.
    x, ids, w, w13, w2 = random_problem(48, 512, 256, 4, 2, torch.bfloat16, torch.bfloat16)
    experts = hmoe.CPUExperts(w13, w2, isa=isa)
    old = hmoe.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 5):
            hmoe.set_num_threads(n)
            results.append(experts(x, ids, w))
    finally:
        hmoe.set_num_threads(old)
    check(results[0], x, ids, w, w13, w2)
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_forced_isa_selection(monkeypatch):
    lowest = hcpu.levels()[0]["name"]
    assert ops_experts.select(lowest).variant == lowest
    assert hmoe.CPUExperts(*random_problem(1, 8, 8, 2, 1, torch.float32, torch.float32)[3:], isa=lowest).isa == lowest
    monkeypatch.setenv("HMOE_CPU_ISA", lowest)
    assert ops_experts.select().variant == lowest
    assert "HMOE_CPU_ISA" in ops_experts.select().reason
    monkeypatch.setenv("HMOE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="sse9"):
        ops_experts.select()


def test_best_isa_is_the_highest_runnable():
    assert ops_experts.select().variant == ISAS[-1]


def test_refuses_what_the_cpu_cannot_run():
    info = hcpu.simulated("avx2")
    sel = dispatch.select_cpu("experts", info=info, load_module=False)
    assert sel.variant == "avx2" and "avx512" in sel.reason
    for isa in ("avx512", "avx512_bf16", "amx"):
        with pytest.raises(ValueError, match="cannot run"):
            dispatch.select_cpu("experts", isa=isa, info=info, load_module=False)
    unrunnable = [lv["name"] for lv in hcpu.levels() if lv["name"] not in ISAS]
    for isa in unrunnable:  # on this real CPU
        with pytest.raises(ValueError, match="cannot run"):
            hmoe.ops.moe_experts_cpu(*random_problem(1, 8, 8, 2, 1, torch.float32, torch.float32), isa=isa)
