#!/usr/bin/env python3
"""Checks an hmoe wheel without a GPU: contents vs manifest, fatbin SASS/PTX vs arch/gpu.json, ISA leaks, deps, size."""
from __future__ import annotations

import argparse
import email.parser
import json
import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ci/, for set_dist_name
from set_dist_name import cuda_major, record_hash  # noqa: E402

MIB = 1 << 20
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
# DT_NEEDED entries a wheel must never have: the CUDA runtime is linked statically and native
# modules never link torch, so the wheel works with any torch and any CUDA runtime install.
FORBIDDEN_NEEDED = re.compile(r"^lib(cudart|torch|c10)([._-]|$)")

# ---- ELF and fatbin ---------------------------------------------------------------------------


class Elf:
    """The few ELF64 little-endian facts we need: machine, flags, sections, DT_NEEDED."""

    def __init__(self, data: bytes):
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        self.data, self.abi_version = data, data[8]
        (_, self.machine, _, _, _, shoff, self.flags, _, _, _, shentsize, shnum,
         shstrndx) = struct.unpack_from("<HHIQQQIHHHHHH", data, 16)
        raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        names = raw[shstrndx][4] if raw else 0
        self.sections = []  # (name, type, offset, size, link)
        for (nm, typ, _, _, off, size, link, _, _, _) in raw:
            name = data[names + nm:data.index(b"\0", names + nm)].decode(errors="replace")
            self.sections.append((name, typ, off, size, link))

    def section(self, name: str) -> bytes | None:
        for (n, typ, off, size, _) in self.sections:
            if n == name:
                return b"" if typ == 8 else self.data[off:off + size]  # 8 = SHT_NOBITS
        return None

    def needed(self) -> list[str]:
        out = []
        for (_n, _t, off, size, link) in (s for s in self.sections if s[0] == ".dynamic"):
            strs = self.sections[link][2]
            for tag, val in struct.iter_unpack("<qQ", self.data[off:off + size]):
                if tag == 1:  # DT_NEEDED
                    out.append(self.data[strs + val:self.data.index(b"\0", strs + val)].decode())
        return out


FATBIN_MAGIC = 0xBA55ED50
KIND = {1: "ptx", 2: "sass"}
# Entry flag bits, as written by nvcc 13.0's fatbinary (checked against sm_90a/compute_90a/
# sm_100f builds): arch-specific "a" and family "f" targets. An uncompressed cubin confirms it.
FLAG_SUFFIX = ((0x100000, "a"), (0x200000, "f"))
FLAG_COMPRESSED = 0x2000 | 0x8000


def _cubin_info(payload: bytes) -> tuple[int, str, list[str]] | None:
    """(sm, suffix, kernels) of an uncompressed cubin. ELF ABI 7 (CUDA 12) keeps the SM in the low
    byte of e_flags with 0x800 for "a"; ABI 8 (CUDA 13) keeps it in bits 8-15 and names the target
    in the .note.nv.tkinfo note ("-arch sm_90a"). Kernels are the .text.<symbol> sections."""
    try:
        cubin = Elf(payload)
    except (ValueError, struct.error):
        return None
    kernels = [n[6:] for (n, *_r) in cubin.sections if n.startswith(".text.")]
    if cubin.abi_version <= 7:
        return cubin.flags & 0xFF, "a" if cubin.flags & 0x800 else "", kernels
    m = re.search(rb"-arch sm_(\d+)([af]?)\b", cubin.section(".note.nv.tkinfo") or b"")
    return (cubin.flags >> 8) & 0xFF, (m.group(2).decode() if m else ""), kernels


