# Benchmarks behind `python -m hmoe.bench <subcommand>`; the registry of subcommands is in __main__.py.
"""hmoe benchmarks. Run ``python -m hmoe.bench`` to list the subcommands."""
