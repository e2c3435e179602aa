"""ci/verify_wheel.py and ci/set_dist_name.py: a good wheel passes; missing targets, leaked ISAs, bad deps fail."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[2] / "ci"
# Read at import time: tests/conftest.py removes HMOE_* variables while each test runs.
WHEEL = os.environ.get("HMOE_TEST_WHEEL")
if not (CI / "verify_wheel.py").exists():
    pytest.skip(f"{CI} has no verify_wheel.py (copy ci/ next to tests/)", allow_module_level=True)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"hmoe_ci_{name}", CI / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


vw = _load("verify_wheel")
sdn = _load("set_dist_name")
X86 = platform.machine() in ("x86_64", "AMD64")
needs_wheel = pytest.mark.skipif(not WHEEL, reason="set HMOE_TEST_WHEEL=<wheel> (ci/build_wheel.sh does)")
needs_objdump = pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or not X86, reason="needs gcc on x86-64")


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rewrite(src: Path, dst: Path, changes: dict) -> Path:
    """Copy a wheel, replacing members (bytes, or a function of the old bytes); RECORD is
    regenerated so that only the intended defect remains."""
    with zipfile.ZipFile(src) as zin:
        files = [(i, zin.read(i)) for i in zin.infolist()]
    record = next(i.filename for i, _ in files if i.filename.endswith(".dist-info/RECORD"))
    out = []
    for info, data in files:
        if info.filename != record:
            change = changes.get(info.filename)
            out.append((info, change(data) if callable(change) else data if change is None else change))
    rec = "".join(f"{i.filename},{_hash(d)},{len(d)}\n" for i, d in out) + f"{record},,\n"
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info, data in out:
            zout.writestr(info, data)
        zout.writestr(record, rec)
    return dst


def member(wheel, pattern: str) -> str:
    names = [n for n in zipfile.ZipFile(wheel).namelist() if re.fullmatch(pattern, n)]
    assert len(names) == 1, (pattern, names)
    return names[0]


def manifest(wheel) -> dict:
    return json.loads(zipfile.ZipFile(wheel).read("hmoe/build_info.json"))


def fails(rep, check: str, subject: str = "", text: str = "") -> bool:
    return any(r[0] == "FAIL" and r[1] == check and subject in ("", r[2]) and text in r[3] for r in rep.rows)


# ---- the real wheel ---------------------------------------------------------------------------


@needs_wheel
@needs_objdump
def test_good_wheel_passes(capsys):
    rep = vw.verify(Path(WHEEL))
    rep.print("good wheel")
    assert rep.failed == 0, capsys.readouterr().out
    man = manifest(WHEEL)
    gpu = json.loads(zipfile.ZipFile(WHEEL).read("hmoe/arch/gpu.json"))
    fatbin_rows = {r[2]: r[3] for r in rep.rows if r[1] == "fatbin"}
    built = {k["family"] for k in man["cuda_kernels"].values()}
    assert set(fatbin_rows) == built
    for fam in built:  # a 'targets' family holds SASS for every target, an arch-specific one for its own
        sass = gpu["kernel_families"][fam]["sass"]
        want = [t["sm"] for t in gpu["targets"]] if sass == "targets" else [sass.split(":", 1)[1]]
        assert all(f"sm_{sm}" in fatbin_rows[fam] for sm in want), (fam, fatbin_rows[fam])
    isa_rows = {r[2] for r in rep.rows if r[1] == "cpu isa"}
    assert set(man["cpu_modules"]) <= isa_rows


LEAKS = [("generic", "avx2", "avx"), ("avx2", "avx512", "avx512"),
         ("avx512", "avx512_bf16", "avx512_bf16"), ("avx512_bf16", "amx", "amx")]


@needs_wheel
@needs_objdump
@pytest.mark.skipif(not X86, reason="x86-64 ISA levels")
@pytest.mark.parametrize("lower,higher,leak", LEAKS)
def test_higher_isa_module_copied_over_lower_fails(tmp_path, lower, higher, leak):
    lo = member(WHEEL, rf"hmoe/_native/experts_{lower}\..*\.so")
    hi = member(WHEEL, rf"hmoe/_native/experts_{higher}\..*\.so")
    bad = rewrite(Path(WHEEL), tmp_path / Path(WHEEL).name, {lo: zipfile.ZipFile(WHEEL).read(hi)})
    rep = vw.verify(bad)
    assert fails(rep, "cpu isa", f"experts_{lower}", f"LEAKS {leak} ")
    assert not fails(rep, "cpu isa", f"experts_{higher}")


@needs_wheel
@needs_objdump
@needs_gcc
def test_avx512_compiled_module_named_generic_fails(tmp_path):
    c = tmp_path / "leak.c"
    c.write_text("#include <immintrin.h>\nvoid hmoe_leak(float *x) {\n"
                 "  __m512 v = _mm512_loadu_ps(x); _mm512_storeu_ps(x, _mm512_add_ps(v, v));\n}\n")
    so = tmp_path / "leak.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-mavx512f", str(c), "-o", str(so)], check=True)
    name = member(WHEEL, r"hmoe/_native/experts_generic\..*\.so")
    rep = vw.verify(rewrite(Path(WHEEL), tmp_path / Path(WHEEL).name, {name: so.read_bytes()}))
    assert fails(rep, "cpu isa", "experts_generic", "LEAKS avx ")
    assert fails(rep, "cpu isa", "experts_generic", "avx512 (a avx512 instruction")


def drop_sass(so: bytes, sm: str) -> bytes:
    """The same .so with the SASS entry for `sm` cut out of every fatbin container (the section
    keeps its size; the freed tail is zeros, which the reader skips as padding)."""
    elf = vw.Elf(so)
    _n, _t, off, size, _l = next(s for s in elf.sections if s[0] == ".nv_fatbin")
    sec, out, pos = so[off:off + size], b"", 0
    while (pos := sec.find(struct.pack("<I", vw.FATBIN_MAGIC), pos)) >= 0:
        magic, ver, hsize, fsize = struct.unpack_from("<IHHQ", sec, pos)
        p, end, kept = pos + hsize, pos + hsize + fsize, b""
        while p < end:
            kind, _v, ehsize, padded = struct.unpack_from("<HHIQ", sec, p)
            arch, = struct.unpack_from("<I", sec, p + 28)
            if not (kind == 2 and str(arch) == sm):
                kept += sec[p:p + ehsize + padded]
            p += ehsize + padded
        out += sec[len(out):pos] + struct.pack("<IHHQ", magic, ver, hsize, len(kept)) + kept
        out += b"\0" * (end - pos - hsize - len(kept))
        pos = end
    out += sec[len(out):]
    assert len(out) == size
    return so[:off] + out + so[off + size:]


@needs_wheel
@pytest.mark.parametrize("also_manifest", [False, True], ids=["fatbin-only", "fatbin+manifest"])
def test_missing_sass_target_fails(tmp_path, also_manifest):
    man = manifest(WHEEL)
    entry = next((e for e in man["cuda_kernels"].values() if e["family"] == "portable"), None)
    if entry is None or len(entry["sass"]) < 2:
        pytest.skip("wheel has no portable CUDA kernels with several SASS targets")
    sm = entry["sass"][1]  # e.g. 89: neither the lowest nor the PTX target
    so = member(WHEEL, entry["module"].replace(".", "/") + r"\..*\.so")
    changes = {so: lambda data: drop_sass(data, sm)}
    if also_manifest:  # a self-consistent wheel that still lacks a target of arch/gpu.json
        for e in man["cuda_kernels"].values():
            e["sass"] = [t for t in e["sass"] if t != sm]
        changes["hmoe/build_info.json"] = json.dumps(man).encode()
    rep = vw.verify(rewrite(Path(WHEEL), tmp_path / Path(WHEEL).name, changes))
    if also_manifest:
        assert fails(rep, "cuda vs gpu.json", text=f"lacks ['{sm}']")
        assert not fails(rep, "fatbin")
    else:
        assert fails(rep, "fatbin", entry["module"].rsplit(".", 1)[-1], f"missing sm_{sm}")


@needs_wheel
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("code", ["sm_90a", "sm_90"])
def test_arch_specific_sm90a_module(tmp_path, code):
    """An sm90a-family module must hold sm_90a SASS: plain sm_90 is a different target."""
    cu = tmp_path / "probe.cu"
    cu.write_text("__global__ void mla_decode_probe(float *x) { x[threadIdx.x] += 1.0f; }\n")
    so = tmp_path / "probe.so"
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", str(cu), "-o", str(so),
                    "-gencode", f"arch=compute_{code[3:]},code={code}"], check=True)
    man = manifest(WHEEL)
    man["cuda_kernels"]["mla_decode/sm90a"] = {"op": "mla_decode", "family": "sm90a", "sass": ["90a"],
                                               "ptx": [], "module": "hmoe._native.mla_probe"}
    with zipfile.ZipFile(WHEEL) as z, zipfile.ZipFile(tmp_path / "plus.whl", "w") as out:
        for i in z.infolist():
            out.writestr(i, json.dumps(man) if i.filename == "hmoe/build_info.json" else z.read(i))
        out.write(so, "hmoe/_native/mla_probe.so")
    rep = vw.verify(rewrite(tmp_path / "plus.whl", tmp_path / Path(WHEEL).name, {}))
    if code == "sm_90a":
        assert not fails(rep, "fatbin") and not fails(rep, "cuda vs gpu.json")
        assert any(r[2] == "mla_probe" and "exact CC only: ['90a']" in r[3] for r in rep.rows)
    else:
        assert fails(rep, "fatbin", "mla_probe", "missing sm_90a")
        assert fails(rep, "fatbin", "mla_probe", "unexpected sm_90")


@needs_wheel
def test_manifest_and_metadata_defects_fail(tmp_path):
    man = manifest(WHEEL)
    man["cxx_flags"] += " -march=native"
    man["cuda_kernels"] = {}
    meta = member(WHEEL, r"[^/]+\.dist-info/METADATA")
    pin = lambda d: d.replace(b"\nRequires-Dist:", b"\nRequires-Dist: torch==2.13.0\nRequires-Dist:", 1)
    bad = rewrite(Path(WHEEL), tmp_path / Path(WHEEL).name,
                  {"hmoe/build_info.json": json.dumps(man).encode(), meta: pin})
    rep = vw.verify(bad, max_mib=0.01)
    for check, text in [("flags", "native"), ("cuda", "no CUDA kernels"), ("Requires-Dist", "pins"),
                        ("size", "limit 0.01 MiB")]:
        assert fails(rep, check, text=text), (check, rep.rows)
    assert not fails(vw.verify(bad, cpu_only=True), "cuda")


@needs_wheel
@needs_gcc
def test_libcudart_dependency_fails(tmp_path):
    (tmp_path / "stub.c").write_text("int cudaStub(void) { return 0; }\n")
    (tmp_path / "mod.c").write_text("int cudaStub(void);\nint hmoe_f(void) { return cudaStub(); }\n")
    run = lambda *a: subprocess.run(["gcc", "-shared", "-fPIC", *a], check=True, cwd=tmp_path)
    run("stub.c", "-o", "libcudart.so.13", "-Wl,-soname,libcudart.so.13")
    run("mod.c", "-o", "mod.so", "-L.", "-Wl,--no-as-needed", "-l:libcudart.so.13")
    core = member(WHEEL, r"hmoe/_native/cpu_core\..*\.so")
    rep = vw.verify(rewrite(Path(WHEEL), tmp_path / Path(WHEEL).name, {core: (tmp_path / "mod.so").read_bytes()}))
    assert fails(rep, "ELF deps", "cpu_core", "FORBIDDEN: ['libcudart.so.13']")


@needs_wheel
def test_dist_name_follows_variable_and_cuda_version(tmp_path, monkeypatch):
    major = (manifest(WHEEL).get("cuda_version") or "").split(".")[0]
    if not major:
        pytest.skip("CPU-only wheel")
    monkeypatch.setenv("HMOE_DIST_NAME", f"hmoe-cu{major}")
    subprocess.run([sys.executable, str(CI / "set_dist_name.py"), WHEEL, "-w", str(tmp_path)], check=True)
    (out,) = tmp_path.glob("*.whl")
    assert out.name.startswith(f"hmoe_cu{major}-")
    assert f"Name: hmoe-cu{major}\n" in zipfile.ZipFile(out).read(member(out, r"[^/]+\.dist-info/METADATA")).decode()
    rep = vw.verify(out)
    assert not fails(rep, "RECORD hashes") and not fails(rep, "dist name")
    monkeypatch.setenv("HMOE_DIST_NAME", f"hmoe-cu{int(major) - 1}")
    r = subprocess.run([sys.executable, str(CI / "set_dist_name.py"), WHEEL, "-w", str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "refusing" in r.stderr


# ---- synthetic inputs (no wheel needed) ---------------------------------------------------------


def fake_wheel(path: Path, cuda_version) -> Path:
    files = {"hmoe/__init__.py": b"", "hmoe/build_info.json": json.dumps({"cuda_version": cuda_version}).encode(),
             "hmoe-0.1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: hmoe\nVersion: 0.1.0\n",
             "hmoe-0.1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nTag: cp311-cp311-linux_x86_64\n"}
    rec = "".join(f"{n},{_hash(d)},{len(d)}\n" for n, d in files.items()) + "hmoe-0.1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in {**files, "hmoe-0.1.0.dist-info/RECORD": rec.encode()}.items():
            z.writestr(n, d)
    return path


@pytest.mark.parametrize("cuda,requested,expected", [
    ("12.8.93", None, "hmoe_cu12"), ("13.0.88", "auto", "hmoe_cu13"), (None, None, "hmoe"),
    ("13.0.88", "hmoe-cu13", "hmoe_cu13"), ("12.8.93", "hmoe-cu13", SystemExit)])
def test_set_dist_name_on_fake_wheel(tmp_path, cuda, requested, expected):
    src = fake_wheel(tmp_path / "hmoe-0.1.0-cp311-cp311-linux_x86_64.whl", cuda)
    if expected is SystemExit:
        with pytest.raises(SystemExit, match="refusing"):
            sdn.rename(src, tmp_path / "out", requested)
        return
    out = sdn.rename(src, tmp_path / "out", requested)
    assert out.name == f"{expected}-0.1.0-cp311-cp311-linux_x86_64.whl"
    z = zipfile.ZipFile(out)
    assert z.read(f"{expected}-0.1.0.dist-info/METADATA").decode().splitlines()[1] == \
        "Name: " + expected.replace("_", "-")
    record = z.read(f"{expected}-0.1.0.dist-info/RECORD").decode()
    for line in record.splitlines()[:-1]:
        name, digest, _size = line.split(",")
        assert _hash(z.read(name)) == digest


def fatbin(*entries, pad: int = 0) -> bytes:
    body = b""
    for kind, arch, flags, payload in entries:
        payload += b"\0" * (-len(payload) % 8)
        head = struct.pack("<HHIQIIIIIIQQQ", kind, 0x101, 64, len(payload), 0, 0, 0x10008, arch, 0, 0,
                           flags, 0, 0)
        body += head + payload
    return struct.pack("<IHHQ", vw.FATBIN_MAGIC, 1, 16, len(body)) + body + b"\0" * pad


def test_fatbin_reader_on_synthetic_containers():
    sec = fatbin((2, 80, 0x11, b"x" * 5), (1, 90, 0x8011, b"ptx"), pad=8) + \
        fatbin((2, 90, 0x100011, b"y"), (2, 100, 0x200011, b"z"), (1, 90, 0x108011, b""))
    got = [(e["kind"], e["target"]) for e in vw.fatbin_entries(sec)]
    assert got == [("sass", "80"), ("ptx", "90"), ("sass", "90a"), ("sass", "100f"), ("ptx", "90a")]


def test_isa_rules_follow_cpu_json_level_order():
    from hmoe import _arch  # the installed package's arch/cpu.json

    cpu = _arch.load("cpu")
    rules = {lv: dict(r) for lv, r in vw.isa_rules(cpu, "x86_64").items()}
    order = [lv["name"] for lv in cpu["processors"]["x86_64"]["levels"]]
    assert order[0] == "generic" and rules[order[-1]] == {}
    assert rules["generic"]["avx"] == "avx2" and rules["generic"]["amx"] == "amx"
    assert "avx" not in rules["avx2"] and rules["avx2"]["avx512"] == "avx512"
    assert set(rules["avx512"]) == {"avx512_bf16", "amx"} and set(rules["avx512_bf16"]) == {"amx"}


def tiny_elf(sections: dict) -> bytes:
    """A 64-bit little-endian x86-64 ELF file that holds only these sections: what Elf reads."""
    strtab = b"\0" + b"".join(n.encode() + b"\0" for n in [".shstrtab", *sections])
    data, heads = b"", [bytes(64)]
    for i, (name, blob) in enumerate([(".shstrtab", strtab), *sections.items()]):
        name_at = strtab.index(b"\0" + name.encode() + b"\0") + 1
        heads.append(struct.pack("<IIQQQQIIQQ", name_at, 3 if i == 0 else 1, 0, 0, 64 + len(data), len(blob),
                                 0, 0, 1, 0))
        data += blob
    head = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, 64 + len(data), 0, 64,
                                                           0, 0, 64, len(heads), 1)
    return head + data + b"".join(heads)


def family_modules(tmp_path, gpu: dict, sass_flags=None) -> tuple[dict, dict]:
    """(manifest, modules) of a build of every family and op of `gpu` (arch/gpu.json) as CMake would
    write them, each family's module a tiny ELF whose fatbin holds exactly its targets; sass_flags
    (family -> flags) replaces the entry flags of a family's SASS (0x100000 marks an "a" target)."""
    man = {"cuda_version": "13.0.88", "cuda_runtime": "static", "cuda_kernels": {}}
    modules = {}
    for family, spec in gpu["kernel_families"].items():
        sass, ptx = vw.expected_gpu(gpu, family)
        module = f"hmoe._native.{family}"
        for op in spec["ops"]:
            man["cuda_kernels"][f"{op}/{family}"] = {"op": op, "family": family, "module": module,
                                                     "sass": sorted(sass), "ptx": sorted(ptx)}
        flags = lambda t: (sass_flags or {}).get(family, 0x100000 if t.endswith("a") else 0)  # noqa: E731
        entries = [(2, int(t.rstrip("af")), flags(t), b"sass") for t in sorted(sass)] + \
            [(1, int(t), 0x8000, b"ptx") for t in sorted(ptx)]
        path = tmp_path / f"{family}.so"
        path.write_bytes(tiny_elf({".nv_fatbin": fatbin(*entries)}))
        modules[module] = path
    return man, modules