def fatbin_entries(sec: bytes) -> list[dict]:
    """Every entry of every fatbin container in a .nv_fatbin section: kind, target, kernels."""
    entries, pos = [], 0
    while (pos := sec.find(struct.pack("<I", FATBIN_MAGIC), pos)) >= 0 and pos + 16 <= len(sec):
        _magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", sec, pos)  # padding in between
        p, end = pos + hsize, pos + hsize + fsize
        while p + 64 <= end:
            kind, _v, ehsize, padded = struct.unpack_from("<HHIQ", sec, p)
            if ehsize < 64:
                raise ValueError(f"corrupt fatbin entry header at {p:#x}")
            arch, = struct.unpack_from("<I", sec, p + 28)
            flags, = struct.unpack_from("<Q", sec, p + 40)
            payload = sec[p + ehsize:p + ehsize + padded]
            suffix = "".join(s for bit, s in FLAG_SUFFIX if flags & bit)
            kernels = None
            got = _cubin_info(payload) if kind == 2 and payload[:4] == b"\x7fELF" else None
            if got:
                if got[0] != arch:
                    raise ValueError(f"fatbin entry says sm_{arch} but its cubin is sm_{got[0]}")
                suffix, kernels = suffix or got[1], got[2]
            elif kind == 1 and not flags & FLAG_COMPRESSED:
                m = re.search(rb"\.target\s+sm_\d+([af]?)", payload)
                suffix = suffix or (m.group(1).decode() if m else "")
            entries.append({"kind": KIND.get(kind, f"kind{kind}"), "target": f"{arch}{suffix}",
                            "compressed": bool(flags & FLAG_COMPRESSED), "kernels": kernels})
            p += ehsize + padded
        pos = end
    return entries


# ---- CPU instruction classes ------------------------------------------------------------------
# Each class: the compile flag that enables it, and how objdump shows it (mnemonic regex, operand
# regex). A module may only contain classes its flags enable; the level that first enables a
# class in arch/cpu.json is named in the report. Heuristic by nature: it spots what compilers
# emit (registers, EVEX decorations, EVEX-only mnemonics), not every possible encoding.
_VMX = "err|erw|mcall|mlaunch|mresume|mxoff|mxon|mread|mwrite|mptrld|mptrst|mclear|mfunc|mrun|mload|msave|mmcall"
_EVEX_ONLY = (
    r"pternlog[dq]|perm[it]2(b|w|d|q|ps|pd)|perm[bw]|p?compress\w+|p?expand\w+"
    r"|pmov(s|us)?(qb|qw|qd|db|dw|wb)|pmovm2[bwdq]|pmov[bwdq]2m|pconflict[dq]|plzcnt[dq]"
    r"|rndscale\w+|reduce\w+|range\w+|fixupimm\w+|getexp\w+|getmant\w+|scalef\w+|rcp14\w+"
    r"|rsqrt14\w+|align[dq]|dbpsadbw|blendm\w+|pblendm\w+|ptestn?m[bwdq]|p?scatter\w+"
    r"|gatherpf\w+|scatterpf\w+|broadcast[fi](32x[248]|64x[24])|extract[fi](32x[48]|64x[24])"
    r"|insert[fi](32x[48]|64x[24])|shuf[fi](32x4|64x2)|movdq[au](8|16|32|64)|p(and|andn|or|xor)[dq]"
    r"|pabsq|p(max|min)[su]q|pmullq|pmadd52[lh]uq|pro[lr]v?[dq]|psraq|psravq|ps(ll|rl|ra)vw"
    r"|pcmpu?[bwdq]|pcmp(eq|lt|le|neq|nlt|nle|gt|ge|false|true)u[bwdq]|pcmp(lt|le|neq|nlt|nle)[bwdq]"
    r"|cvt(u?qq2p[sd]|t?p[sd]2u?qq|t?p[sd]2udq|udq2p[sd]|usi2s[sd]|t?s[sd]2usi)|pmultishiftqb")
