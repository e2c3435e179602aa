"""hmoe._native: the file check before a module is mapped, the spec every module is checked
against, and the torch binding (with its fallback for torch without the DLPack exchange API)."""
import os
import subprocess
import sys

import pytest
import torch

import hmoe
from hmoe import _native
from hmoe._native import spec


def test_check_file(tmp_path):
    good = _native.file_of("cpu_core")
    assert good and _native.check_file(good) is None
    data = open(good, "rb").read()
    for cut, words in [(len(data) // 2, "truncated"), (4096, "truncated"), (10, "not an ELF file")]:
        bad = tmp_path / f"cut{cut}.so"
        bad.write_bytes(data[:cut])
        assert words in _native.check_file(str(bad))
    (tmp_path / "text.so").write_text("not a library")
    assert "not an ELF file" in _native.check_file(str(tmp_path / "text.so"))
    assert "cannot be read" in _native.check_file(str(tmp_path / "absent.so"))


def test_every_built_module_matches_the_spec():
    info = hmoe.build_info()
    names = ["cpu_core"] + list(info["cpu_modules"]) + sorted({e["module"].rsplit(".", 1)[1]
                                                              for e in info["cuda_kernels"].values()})
    from hmoe.hardware import cpu

    runnable = {lv["name"] for lv in cpu.levels() if not cpu.missing_requirements(lv, cpu.cpu_info(request_amx=True))}
    for name in names:
        if name.startswith("experts_") and name.split("_", 1)[1] not in runnable:
            continue  # never mapped on a CPU that cannot run its ISA
        mod = _native.load(name)
        assert dict(mod.signatures()) == _native.expected_table(name)
        assert dict(mod.constants()) == spec.constants()


def test_spec_parses_every_entry_point():
    rows = spec.entry_points()
    kinds = {k for k, *_ in rows}
    assert kinds == {"cpu_core", "experts", "cuda"}
    sigs = {name: sig for _, _, name, sig in rows}
    assert sigs["moe_experts"].startswith("moe_experts(x:tensor, topk_ids:tensor, topk_weights:tensor")
    assert sigs["mla_decode"].startswith("mla_decode(q_nope:tensor, q_pe:tensor, ckv_cache:tensor")
    assert "return_lse:bool" in sigs["mla_decode"]  # expanded from HMOE_ARGS_mla_decode_check
    c = spec.constants()
    assert c["mla_dim_ckv"] == 512 and c["mla_dim_pe"] == 64 and c["abi_version"] >= 2


FALLBACK = """
import sys, torch, hmoe
from hmoe._native import torch_binding as tb
real = tb.args()
tb.args.cache_clear()
tb.args = lambda: (None,) + real[1:]   # as on a torch without __dlpack_c_exchange_api__
g = torch.Generator().manual_seed(5)
x = torch.randn(7, 40, generator=g).bfloat16()
w13, w2 = torch.randn(4, 48, 40, generator=g).bfloat16(), torch.randn(4, 40, 24, generator=g).bfloat16()
ids = torch.randint(0, 4, (7, 2), generator=g, dtype=torch.int32)
w = torch.rand(7, 2, generator=g)
out = {"functional": hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2), "packed": hmoe.CPUExperts(w13, w2)(x, ids, w),
       "topk": hmoe.ops.grouped_topk(torch.randn(3, 16, generator=g), 4, n_group=4, topk_group=2,
                                     scoring="sigmoid", bias=torch.randn(16, generator=g))}
try:
    hmoe.ops.moe_experts_cpu(x.float().T, ids, w, w13, w2)
except ValueError as e:
    out["error"] = str(e)
torch.save(out, sys.argv[1])
"""


def test_fallback_without_the_exchange_api(tmp_path):
    path = tmp_path / "fallback.pt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", FALLBACK, str(path)], capture_output=True, text=True, timeout=300,
                       cwd=root)
    assert p.returncode == 0, p.stderr
    got = torch.load(path)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 40, generator=g).bfloat16()
    w13, w2 = torch.randn(4, 48, 40, generator=g).bfloat16(), torch.randn(4, 40, 24, generator=g).bfloat16()
    ids = torch.randint(0, 4, (7, 2), generator=g, dtype=torch.int32)
    w = torch.rand(7, 2, generator=g)
    assert torch.equal(got["functional"], hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2))
    assert torch.equal(got["packed"], hmoe.CPUExperts(w13, w2)(x, ids, w))
    want = hmoe.ops.grouped_topk(torch.randn(3, 16, generator=g), 4, n_group=4, topk_group=2, scoring="sigmoid",
                                 bias=torch.randn(16, generator=g))
    assert all(torch.equal(a, b) for a, b in zip(got["topk"], want))
    assert "x must be" in got["error"]


@pytest.mark.parametrize("name", ["cpu_core"])
def test_load_refuses_a_module_from_another_build(monkeypatch, name):
    import types

    fake = types.ModuleType(f"hmoe._native.{name}")
    fake.abi_version = lambda: spec.constants()["abi_version"]
    fake.signatures = lambda: _native.expected_table(name)
    fake.constants = lambda: dict(spec.constants(), mla_dim_ckv=576)
    monkeypatch.setitem(sys.modules, f"hmoe._native.{name}", fake)
    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.setattr(_native, "_failed", {})
    with pytest.raises(_native.NativeModuleError, match="constant mla_dim_ckv is 576"):
        _native.load(name)
