"""CPUExperts pickled, deep-copied and loaded where the CPU differs: it selects its variant again
for the machine it runs on instead of running the ISA it was built on."""
import copy
import pickle

import pytest
import torch

import hmoe
from hmoe import _native, _reference
from hmoe.hardware import cpu as hcpu
from hmoe.ops import experts as ops_experts

from .ops.experts_reference import random_problem, rel_err


def _experts(w_dtype=torch.bfloat16, **kw):
    x, ids, w, w13, w2 = random_problem(40, 48, 40, 5, 2, torch.float32, w_dtype)
    return hmoe.CPUExperts(w13, w2, **kw), (x, ids, w), (w13, w2)


def _check(y, args, w13, w2):
    """y against the fp64 reference: comparing a twin with its original alone passes when both are wrong
    alike (zeros, say)."""
    assert rel_err(y, _reference.moe_experts(*args, w13, w2)) < _reference.tolerance(
        "moe_experts", args[0].dtype, w_dtype=w13.dtype)


def test_pickle_and_deepcopy_round_trip():
    experts, args, weights = _experts()
    want = experts(*args)
    _check(want, args, *weights)
    for twin in (pickle.loads(pickle.dumps(experts)), copy.deepcopy(experts)):
        assert twin.isa == experts.isa and repr(twin) == repr(experts)
        assert torch.equal(twin(*args), want)
        assert twin._w13.data_ptr() != experts._w13.data_ptr()


@pytest.fixture
def weaker_cpu(monkeypatch):
    """Calling it moves this process to a CPU with only the lowest level of arch/cpu.json."""
    lowest = hcpu.levels()[0]["name"]

    def move():
        monkeypatch.setattr(hcpu, "cpu_info", lambda request_amx=False: hcpu.simulated(lowest))
        monkeypatch.setattr(ops_experts, "_selections", {})
        return lowest
    return move


def test_unpickled_on_a_weaker_cpu_reselects(weaker_cpu):
    # fp32 weights: every ISA computes them with fp32 FMAs and no rounding point, so two ISAs differ
    # by the order of fp32 sums only (at most 3.4e-7 normwise over 300 random problems, avx512_bf16
    # against generic). bf16 weights round h to bf16, where another sum order can move an h by an
    # ulp (up to 4.3e-5 normwise over 300 random problems of this size).
    experts, args, weights = _experts(torch.float32)  # built for this machine's best level
    blob = pickle.dumps(experts)
    lowest = weaker_cpu()
    twin = pickle.loads(blob)
    assert twin.selection.variant == lowest, twin.selection
    # Same packed weights, another ISA: the same function up to the order of fp32 sums.
    got, ref = twin(*args), experts(*args)
    assert (got - ref).norm() <= 1e-5 * ref.norm()
    _check(got, args, *weights)


def test_forced_isa_the_cpu_lacks_is_refused_at_unpickling(weaker_cpu):
    runnable = [lv["name"] for lv in hcpu.levels()
                if not hcpu.missing_requirements(lv, hcpu.cpu_info(request_amx=True))]
    if len(runnable) < 2:
        pytest.skip("this CPU runs a single ISA level")
    experts, _, _ = _experts(isa=runnable[-1])
    blob = pickle.dumps(experts)
    weaker_cpu()
    with pytest.raises(ValueError, match=f"unpickling CPUExperts on this machine: isa='{runnable[-1]}'"):
        pickle.loads(blob)


def test_state_from_another_version_is_refused():
    experts, _, _ = _experts()
    state = experts.__getstate__()
    state["version"] = 99
    twin = hmoe.CPUExperts.__new__(hmoe.CPUExperts)
    with pytest.raises(ValueError, match="another hmoe version"):
        twin.__setstate__(state)


def test_unpickling_does_not_load_the_old_module(weaker_cpu, monkeypatch):
    experts, _, _ = _experts()
    blob = pickle.dumps(experts)
    lowest = weaker_cpu()
    monkeypatch.setattr(_native, "_loaded", {})
    pickle.loads(blob)
    assert list(_native._loaded) == [f"experts_{lowest}"]
