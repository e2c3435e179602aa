"""python -m hmoe.compat check [--json] [--simulate-gpu CC ...] [--simulate-cpu ISA] [--selftest]"""
from . import main

if __name__ == "__main__":
    main()