CLASSES = {
    "x86_64": [
        ("avx", "-mavx", rf"^v(?!({_VMX})$)", r"%ymm"),
        ("avx2", "-mavx2", r"^v(pbroadcast[bwdq]|broadcasti128|perm2i128|perm[dq]|permps|inserti128"
                           r"|extracti128|pblendd|p?gather\w+|pmaskmov[dq]|ps[lr]lv[dq]|psravd)$", None),
        ("fma", "-mfma", r"^vfn?m(add|sub|addsub|subadd)(132|213|231)", None),
        ("f16c", "-mf16c", r"^vcvt(ph2ps|ps2ph)$", None),
        ("bmi2", "-mbmi2", r"^(shlx|shrx|sarx|rorx|pdep|pext|mulx|bzhi)$", None),
        ("avx512", "-mavx512f",
         rf"^(\{{evex\}}|k(add|and|andn|mov|not|or|ortest|shiftl|shiftr|test|xnor|xor|unpck)[bwdq]{{1,2}}$|v({_EVEX_ONLY})$)",
         r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|\{(%k|z\}|1to|r[nduz]-sae|sae)"),
        ("avx512_bf16", "-mavx512bf16", r"^v(dpbf16ps|cvtne2ps2bf16|cvtneps2bf16)$", None),
        ("amx", "-mamx-tile", r"^(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilezero"
                              r"|tilerelease|tdp\w+)$", r"%tmm"),
    ],
    "aarch64": [
        ("sve", "+sve", r"^(ptrue|pfalse|whilel[eost]|cnt[bhwd]|inc[bhwd]|dec[bhwd])$",
         r"\bz([0-9]|[12][0-9]|3[01])\.[bhsdq]\b|\bp([0-9]|1[0-5])/[zm]"),
        ("sme", "+sme", r"^(smstart|smstop)$", r"\bza\d*\b"),
        ("dotprod", "+dotprod", r"^[su]dot$", None),
        ("i8mm", "+i8mm", r"^(smmla|ummla|usmmla|usdot|sudot)$", None),
        ("bf16", "+bf16", r"^(bfdot|bfmmla|bfmlal[bt]|bfcvt\w*)$", None),
    ],
}
_COMMENT = {"x86_64": r"\s#", "aarch64": r"\s//"}  # Arm immediates start with "#" too
_PREFIXES = {"lock", "rep", "repz", "repe", "repnz", "repne", "notrack", "bnd", "data16", "addr32",
             "cs", "ds", "es", "ss", "fs", "gs", "{vex}", "{vex3}"}


def _enabled(token: str, flags: list[str]) -> bool:
    # "-mavx" must not match "-mavx2"; Arm extensions ride inside -march=...+sve strings.
    return any(f == token or (token.startswith("+") and token in f) for f in flags)


def isa_rules(cpu_json: dict, processor: str) -> dict[str, list[tuple[str, str]]]:
    """level -> [(class, level that introduces it)] the level's module must not contain."""
    levels = cpu_json["processors"][processor]["levels"]
    rules = {}
    for lv in levels:
        rules[lv["name"]] = [
            (cls, next((h["name"] for h in levels if _enabled(tok, h["flags"])), "no level"))
            for cls, tok, _m, _o in CLASSES[processor] if not _enabled(tok, lv["flags"])]
    return rules


def scan_isa(path: Path, processor: str) -> tuple[int, dict[str, list[str]]]:
    """(instruction count, class -> example lines) from objdump's disassembly."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True,
                         text=True, errors="replace")
    if out.returncode != 0 or "file format" not in out.stdout:
        raise RuntimeError(f"objdump failed on {path.name}: {out.stderr.strip()[:200]}")
    compiled = [(c, re.compile(m), re.compile(o) if o else None) for c, _t, m, o in CLASSES[processor]]
    found: dict[str, list[str]] = {}
    count, func = 0, "?"
    for line in out.stdout.splitlines():
        if line.endswith(">:"):
            func = line[line.find("<") + 1:-2]
            continue
        head, sep, body = line.partition(":\t")
        if not sep or not head.strip() or " " in head.strip() or not body.strip():
            continue
        words = re.sub(r"<[^>]*>|" + _COMMENT[processor] + ".*$", "", body).split() or ["?"]
        while len(words) > 1 and words[0] in _PREFIXES:
            words = words[1:]
        count += 1
        mnem, ops = words[0], " ".join(words[1:])
        for cls, mre, ore in compiled:
            if mre.search(mnem) or (ore and ore.search(ops)):
                ex = found.setdefault(cls, [])
                if len(ex) < 3:
                    ex.append(f"{mnem} {ops} in {func[:60]}")
    return count, found


class Report:
    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, ok: bool | None, check: str, subject: str, detail: str) -> None:
        self.rows.append(({True: "ok", False: "FAIL", None: "note"}[ok], check, subject, detail))

    @property
    def failed(self) -> int:
        return sum(r[0] == "FAIL" for r in self.rows)

    def print(self, title: str) -> None:
        print(title)
        w = [max(len(r[i]) for r in self.rows + [("RESULT", "CHECK", "SUBJECT", "")]) for i in range(3)]
        for r in [("RESULT", "CHECK", "SUBJECT", "DETAIL")] + self.rows:
            print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}")
        print(f"{len(self.rows)} checks, {self.failed} failed")


def expected_gpu(gpu: dict, family: str) -> tuple[set[str], set[str]] | None:
    """(SASS, PTX) targets arch/gpu.json promises for a kernel family."""
    spec = gpu.get("kernel_families", {}).get(family)
    if spec is None:
        return None
    sass = [t["sm"] for t in gpu["targets"]] if spec["sass"] == "targets" else [spec["sass"].split(":")[1]]
    return set(sass), (set(gpu["ptx_targets"]) if spec.get("ptx") else set())


def check_package(rep: Report, zf: zipfile.ZipFile) -> tuple[str, str] | None:
    """RECORD hashes (what we check is what pip installs), METADATA; returns (name, version)."""
    names = zf.namelist()
    dist_info = sorted({n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")})
    if len(dist_info) != 1:
        return rep.add(False, "layout", "dist-info", f"expected one .dist-info folder: {dist_info}")
    di = dist_info[0]
    bad = []
    for line in zf.read(f"{di}/RECORD").decode().splitlines():
        path, digest = (line.rsplit(",", 2) + ["", ""])[:2]
        if digest.startswith("sha256="):
            bad += [path] if record_hash(zf.read(path)) != digest else []
    rep.add(not bad, "RECORD hashes", di, "all match" if not bad else f"mismatch: {bad[:3]}")
    meta = email.parser.Parser().parsestr(zf.read(f"{di}/METADATA").decode())
    for req in meta.get_all("Requires-Dist") or []:
        if re.match(r"\s*torch\s*([\[(<>=!~;]|$)", req, re.I):
            pinned = re.search(r"==|~=|<|\+", req.split(";")[0])
            why = ("pins a torch version" if pinned else "ok, optional extra" if "extra" in req
                   else "unconditional torch dependency")
            rep.add(not pinned and "extra" in req, "Requires-Dist", "torch", f"{req!r}: {why}")
    missing = [n for n in ("hmoe/__init__.py", "hmoe/build_info.json", "hmoe/arch/cpu.json",
                           "hmoe/arch/gpu.json") if n not in names]
    rep.add(not missing, "files", "hmoe/", f"missing {missing}" if missing
            else "build_info.json, arch/cpu.json, arch/gpu.json present")
    return None if missing else (meta["Name"], meta["Version"])


def check_elf(rep: Report, modules: dict[str, Path], processor: str) -> None:
    """Every native file: the wheel's machine, no forbidden DT_NEEDED, no bundled cudart/torch."""
    for mod, path in modules.items():
        elf = Elf(path.read_bytes())
        needed = elf.needed()
        bad = [d for d in needed if FORBIDDEN_NEEDED.match(d)]
        bad += [f"bundles {path.name}"] if FORBIDDEN_NEEDED.match(path.name) else []
        machine = ELF_MACHINES.get(elf.machine, str(elf.machine))
        rep.add(not bad and machine == processor, "ELF deps", mod.rsplit(".", 1)[-1],
                f"{machine}; needs {', '.join(needed)}" + (f"; FORBIDDEN: {bad}" if bad else ""))


def check_cpu(rep: Report, man: dict, cpu_json: dict, modules: dict[str, Path]) -> None:
    """One module per arch/cpu.json level and op, each free of the classes higher levels add."""
    processor = man["processor"]
    levels = {lv["name"]: lv["flags"] for lv in cpu_json["processors"][processor]["levels"]}
    rules = isa_rules(cpu_json, processor)
    by_op: dict[str, set[str]] = {}
    for name, e in man["cpu_modules"].items():
        by_op.setdefault(e["op"], set()).add(e["isa"])
        if levels.get(e["isa"]) != e["flags"]:
            rep.add(False, "cpu flags", name, f"manifest {e['flags']} != arch/cpu.json {levels.get(e['isa'])}")
        if e["module"] not in modules:
            rep.add(False, "cpu module", e["module"], "listed in the manifest, not in the wheel")
    for op, isas in by_op.items():
        lack = [lv for lv in levels if lv not in isas]
        rep.add(not lack, "cpu levels", op, f"{len(isas)}/{len(levels)} levels of arch/cpu.json"
                + (f"; lacks {lack}" if lack else ""))
    isa_of = {e["module"]: e["isa"] for e in man["cpu_modules"].values()}
    for mod, path in modules.items():
        if not mod.startswith("hmoe."):
            continue
        level = isa_of.get(mod, next(iter(levels)))  # detection and CUDA host code: baseline
        try:
            count, found = scan_isa(path, processor)
        except RuntimeError as e:
            rep.add(False, "cpu isa", mod.rsplit(".", 1)[-1], str(e))
            continue
        leaks = [f"{cls} (a {intro} instruction: {found[cls][0]})" for cls, intro in rules[level]
                 if cls in found]
        clean = (f"none of: {', '.join(c for c, _ in rules[level])}" if rules[level]
                 else "highest level, nothing excluded")
        rep.add(not leaks, "cpu isa", mod.rsplit(".", 1)[-1],
                f"level {level}: " + (f"LEAKS {'; '.join(leaks)}" if leaks else f"{count} insns, {clean}"))


def check_cuda(rep: Report, man: dict, gpu_json: dict, modules: dict[str, Path], cpu_only: bool,
               arch_override: bool) -> None:
    """Manifest vs arch/gpu.json, and manifest vs the fatbins inside the modules."""
    kernels = man.get("cuda_kernels") or {}
    if not kernels:
        return rep.add(cpu_only, "cuda", "cuda_kernels", "wheel has no CUDA kernels"
                       + ("" if cpu_only else " (pass --cpu-only for a CPU-only build)"))
    rep.add(man.get("cuda_runtime") == "static", "cuda runtime", f"CUDA {man.get('cuda_version')}",
            f"cuda_runtime = {man.get('cuda_runtime')!r} (must be static)")
    per_module: dict[str, tuple[set, set]] = {}
    for kname, e in sorted(kernels.items()):
        exp = expected_gpu(gpu_json, e["family"])
        if exp is None:
            rep.add(False, "cuda family", kname, f"family {e['family']!r} is not in arch/gpu.json")
        elif not arch_override:
            lack = sorted(exp[0] - set(e["sass"])) + [f"ptx {p}" for p in sorted(exp[1] - set(e["ptx"]))]
            rep.add(not lack, "cuda vs gpu.json", kname, f"lacks {lack}" if lack
                    else "every arch/gpu.json target")
        s, p = per_module.setdefault(e["module"], (set(), set()))
        s.update(e["sass"]), p.update(e["ptx"])
    built = {(e["op"], e["family"]) for e in kernels.values()}
    for family, spec in sorted(gpu_json.get("kernel_families", {}).items()):
        for op in sorted(set(spec.get("ops", {})) - {o for o, f in built if f == family}):
            rep.add(False, "cuda vs gpu.json", f"{op}/{family}", "an op of arch/gpu.json's family, not in the wheel")
    for mod, (want_sass, want_ptx) in sorted(per_module.items()):
        short = mod.rsplit(".", 1)[-1]
        if mod not in modules:
            rep.add(False, "fatbin", short, "module listed in the manifest, not in the wheel")
            continue
        try:
            entries = fatbin_entries(Elf(modules[mod].read_bytes()).section(".nv_fatbin") or b"")
        except (ValueError, struct.error) as e:
            rep.add(False, "fatbin", short, f"unreadable .nv_fatbin: {e}")
            continue
        sass = {x["target"] for x in entries if x["kind"] == "sass"}
        ptx = {x["target"] for x in entries if x["kind"] == "ptx"}
        diff = ([f"missing sm_{t}" for t in sorted(want_sass - sass)]
                + [f"missing compute_{t}" for t in sorted(want_ptx - ptx)]
                + [f"unexpected sm_{t}" for t in sorted(sass - want_sass)]
                + [f"unexpected compute_{t}" for t in sorted(ptx - want_ptx)])
        arch_specific = sorted(t for t in sass if t[-1] in "af")
        rep.add(not diff and bool(entries), "fatbin", short,
                f"SASS {' '.join('sm_' + t for t in sorted(sass)) or '-'}; "
                f"PTX {' '.join('compute_' + t for t in sorted(ptx)) or '-'}"
                + (f"; arch-specific, exact CC only: {arch_specific}" if arch_specific else "")
                + (f"; MISMATCH {diff}" if diff else ""))
        readable = {x["target"] for x in entries if x["kind"] == "sass" and x["kernels"] is not None}
        for kname, e in sorted(kernels.items()):
            # Kernel symbols need not contain the op name: a note, never a failure.
            has = {x["target"] for x in entries if x["kind"] == "sass" and x["kernels"] is not None
                   and any(e["op"] in k for k in x["kernels"])}
            if e["module"] == mod and (absent := sorted(readable - has)):
                rep.add(None, "kernel symbols", kname, f"no kernel named *{e['op']}* for sm_{absent}")


def verify(wheel: Path, max_mib: float = 100, cpu_only: bool = False, arch_override: bool = False) -> Report:
    rep = Report()
    size = wheel.stat().st_size
    rep.add(size < max_mib * MIB, "size", wheel.name, f"{size / MIB:.2f} MiB (limit {max_mib:g} MiB)")
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory(prefix="hmoe-verify-") as tmp:
        pkg = check_package(rep, zf)
        if pkg is None:
            return rep
        dist, version = pkg
        text = zf.read("hmoe/build_info.json").decode()
        man = json.loads(text)
        rep.add(man["version"] == version, "version", dist, f"METADATA {version}, manifest {man['version']}")
        native = re.findall(r"-m(?:arch|cpu|tune)=native|-xHost", text)
        rep.add(not native, "flags", "build_info.json", f"found {native}" if native else "no -march=native")
        m = re.fullmatch(r"hmoe-cu(\d+)", dist)
        if m:
            rep.add(m.group(1) == cuda_major(zf), "dist name", dist,
                    f"built with CUDA {man.get('cuda_version')}")
        modules: dict[str, Path] = {}  # "hmoe._native.x" (or the path, outside hmoe/) -> file
        for n in zf.namelist():
            if re.search(r"\.so(\.\d+)*$", n):
                key = n.split(".")[0].replace("/", ".") if n.startswith("hmoe/") else n
                modules[key] = Path(zf.extract(n, tmp))
        check_elf(rep, modules, man["processor"])
        check_cpu(rep, man, json.loads(zf.read("hmoe/arch/cpu.json")), modules)
        check_cuda(rep, man, json.loads(zf.read("hmoe/arch/gpu.json")), modules, cpu_only, arch_override)
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--max-mib", type=float, default=100, help="size limit (default 100 MiB)")
    ap.add_argument("--cpu-only", action="store_true", help="accept a wheel without CUDA kernels")
    ap.add_argument("--allow-arch-override", action="store_true",
                    help="do not require every arch/gpu.json target (a HMOE_CUDA_ARCHS build)")
    a = ap.parse_args(argv)
    rep = verify(a.wheel, a.max_mib, a.cpu_only, a.allow_arch_override)
    rep.print(f"hmoe wheel check: {a.wheel.name}")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
