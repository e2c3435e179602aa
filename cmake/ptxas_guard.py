"""The CUDA compile launcher of hmoe's build: runs the compile it is given and fails it when ptxas
reports that it made a kernel slower than written, as when it serialises the kernel's wgmma or
makes it wait for a group in flight.

ptxas prints these as "info" lines, not warnings, and the build succeeds: a kernel built so runs,
passes every test and is slower by up to 1.7x (docs/perf/prefill.md). Flagged:
  - every "(C75..) Potential Performance Loss: ..." note, e.g. "wgmma.mma_async instructions are
    serialized due to ..." (C7510-C7518),
  - "(C7517) warpgroup.wait is injected ...": a wait for every group in flight before a register use.
"(C7519) warpgroup.arrive is injected" (a fence) is allowed.

    python ptxas_guard.py COMPILER ARGS...    (CMake: the CUDA_COMPILER_LAUNCHER of the CUDA modules)

HMOE_PTXAS_GUARD=warn in the build's environment prints the same report and lets the compile
through: for lab builds that measure such a variant, never for a build that ships.
"""
import os
import re
import shutil
import subprocess
import sys

_FLAGGED = re.compile(r"\((C75\d\d)\)\s*(Potential Performance Loss:.*|warpgroup\.wait is injected.*)")
_FUNCTION = re.compile(r"in (?:the )?function '([^']+)'")


def flagged(text):
    """The (code, message) of each ptxas note in `text` that the guard fails a compile for."""
    return [(m.group(1), m.group(2).strip()) for m in _FLAGGED.finditer(text)]


def _demangled(names):
    """`names` through c++filt where it is installed, else as they are."""
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return names
    try:
        p = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return names
    out = p.stdout.splitlines()
    return out if p.returncode == 0 and len(out) == len(names) else names


def report(notes, source):
    lines = [f"hmoe: ptxas made kernels slower than written, compiling {source}:"]
    found = [_FUNCTION.search(msg) for _, msg in notes]
    names = iter(_demangled([m.group(1) for m in found if m]))
    for (code, msg), fn in zip(notes, found):
        what = _FUNCTION.sub("", msg).strip().rstrip(".")
        lines.append(f"  {code}: {what}" + (f"\n         in {next(names)}" if fn else ""))
    lines.append("  The kernel would run correct and slow. Usual causes of serialised wgmma: registers of a group "
                 "in flight read or written by other instructions, on a divergent path, or across a loop's back edge "
                 "(docs/perf/prefill.md, docs/perf/mla_decode.md). HMOE_PTXAS_GUARD=warn builds it anyway "
                 "(lab builds only).")
    return "\n".join(lines)


def _arg_after(args, flag):
    for i, a in enumerate(args[:-1]):
        if a == flag:
            return args[i + 1]
    return None


def main(argv):
    if not argv:
        print("usage: python ptxas_guard.py COMPILER ARGS...", file=sys.stderr)
        return 2
    p = subprocess.run(argv, capture_output=True, text=True, errors="replace")
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    if p.returncode != 0:
        return p.returncode
    notes = flagged(p.stdout + p.stderr)
    if not notes:
        return 0
    source = next((a for a in reversed(argv) if a.endswith(".cu")), "a CUDA source")
    warn_only = os.environ.get("HMOE_PTXAS_GUARD", "").strip().lower() == "warn"
    print(report(notes, source) + ("\n  (HMOE_PTXAS_GUARD=warn: built anyway)" if warn_only else ""), file=sys.stderr)
    if warn_only:
        return 0
    out = _arg_after(argv, "-o")
    if out and os.path.exists(out):
        os.remove(out)  # no object of a failed compile for the next build to pick up
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
