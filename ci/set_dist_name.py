#!/usr/bin/env python3
"""Renames an hmoe wheel's distribution (hmoe -> hmoe-cu12 / hmoe-cu13); the import name stays hmoe.

Why a post-build rewrite: [project].name cannot be dynamic (PEP 621), so neither scikit-build-core
nor an env var can change it at build time without editing pyproject.toml; rewriting the built
wheel (dist-info folder, METADATA Name, RECORD, file name) is exact and leaves the tree alone.

    python ci/set_dist_name.py WHEEL -w OUTDIR [--name NAME]

NAME defaults to $HMOE_DIST_NAME; "auto" (or unset) means hmoe-cu<major of the CUDA the wheel was
built with>, or hmoe for a CPU-only wheel. A -cuNN name that disagrees with the wheel's manifest
is refused, so a CUDA-12 build can never be published as hmoe-cu13.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import sys
import zipfile
from pathlib import Path


def escape(name: str) -> str:
    """The wheel file-name form of a distribution name (PEP 427 / binary distribution format)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def cuda_major(zf: zipfile.ZipFile) -> str | None:
    man = json.loads(zf.read("hmoe/build_info.json"))
    return man["cuda_version"].split(".")[0] if man.get("cuda_version") else None


def choose_name(requested: str | None, major: str | None) -> str:
    if not requested or requested == "auto":
        return f"hmoe-cu{major}" if major else "hmoe"
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", requested):
        raise SystemExit(f"set_dist_name: {requested!r} is not a valid distribution name")
    m = re.fullmatch(r"hmoe-cu(\d+)", requested)
    if m and m.group(1) != major:
        raise SystemExit(f"set_dist_name: refusing to call a wheel built with CUDA major {major} "
                         f"{requested!r}; build it with CUDA {m.group(1)} or use hmoe-cu{major}")
    return requested


def record_hash(data: bytes) -> str:
    """A file's hash as a wheel's RECORD writes it."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rename(wheel: Path, outdir: Path, requested: str | None) -> Path:
    parts = wheel.name[:-4].split("-")  # name-version(-build)?-py-abi-plat
    old_esc, version = parts[0], parts[1]
    with zipfile.ZipFile(wheel) as zin:
        new = choose_name(requested, cuda_major(zin))
        new_esc = escape(new)
        old_prefixes = (f"{old_esc}-{version}.dist-info/", f"{old_esc}-{version}.data/")
        out = outdir / ("-".join([new_esc] + parts[1:]) + ".whl")
        if out.resolve() == wheel.resolve():
            raise SystemExit("set_dist_name: output would overwrite the input; use another -w")
        outdir.mkdir(parents=True, exist_ok=True)
        files: list[tuple[zipfile.ZipInfo, bytes]] = []
        record_name = f"{new_esc}-{version}.dist-info/RECORD"
        for info in zin.infolist():
            data = zin.read(info)
            name = info.filename
            for pre in old_prefixes:
                if name.startswith(pre):
                    name = pre.replace(old_esc, new_esc, 1) + name[len(pre):]
            if name == f"{new_esc}-{version}.dist-info/METADATA":
                text = data.decode()
                text, n = re.subn(r"(?m)^Name: .*$", f"Name: {new}", text, count=1)
                if n != 1:
                    raise SystemExit("set_dist_name: METADATA has no Name field")
                data = text.encode()
            if name == record_name:
                continue  # rewritten below, from the final contents
            new_info = zipfile.ZipInfo(name, info.date_time)
            new_info.external_attr, new_info.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            files.append((new_info, data))
    record = "".join(f"{i.filename},{record_hash(d)},{len(d)}\n" for i, d in files) + f"{record_name},,\n"
    rec_info = zipfile.ZipInfo(record_name, files[0][0].date_time if files else (1980, 1, 1, 0, 0, 0))
    rec_info.external_attr, rec_info.compress_type = 0o644 << 16, zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(out, "w") as zout:
        for info, data in files + [(rec_info, record.encode())]:
            zout.writestr(info, data)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", type=Path)
    ap.add_argument("-w", "--wheel-dir", type=Path, required=True, help="where to write the renamed wheel")
    ap.add_argument("--name", default=os.environ.get("HMOE_DIST_NAME"), help="default: $HMOE_DIST_NAME or auto")
    a = ap.parse_args(argv)
    out = rename(a.wheel, a.wheel_dir, a.name)
    print(f"set_dist_name: {a.wheel.name} -> {out.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