def test_sm90a_family_is_checked_against_gpu_json(tmp_path):
    # arch/gpu.json's arch-specific family (sm90a: sm_90a SASS alone, no PTX) against its module's fatbin.
    from hmoe import _arch  # the installed package's arch/gpu.json

    gpu = _arch.load("gpu")
    assert vw.expected_gpu(gpu, "sm90a") == ({"90a"}, set())
    if not gpu["kernel_families"]["sm90a"]["ops"]:
        pytest.skip("the sm90a family has no ops in this arch/gpu.json")
    man, modules = family_modules(tmp_path, gpu)
    rep = vw.Report()
    vw.check_cuda(rep, man, gpu, modules, cpu_only=False, arch_override=False)
    assert rep.failed == 0, rep.rows
    assert any(r[1] == "fatbin" and r[2] == "sm90a" and "exact CC only: ['90a']" in r[3] for r in rep.rows)
    # The same module with plain sm_90 SASS (an sm90a build without the "a"): a different target.
    man, modules = family_modules(tmp_path, gpu, sass_flags={"sm90a": 0})
    rep = vw.Report()
    vw.check_cuda(rep, man, gpu, modules, cpu_only=False, arch_override=False)
    assert fails(rep, "fatbin", "sm90a", "missing sm_90a") and fails(rep, "fatbin", "sm90a", "unexpected sm_90")
    # A wheel whose build left the family out (manifest and module): arch/gpu.json still promises it.
    man, modules = family_modules(tmp_path, gpu)
    man["cuda_kernels"] = {k: e for k, e in man["cuda_kernels"].items() if e["family"] != "sm90a"}
    del modules["hmoe._native.sm90a"]
    rep = vw.Report()
    vw.check_cuda(rep, man, gpu, modules, cpu_only=False, arch_override=False)
    lost = [f"{op}/sm90a" for op in gpu["kernel_families"]["sm90a"]["ops"]]
    assert [r[2] for r in rep.rows if r[0] == "FAIL"] == lost
    assert fails(rep, "cuda vs gpu.json", lost[0], "not in the wheel")
