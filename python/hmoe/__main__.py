"""`python -m hmoe`: says which commands hmoe has (the package itself is not a command)."""
import sys

from . import __version__

USAGE = f"""hmoe {__version__}: hybrid MoE kernels with hardware-aware dispatch

commands:
  python -m hmoe.compat check   what this machine runs: GPUs, CPU ISA, every op's variant and why
  python -m hmoe.bench          benchmarks against flashinfer, kt-kernel and torch (lists its subcommands)
"""

if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] not in ("-h", "--help", "help"):
        print(f"python -m hmoe takes no command of its own (got {' '.join(args)!r}); use one of:\n", file=sys.stderr)
        print(USAGE, file=sys.stderr, end="")
        sys.exit(2)
    print(USAGE, end="")
