"""hmoe.compat: what was found, what this installation contains, what each device will run and
why, and how to fix what is wrong. report() for programs; `python -m hmoe.compat check` for people."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .report import BACKEND_PROBES, SCHEMA_VERSION, backend_states, expected_signatures, report
from .selftest import SELFTESTS

__all__ = ["BACKEND_PROBES", "SCHEMA_VERSION", "SELFTESTS",
           "backend_states", "check", "expected_signatures", "main", "report"]


def _cc_arg(text: str) -> str:
    from ..hardware.gpu import parse_cc

    try:
        a, b = parse_cc(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return f"{a}.{b}"


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
    c.add_argument("--selftest", action="store_true",
                   help="run each selected variant once on small random inputs against a reference")
    c.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    return p


def check(argv=None, *, stdout=None) -> int:
    """Runs `check` with argv (default sys.argv[1:] without the command) and returns the exit
    status: 0 all devices usable, 1 problems, 2 the check could not run."""
    out = stdout or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["check"] + argv
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage error
        return 0 if e.code == 0 else 2
    if args.simulate_cpu is not None:
        from ..hardware import cpu as _cpu

        known = [lv["name"] for lv in _cpu.levels()]
        if args.simulate_cpu not in known:
            print(f"hmoe.compat check: --simulate-cpu {args.simulate_cpu!r} is not an ISA level of "
                  f"this processor ({_cpu.processor()}); known: {', '.join(known)}", file=sys.stderr)
            return 2
    try:
        rep = report(simulate_gpu=args.simulate_gpu, simulate_cpu=args.simulate_cpu,
                     selftest=args.selftest)
        if args.json:
            text = json.dumps(rep, indent=2, default=str) + "\n"
        else:
            from .render import render

            colour = args.color == "always" or (args.color == "auto" and not os.environ.get("NO_COLOR")
                                                and hasattr(out, "isatty") and out.isatty())
            text = render(rep, colour=colour)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the check itself failed: say so, and exit 2
        import traceback

        print(f"hmoe.compat check could not run: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return 2
    out.write(text)
    out.flush()
    return rep["exit_code"]


def main() -> None:
    sys.exit(check())
