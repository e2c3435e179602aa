"""`python -m hmoe.compat check`: exit status 0 ok, 1 problems, 2 the check could not run (also when
hmoe.compat itself does not import: then --json still prints a JSON error document)."""
import sys

try:
    from . import main
except BaseException as e:  # noqa: BLE001 - a broken installation must still answer
    if isinstance(e, KeyboardInterrupt):
        raise
    what = f"hmoe.compat does not import: {type(e).__name__}: {e}"
    print(what, file=sys.stderr)
    if "--json" in sys.argv and sys.stdout is not None:
        import json

        try:
            sys.stdout.write(json.dumps({"schema_version": 1, "status": "error", "exit_code": 2, "error": what,
                                         "problems": [{"severity": "error", "what": what,
                                                       "fix": "reinstall hmoe (pip install --force-reinstall "
                                                              "--no-deps hmoe)"}]}) + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
    sys.exit(2)

if __name__ == "__main__":
    main()
