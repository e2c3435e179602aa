# Entry point `python -m hmoe.bench <subcommand> [options]`: dispatches to the registered benchmark modules.
from __future__ import annotations

import importlib
import sys

# One place to register a benchmark: name -> (module exposing main(argv, prog) -> int, one-line help).
# Modules are imported only when their subcommand runs, so listing them stays cheap.
SUBCOMMANDS = {
    "e2e": ("hmoe.bench.e2e", "a whole DeepSeek model with hmoe.nn (experts on the CPU) vs transformers' offloading and "
                               "the memory-bandwidth bound"),
    "experts": ("hmoe.bench.experts", "CPU routed experts (CPUExperts, moe_experts_cpu) vs a torch per-expert loop"),
    "mla": ("hmoe.bench.mla", "GPU MLA decode (mla_decode) vs flashinfer fa2/fa3, against copy bandwidth and matmul peak"),
    "prefill": ("hmoe.bench.prefill", "GPU prefill attention (ragged_prefill) vs flashinfer fa2/fa3, against the matmul "
                                       "floor"),
    "overhead": ("hmoe.bench.overhead", "host time per call of every op on tiny shapes (vs flashinfer's run() for MLA)"),
}


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [
        "usage: python -m hmoe.bench <subcommand> [options]",
        "",
        "subcommands:",
        *(f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()),
        "",
        "`python -m hmoe.bench <subcommand> --help` shows a subcommand's options.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name = argv[0]
    if name not in SUBCOMMANDS:
        print(f"hmoe.bench: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return module.main(argv[1:], prog=f"python -m hmoe.bench {name}")


if __name__ == "__main__":
    sys.exit(main())
