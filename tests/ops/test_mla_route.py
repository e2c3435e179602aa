"""hmoe.ops.mla.route on simulated devices with fake family modules (no GPU): a shape the selected
family declines runs on the portable one, with the reason; forcing a family on a shape it declines
is a ValueError; the decision is cached; plan() and mla_decode() follow it."""
import logging
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from hmoe import _native, backends, dispatch  # noqa: E402
from hmoe._native import spec  # noqa: E402
from hmoe.hardware import gpu  # noqa: E402
from hmoe.ops import _cuda, mla  # noqa: E402

from ..hardware import fake_nvml as F  # noqa: E402

FEW_HEADS = "few heads on long walks: the portable kernel's 16-head CTAs suit them"
SMS = 132  # the fake devices' SM count (_cuda.sm_count)
KERNELS = {f: {"sass": sass, "ptx": ptx, "op": "mla_decode", "family": f, "module": f"hmoe._native.fake_{f}"}
           for f, sass, ptx in (("portable", ["80", "89", "90"], ["90"]), ("sm90a", ["90a"], []))}


def sm90a_rule(sms, batch, heads, max_pages, page_size):
    """A rule by the shape and the SM count, as the real module's (cuda/mla/mla_decode_sm90a.cu)."""
    if page_size % 16:
        return f"page size {page_size} is not a multiple of 16"
    return FEW_HEADS if heads <= 16 and batch * max_pages * page_size > 64 * sms else ""


def fake_family(monkeypatch, family, rule):
    """hmoe._native.fake_<family> as if imported: the spec's table, a declines rule that counts its
    calls, a plan and a kernel that say which family answered."""
    name = f"fake_{family}"
    m = types.ModuleType(f"hmoe._native.{name}")
    m.abi_version = lambda: spec.constants()["abi_version"]
    m.signatures = lambda: dict(_native.expected_table(name))
    m.constants = lambda: dict(spec.constants())
    m.asked = []
    m.mla_decode_declines = lambda *shape: m.asked.append(shape) or rule(*shape)
    m.mla_decode_plan = lambda device, batch, heads, max_pages, page_size, config, tma: \
        (1, {"portable": 3, "sm90a": 7}[family], 0, 16, 64, 1024, 1)
    m.mla_decode = lambda *args: family

    def check(q_nope, *args):  # the real check's verdict on a q_nope that is not [B, H, 512]
        if q_nope.dim() != 3:
            raise ValueError(f"q_nope has shape {tuple(q_nope.shape)} (checked by {family})")
    m.mla_decode_check = check
    monkeypatch.setitem(sys.modules, f"hmoe._native.{name}", m)
    monkeypatch.setitem(_cuda._modules, name, m)  # bound and prewarmed: no CUDA touched
    _cuda._warm.add((0, name))
    return m


