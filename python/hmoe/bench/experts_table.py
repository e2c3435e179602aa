# The printed table of `python -m hmoe.bench experts`: its columns, how a row's cells are written, and the legend.
from __future__ import annotations

from hmoe.bench._report import table_header

_pct = "{:.0%}".format
_ratio = "{:.2f}x".format
COLUMNS = [  # (title, width, row key, format); the last column takes what is left of the line
    ("shape", 6, "shape", str), ("T", 4, "T", str), ("fmt", 4, "format", str), ("impl", 18, "impl", str),
    ("isa", 11, "isa", str), ("thr", 3, "threads", str), ("reps", 4, "repeats", str),
    ("cold ms", 9, "ms", "{:.3f}".format), ("b2b ms", 9, "b2b_ms", "{:.3f}".format),
    ("MB/call", 7, "bytes_hit_mean", lambda b: f"{b / 1e6:.1f}"), ("GB/s", 6, "gbps", "{:.1f}".format),
    ("%read", 5, "read_frac", _pct), ("b2b%rd", 6, "b2b_read_frac", _pct),
    ("GFLOP/s", 7, "gflops", "{:.0f}".format), ("vs torch", 8, "speedup", _ratio), ("vs kt", 6, "vs_kt", _ratio),
    ("busy", 4, "other_load", _pct), ("err(fp32 ref)", 13, "err_fp64", "{:.1e}".format), ("check", 0, "check", None),
]
CELL_MAX = 110  # a long error message is cut here in the table; the JSON keeps all of it


def check_cell(row: dict) -> str:
    """The last column: the row's error, the peer's "not offered", or hmoe's contract check."""
    if row.get("error"):
        return ("FAIL error: " + row["error"])[:CELL_MAX]
    if row.get("unsupported"):
        return "n/a: " + row["unsupported"]
    c = row.get("check")
    if c is None:
        return ""
    if c["ok"] is None:  # no contract reference to check against (said why)
        return ("n/a: " + c["why"])[:CELL_MAX]
    if c["rel_err"] is None or not c["ok"]:
        err = "nan" if c["rel_err"] is None else f"{c['rel_err']:.1e}"
        return f"FAIL rel_err {err} > {c['tol']:.0e} {c['why']}".rstrip()[:CELL_MAX]
    return f"ok {c['rel_err']:.1e} <= {c['tol']:.0e}"


def _cell(row: dict, key: str, fmt) -> str:
    if fmt is None:
        return check_cell(row)
    return "-" if row.get(key) is None else fmt(row[key])


def format_row(row: dict) -> str:
    return "  ".join(f"{_cell(row, k, f):<{w}}" for _, w, k, f in COLUMNS).rstrip()


def format_header() -> str:
    return table_header(COLUMNS)


def legend(idle_ms: float, flush: bool, peer: bool, rounds: int = 1) -> str:
    evict = "the caches are evicted (a read of 2x the LLC), then " if flush else ""
    kt = ("; kt-kernel takes bf16 activations only, its rows get x rounded to bf16" if peer else "")
    blocks = ("each implementation is timed in its own block of calls (warm-up, cold calls, back-to-back calls), "
              "100 ms idle between blocks;")
    if rounds > 1:
        blocks += (f" all blocks {rounds} times (rounds; kt-kernel's first and last in turn): cold and b2b over "
                   "every round's calls, vs torch and vs kt the medians over the rounds of each round's ratio;")
    return "\n".join([
        f"cold = median time of calls each made after {evict}{idle_ms:g} ms idle (every thread pool asleep, "
        "as after other layers ran);",
        "b2b = median time of the same routed batches called back to back in a tight loop (no eviction, no gap);",
        blocks,
        "MB/call = weight bytes (packed, scales included, in this row's own storage) of the distinct experts a "
        "call hits; GB/s = that / cold time;",
        "%read, b2b%rd = GB/s of the cold, back-to-back time / the read bandwidth: the decode ceiling (the "
        "experts only read their weights);",
        "GFLOP/s = 6*H*I*T*K / cold time (prefill is compute-bound); vs torch, vs kt = the torch loop's, "
        "kt-kernel's cold ms (same shape, T, format) / this cold ms;",
        "busy = CPU share other processes took meanwhile (over ~10% makes timings unreliable);",
        "err(fp32 ref) = normwise rel. error of the first cold call's output against fp64 math on the "
        f"original (unquantised) weights and this row's x{kt};",
        "check = the same output against an fp64 reference that rounds (quantised formats: quantises the "
        "activations) where hmoe's precision contract does, FAIL over its tolerance",
    ])
