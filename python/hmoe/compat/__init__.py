"""hmoe.compat: what was found, what this installation contains, what each device will run and
why, and how to fix what is wrong. report() for programs; `python -m hmoe.compat check` for people."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .report import SCHEMA_VERSION, backend_states, expected_signatures, report
from .selftest import SELFTESTS

__all__ = ["SCHEMA_VERSION", "SELFTESTS",
           "backend_states", "check", "expected_signatures", "main", "report"]


def _cc_arg(text: str) -> str:
    from ..hardware.gpu import parse_cc

    try:
        a, b = parse_cc(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return f"{a}.{b}"


def _shape_arg(text: str) -> tuple[int, int, int, int]:
    shape, _, page = text.partition(":")
    parts = shape.lower().split("x")
    try:
        values = [int(v) for v in parts] + [int(page) if page else 64]
    except ValueError:
        values = []
    if len(values) != 4 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (write it like 1x32768x128 or 64x4096x16:32)")
    return tuple(values)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hmoe.compat",
                                description="Diagnose hmoe on this machine (or on simulated hardware).")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="report hardware, build, selected variants and problems",
                       description="Exit status: 0 every device has a usable variant, 1 something "
                                   "is unusable or broken, 2 the check itself could not run.")
    c.add_argument("--json", action="store_true", help="print the report as JSON (see schema.json)")
    c.add_argument("--simulate-gpu", metavar="CC", action="append", type=_cc_arg, default=[],
                   help="select for a GPU of this compute capability (8.6, 9.0, 10.0, ...) instead "
                        "of this machine's; repeatable")
    c.add_argument("--simulate-cpu", metavar="ISA", default=None,
                   help="select for a CPU with exactly this ISA level (generic, avx2, ...)")
    c.add_argument("--mla-shape", metavar="BxSxH[:PAGE]", action="append", type=_shape_arg, default=[],
                   help="show the plan mla_decode follows for this shape (batch x sequence length x heads, "
                        "page size default 64) on each CUDA device; repeatable")
    c.add_argument("--model", metavar="PATH", default=None,
                   help="a DeepSeek-V2/V3 checkpoint directory (its config.json is enough): the memory "
                        "hmoe.nn.load_model would need for it in each CPU-experts format, against this host's "
                        "available memory and each GPU's free memory (counted in a child process; needs transformers)")
    c.add_argument("--selftest", action="store_true",
                   help="run each selected variant once on small random inputs against a reference")
    c.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the text report: auto (default) when stdout is a terminal and NO_COLOR is unset")
    return p


_REINSTALL = "reinstall hmoe (pip install --force-reinstall --no-deps hmoe) and report the error if it stays"


def _error_document(what: str, fix: str = _REINSTALL) -> str:
    """What --json prints when the check itself could not run (exit status 2)."""
    return json.dumps({"schema_version": SCHEMA_VERSION, "status": "error", "exit_code": 2, "error": what,
                       "problems": [{"severity": "error", "what": what, "fix": fix}]}, indent=2) + "\n"


def _write(out, text: str) -> bool:
    """Writes text to out; False (said on stderr) when stdout is closed or its reader went away."""
    if out is None:  # the process started with stdout closed
        print("hmoe.compat check: stdout is closed, the report has nowhere to go", file=sys.stderr)
        return False
    try:
        out.write(text)
        out.flush()
        return True
    except (BrokenPipeError, OSError, ValueError) as e:
        try:  # Python would complain again at exit when it flushes stdout
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        print(f"hmoe.compat check: could not write the report ({type(e).__name__}: {e})", file=sys.stderr)
        return False


def check(argv=None, *, stdout=None) -> int:
    """Runs `check` with argv (default sys.argv[1:] without the command) and returns the exit
    status: 0 all devices usable, 1 problems, 2 the check could not run (bad arguments, an error of
    the check itself, or stdout closed). With --json, stdout receives JSON on every path that can
    write: the report, or {schema_version, status "error", exit_code 2, error, problems}."""
    out = stdout if stdout is not None else sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["check"] + argv
    as_json = "--json" in argv
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage or the error on stderr
        if e.code == 0:
            return 0
        if as_json:
            _write(out, _error_document(f"bad arguments: {' '.join(argv[1:])}",
                                        "see python -m hmoe.compat check --help"))
        return 2
    if args.simulate_cpu is not None:
        from ..hardware import cpu as _cpu

        known = [lv["name"] for lv in _cpu.levels()]
        if args.simulate_cpu not in known:
            what = (f"--simulate-cpu {args.simulate_cpu!r} is not an ISA level of this processor "
                    f"({_cpu.processor()}); known: {', '.join(known)}")
            print(f"hmoe.compat check: {what}", file=sys.stderr)
            if as_json:
                _write(out, _error_document(what, f"pick one of: {', '.join(known)}"))
            return 2
    try:
        rep = report(simulate_gpu=args.simulate_gpu, simulate_cpu=args.simulate_cpu,
                     selftest=args.selftest, mla_shapes=args.mla_shape, model=args.model)
        if args.json:
            text = json.dumps(rep, indent=2, default=str) + "\n"
        else:
            from .render import render

            colour = args.color == "always" or (args.color == "auto" and not os.environ.get("NO_COLOR")
                                                and hasattr(out, "isatty") and out.isatty())
            text = render(rep, colour=colour)
        code = rep["exit_code"]
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the check itself failed (its package data is corrupt, a bug): exit 2
        import traceback

        what = f"hmoe.compat check could not run: {type(e).__name__}: {e}"
        print(what, file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        text, code = (_error_document(what) if args.json else ""), 2
    if text and not _write(out, text):
        return 2
    return code


def main() -> None:
    sys.exit(check())