@pytest.fixture
def device(monkeypatch):
    """device(nvml_gpu) -> the fake modules {family: module}; cuda:0 is that GPU."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    for mod, attr in ((_native, "_loaded"), (_native, "_failed"), (_cuda, "_selections"), (_cuda, "_modules"),
                      (mla, "_routes"), (mla, "_calls")):
        monkeypatch.setattr(mod, attr, {})
    monkeypatch.setattr(_cuda, "_warm", set())
    monkeypatch.setattr(mla, "_said", set())
    monkeypatch.setattr(_cuda, "sm_count", lambda index: SMS)
    monkeypatch.setattr(dispatch, "_torch_capability", lambda o, may_init: None)
    monkeypatch.setattr(dispatch, "_build_info", types.SimpleNamespace(
        cuda_kernels_for=lambda op: KERNELS if op == "mla_decode" else {}, _manifest=lambda: {"cuda_version": "13.0"}))

    def use(g):
        monkeypatch.setattr(gpu, "_NVML_HOOK", F.make([g]))
        gpu.refresh()
        return {"portable": fake_family(monkeypatch, "portable", lambda *shape: ""),
                "sm90a": fake_family(monkeypatch, "sm90a", sm90a_rule)}
    yield use
    gpu.refresh()


def test_declined_shape_runs_on_portable_with_the_reason(device, caplog):
    mods = device(F.H200)
    with caplog.at_level(logging.INFO, logger="hmoe.dispatch"):
        r = mla.route(0, 64, 16, 64, 64)
    assert (r.variant, r.module, r.target, r.device) == ("portable", "fake_portable", "sm_90", "cuda:0 (NVIDIA H200, 9.0)")
    assert r.reason == f"fallback: sm90a declines 64 requests of up to 4096 tokens, 16 heads, page size 64: {FEW_HEADS}"
    assert [rec.getMessage() for rec in caplog.records if "declines" in rec.getMessage()] == \
        [f"hmoe: mla_decode on cuda:0 (NVIDIA H200, 9.0): {r.reason}"]
    served = mla.route(0, 64, 128, 64, 64)
    assert (served.variant, served.module, served.reason) == ("sm90a", "fake_sm90a", "native: sm_90a SASS")
    odd_page = mla.route(0, 64, 128, 64, 8)
    assert odd_page.variant == "portable" and odd_page.reason.endswith("page size 8: page size 8 is not a multiple of 16")
    assert mods["sm90a"].asked == [(SMS, 64, 16, 64, 64), (SMS, 64, 128, 64, 64), (SMS, 64, 128, 64, 8)]
    assert mods["portable"].asked == []
    # 16 heads on a short walk: served, the rule asked with the shape and the SM count
    short = mla.route(0, 4, 16, 8, 64)
    assert short.variant == "sm90a" and mods["sm90a"].asked[-1] == (SMS, 4, 16, 8, 64)
    # another declined shape with the same reason is not logged again
    with caplog.at_level(logging.INFO, logger="hmoe.dispatch"):
        assert mla.route(0, 32, 16, 128, 64).variant == "portable"
    assert sum("declines" in rec.getMessage() for rec in caplog.records) == 1


def test_the_decision_is_cached(device, caplog):
    mods = device(F.H200)
    with caplog.at_level(logging.INFO, logger="hmoe.dispatch"):
        first = mla.route(0, 64, 16, 64, 64)
        assert mla.route(0, 64, 16, 64, 64) is first and mla.route(0, 64, 16, 64, 64, None) is first
    assert mods["sm90a"].asked == [(SMS, 64, 16, 64, 64)]  # the module was asked once
    assert sum("declines" in rec.getMessage() for rec in caplog.records) == 1  # and it was said once
    assert mla.route(0, 64, 128, 64, 64) is mla.route(0, 64, 128, 64, 64) is not first
    assert mla.route(0, 4, 16, 64, 64) is not first  # batch and the table's width are part of the key
    assert mla.route(0, 64, 16, 4, 64) is not first


def test_a_device_may_be_given_as_an_ordinal_a_string_or_a_torch_device(device):
    device(F.H200)
    served = mla.route(0, 64, 128, 64, 64)
    assert mla.route("cuda:0", 64, 128, 64, 64) is served and mla.route(torch.device("cuda", 0), 64, 128, 64, 64) is served
    assert mla.plan("cuda:0", 4, 128, 8, 64) == mla.plan(0, 4, 128, 8, 64)
    # "cuda" is torch's current device (0 here), also where torch has no CUDA (not an AssertionError)
    assert mla.route("cuda", 64, 128, 64, 64) is served and mla.route(torch.device("cuda"), 64, 128, 64, 64) is served
    for bad in ("cpu", torch.device("cpu"), "gpu0", 1.0, None, -1, True):
        with pytest.raises(ValueError, match="expected a CUDA device"):
            mla.route(bad, 64, 128, 64, 64)


def test_the_device_goes_by_the_name_the_readme_gives_it(device):
    # README: route(device, batch, heads, max_pages, page_size) and plan(device, batch, heads, max_pages,
    # page_size); the parameter was called index, so device= was a TypeError
    device(F.H200)
    assert mla.route(device="cuda:0", batch=64, heads=128, max_pages=64, page_size=64) is mla.route(0, 64, 128, 64, 64)
    assert mla.plan(device=torch.device("cuda", 0), batch=4, heads=128, max_pages=8, page_size=64) == \
        mla.plan(0, 4, 128, 8, 64)


@pytest.mark.parametrize("how", ["arg", "env"])
def test_forcing_a_family_on_a_shape_it_declines_is_an_error(device, monkeypatch, how):
    device(F.H200)
    kw = {"variant": "sm90a"} if how == "arg" else {}
    if how == "env":
        monkeypatch.setenv("HMOE_CUDA_VARIANT", "sm90a")
    source = "variant=" if how == "arg" else "HMOE_CUDA_VARIANT="
    with pytest.raises(ValueError) as e:
        mla.route(0, 64, 16, 64, 64, **kw)
    msg = str(e.value)
    assert msg.startswith(f"mla_decode: {source}'sm90a' does not serve 64 requests of up to 4096 tokens, 16 heads, "
                          "page size 64 on cuda:0 (NVIDIA H200")
    assert FEW_HEADS in msg and "the 'portable' variant serves this shape" in msg
    with pytest.raises(ValueError, match="page size 8 is not a multiple of 16"):
        mla.route(0, 64, 64, 64, 8, **kw)
    assert mla.route(0, 64, 64, 64, 16, **kw).variant == "sm90a"  # a shape it serves
    assert mla.route(0, 64, 16, 64, 64, "portable").reason == "forced by variant=portable: native: sm_90 SASS"
    if how == "env":  # own=True: hmoe's own choice, the environment ignored: no error, the fallback
        assert mla.route(0, 64, 16, 64, 64, own=True).variant == "portable"


def test_environment_is_part_of_the_key(device, monkeypatch):
    device(F.H200)
    assert mla.route(0, 64, 128, 64, 64).variant == "sm90a"
    monkeypatch.setenv("HMOE_CUDA_VARIANT", "portable")
    assert mla.route(0, 64, 128, 64, 64).variant == "portable"
    monkeypatch.delenv("HMOE_CUDA_VARIANT")
    assert mla.route(0, 64, 128, 64, 64).variant == "sm90a"


def test_device_without_the_family(device):
    mods = device(F.A100)
    r = mla.route(0, 64, 16, 64, 64)
    assert (r.variant, r.reason) == ("portable", "native: sm_80 SASS")
    assert mods["sm90a"].asked == [] and mods["portable"].asked == [(SMS, 64, 16, 64, 64)]
    with pytest.raises(ValueError, match="cannot run on cuda:0"):
        mla.route(0, 64, 128, 64, 64, "sm90a")


def test_backends_are_not_routed(device, monkeypatch):
    mods = device(F.H200)
    fake = types.ModuleType("fake_backend")
    fake.selectable = lambda name, cc, drv: (True, "flashinfer 0.2.9 on sm_90")
    monkeypatch.setitem(sys.modules, "fake_backend", fake)
    monkeypatch.setattr(backends, "BACKENDS", {"flashinfer-fa3": ("fake_backend", ("mla_decode",))})
    r = mla.route(0, 64, 16, 64, 64, "flashinfer-fa3")
    assert r.backend and r.variant == "flashinfer-fa3" and mods["sm90a"].asked == []
    with pytest.raises(ValueError, match="not hmoe's"):
        mla.plan(0, 64, 16, 64, 64, variant="flashinfer-fa3")
    monkeypatch.setenv("HMOE_CUDA_VARIANT", "flashinfer-fa3")  # the plan of hmoe's own choice then
    assert mla.plan(0, 64, 16, 64, 64).config == 3 and mla.plan(0, 4, 128, 10, 64).config == 7


def test_plan_follows_the_route(device):
    device(F.H200)
    assert mla.plan(0, 64, 16, 64, 64).config == 3  # portable's plan: sm90a declines 16 heads on long walks
    assert mla.plan(0, 4, 16, 10, 64).config == 7  # and serves them on short ones
    assert mla.plan(0, 4, 128, 10, 64).config == 7  # sm90a's
    assert mla.plan(0, 4, 128, 10, 64, variant="portable").config == 3
    with pytest.raises(ValueError, match="does not serve 64 requests of up to 4096 tokens, 16 heads"):
        mla.plan(0, 64, 16, 64, 64, variant="sm90a")


def test_mla_decode_runs_the_routed_family(device, monkeypatch):
    device(F.H200)
    monkeypatch.setattr(_cuda, "cuda_index", lambda t: 0)  # CPU tensors stand in for cuda:0's
    z = lambda *shape: torch.zeros(shape, dtype=torch.bfloat16)  # noqa: E731
    lens = torch.ones(2, dtype=torch.int32)

    def call(H, page=64, max_pages=1, **kw):
        pt = torch.zeros(2, max_pages, dtype=torch.int32)
        return mla.mla_decode(z(2, H, 512), z(2, H, 64), z(1, page, 512), z(1, page, 64), pt, lens, sm_scale=0.1, **kw)
    assert call(128) == "sm90a" and call(128, 8) == "portable"
    assert call(16) == "sm90a" and call(16, max_pages=100) == "portable"  # a short walk, a long one
    assert call(16) == "sm90a" and call(16, max_pages=100) == "portable"  # again, from the call cache
    assert call(128, variant="portable") == "portable"
    with pytest.raises(ValueError, match="'sm90a' does not serve 2 requests of up to 6400 tokens, 16 heads"):
        call(16, max_pages=100, variant="sm90a")
    # Not shaped like q_nope: hmoe's own module's check says what is wrong, no routing needed.
    with pytest.raises(ValueError, match=r"q_nope has shape \(2,\) \(checked by sm90a\)"):
        mla.mla_decode(torch.zeros(2), z(2, 16, 64), z(1, 64, 512), z(1, 64, 64), torch.zeros(2, 1, dtype=torch.int32),
                       lens, sm_scale=0.1)


def test_the_caches_stay_bounded(device, monkeypatch):
    # A server varies the batch and the page table's width without end: the route and call caches
    # start over when full, and the decisions stay the same.
    device(F.H200)
    monkeypatch.setattr(_cuda, "cuda_index", lambda t: 0)  # CPU tensors stand in for cuda:0's
    monkeypatch.setattr(mla, "CACHE_ENTRIES", 8)
    z = lambda *shape: torch.zeros(shape, dtype=torch.bfloat16)  # noqa: E731
    for batch in range(1, 30):
        for max_pages in (1, 100):
            want = "portable" if batch * max_pages * 64 > 64 * SMS else "sm90a"  # the fake rule
            assert mla.route(0, batch, 16, max_pages, 64).variant == want
            pt = torch.zeros(batch, max_pages, dtype=torch.int32)
            got = mla.mla_decode(z(batch, 16, 512), z(batch, 16, 64), z(1, 64, 512), z(1, 64, 64), pt,
                                 torch.ones(batch, dtype=torch.int32), sm_scale=0.1)
            assert got == want
            assert len(mla._routes) <= 8 and len(mla._calls) <= 8
