"""Text form of hmoe.compat's report: plain lines a person can paste into a bug report;
colour only when asked (stdout is a terminal and NO_COLOR is unset)."""
from __future__ import annotations

from .._build_info import module_name
from .._units import size_text

_COLOURS = {"ok": "32", "error": "31", "warning": "33", "head": "1"}


def _paint(text: str, kind: str, colour: bool) -> str:
    return f"\033[{_COLOURS[kind]}m{text}\033[0m" if colour else text


def _gib(n) -> str:
    return "memory ?" if n is None else f"{n / 2**30:.1f} GiB"


def _hmoe(h, out):
    out.append(f"version       {h['version']} (git {h.get('git_revision') or '?'})")
    out.append(f"installed at  {h['install_path']}")
    out.append(f"python        {h['python']} on {h['platform']}")
    m = h.get("manifest")
    if not m:
        out.append(f"manifest      unreadable: {h.get('error')}")
        return
    cuda = m.get("cuda_version")
    out.append(f"built with    {m.get('cxx_compiler')} [{m.get('cxx_flags')}], {m.get('build_type')}; "
               + (f"CUDA {cuda} ({m.get('cuda_compiler')}), runtime {m.get('cuda_runtime')}"
                  if cuda else "no CUDA (HMOE_CUDA=OFF)"))
    for name, e in sorted(m.get("cuda_kernels", {}).items()):
        sass = " ".join(f"sm_{t}" for t in e.get("sass", [])) or "-"
        ptx = " ".join(f"compute_{t}" for t in e.get("ptx", [])) or "-"
        out.append(f"kernel        {name}: SASS {sass}; PTX {ptx} ({module_name(e)})")
    by_op = {}
    for e in m.get("cpu_modules", {}).values():
        by_op.setdefault(e["op"], []).append(e["isa"])
    for op, isas in sorted(by_op.items()):
        out.append(f"CPU modules   {op}: {' '.join(isas)}")


def _variants(rows, out, colour):
    width = max([len(r["module"]) for r in rows] + [6])
    for r in rows:
        if r["kind"] == "cpu":
            what = f"cpu {r['isa']}"
        else:
            what = "cuda " + ", ".join(f"{k['op']}/{k['family']}" for k in r["kernels"])
        status = {"ok": "ok", "not_loaded": "skipped"}.get(r["status"], r["status"].replace("_", " "))
        kind = "ok" if r["status"] in ("ok", "not_loaded") else "error"
        out.append(f"  {r['module']:<{width}}  {what:<28} {_paint(status, kind, colour)}: {r['detail']}")
    if not rows:
        out.append("  (no build manifest: nothing to check)")


def _gpus(g, out):
    if g["simulated"]:
        out.append("simulated     " + ", ".join(d["compute_capability"] for d in g["devices"])
                   + f"; driver supports CUDA {g['driver_cuda'] or '?'}")
        return
    if not g["nvml"]:
        out.append(f"NVML          unavailable: {g['reason']}")
        return
    out.append(f"driver        {g['driver_version'] or '?'}, supports CUDA up to {g['driver_cuda'] or '?'}")
    cvd = g["cuda_visible_devices"]
    out.append(f"CUDA_VISIBLE_DEVICES {'(unset)' if cvd is None else repr(cvd)}, "
               f"CUDA_DEVICE_ORDER {g['device_order']}")
    if not g["devices"]:
        out.append("  no NVIDIA GPU")
    for d in g["devices"]:
        ordn = "-" if d["cuda_ordinal"] is None else d["cuda_ordinal"]
        mig = {True: "MIG on", False: "MIG off", None: "MIG ?"}[d["mig_mode"]]
        out.append(f"  nvml {d['nvml_index']}  cuda:{ordn}  {d['name'] or '?'}  cc {d['compute_capability'] or '?'}"
                   f"  {_gib(d['memory_total_bytes'])}  {mig}  {d['uuid'] or 'UUID ?'}")
        for m in d["mig_devices"]:
            o = "-" if m["cuda_ordinal"] is None else m["cuda_ordinal"]
            out.append(f"      MIG cuda:{o}  {m['name'] or '?'}  {_gib(m['memory_total_bytes'])}  {m['uuid']}")
    for n in g["notes"]:
        out.append(f"  note: {n}")


def _cpu(c, out):
    if c.get("error") and not c.get("vendor"):
        out.append(f"unknown       {c['error']}")
        return
    sim = " (simulated)" if c["simulated"] else ""
    out.append(f"processor     {c['processor']}: {c['vendor']}, {c['model']}{sim}")
    have = [f for f, v in c["features"].items() if v]
    lack = [f for f, v in c["features"].items() if not v]
    out.append(f"features      {' '.join(have) or '-'}")
    if lack:
        out.append(f"lacks         {' '.join(lack)}")
    if c["xcr0"] is not None:
        on = [k for k, v in c["os_support"].items() if v]
        off = [k for k, v in c["os_support"].items() if not v]
        out.append(f"OS (XCR0)     {c['xcr0']}: enabled {' '.join(on) or '-'}"
                   + (f"; not enabled {' '.join(off)}" if off else ""))
    out.append(f"AMX           {c['amx_permission'] or 'not requested (no AMX)'}")


def _torch(t, out):
    if t["installed"] is False:
        out.append("torch         not installed")
        return
    if t["error"]:
        out.append(f"torch         broken: {t['error']}")
        return
    sees = f", sees {len(t['devices'])} CUDA device(s)" if t["cuda_available"] else ", CUDA not available"
    out.append(f"torch         {t['version']}, CUDA {t['cuda_version'] or 'none (CPU build)'}{sees}")
    if t["same_gpus"] is not None:
        out.append(f"              {'same GPUs as NVML' if t['same_gpus'] else 'NOT the same GPUs as NVML'}"
                   f": {t['detail']}")


def _backends(b, out):
    f = b["flashinfer"]
    if f["installed"] is False:
        out.append("flashinfer    not installed")
    elif f["error"]:
        out.append(f"flashinfer    {f['detail'] or 'unknown'}: {f['error']}")
    else:
        out.append(f"flashinfer    {f['version'] or 'version unknown'}")
    for name, st in sorted(b["states"].items()):
        use = {True: "usable", False: "not usable", None: "?"}.get(st.get("usable"), "?")
        out.append(f"  {name}: {use}: {st.get('detail', '')}")


def _selections(rows, out, colour):
    if not rows:
        out.append("  (nothing to select: no build manifest)")
    width = max([len(r["device"]) for r in rows] + [3])
    opw = max([len(r["op"]) for r in rows] + [2])
    for r in rows:
        sim = " [simulated]" if r["simulated"] else ""
        if r["ok"]:
            var = r["variant"] + (f" ({r['target']})" if r["target"] else "")
            out.append(f"  {r['device']:<{width}}  {r['op']:<{opw}}  {_paint(var, 'ok', colour)}: "
                       f"{r['reason']}{sim}")
            for a in r.get("alternatives", ()):  # the op's other families on this device
                var = a["variant"] + (f" ({a['target']})" if a["target"] else "")
                out.append(f"  {'':<{width}}  {'':<{opw}}  also {var}: {a['reason']}")
        else:
            out.append(f"  {r['device']:<{width}}  {r['op']:<{opw}}  {_paint('none', 'error', colour)}: "
                       f"{r['reason']}{sim}")


def _model(m: dict, out: list) -> None:
    if m.get("error") is not None:
        out.append(f"  {m['path']}: {m['error']}")
        return
    out.append(f"  {m['path']}: {m['model_type']}, {m['moe_blocks']} MoE blocks of {m['experts']} routed experts "
               f"(hidden {m['hidden_size']}, intermediate {m['intermediate_size']}), {m['dtype']}")
    avail = m["host_available_bytes"]
    out.append(f"  routed experts on the CPU, packed (+ one block's more while it is read); host available: "
               f"{size_text(avail) if avail else 'unknown'}")
    for name, f in m["formats"].items():
        if f is None:
            out.append(f"    {name:9s} the kernels cannot take these shapes")
            continue
        verdict = "" if f.get("fits") is None else ("  fits" if f["fits"] else "  does not fit")
        out.append(f"    {name:9s} {size_text(f['experts_bytes'])} (+ {size_text(f['block_bytes'])}){verdict}")
    out.append(f"  other tensors (attention, shared experts, embeddings: on load_model's device): "
               f"{size_text(m['other_bytes'])}; each expert kept on a GPU (gpu_experts=) adds "
               f"{size_text(m['expert_float_bytes'])} there")
    for d in m["devices"]:
        out.append(f"    {d['device']}: {size_text(d['free_bytes'])} free of {size_text(d['total_bytes'])}"
                   f"{'  fits' if d['fits_other'] else '  does not fit'}")


def render(rep: dict, colour: bool = False) -> str:
    """The report as text, one section per heading."""
    out = []

    def head(title):
        out.append("")
        out.append(_paint(f"== {title}", "head", colour))

    status = ("OK" if rep["exit_code"] == 0 else "PROBLEMS")
    sim = rep.get("simulated", {})
    extra = ""
    if sim.get("gpu") or sim.get("cpu"):
        extra = " (simulating " + ", ".join(
            [f"GPU {c}" for c in sim.get("gpu") or []] + ([f"CPU {sim['cpu']}"] if sim.get("cpu") else [])) + ")"
    out.append(f"hmoe compat check: {_paint(status, 'ok' if status == 'OK' else 'error', colour)}{extra}")
    sections = [("hmoe", lambda: _hmoe(rep["hmoe"], out)),
                ("native modules (file, load, signature check)", lambda: _variants(rep["variants"], out, colour)),
                ("GPUs (NVML)", lambda: _gpus(rep["gpus"], out)),
                ("CPU", lambda: _cpu(rep["cpu"], out)),
                ("torch", lambda: _torch(rep["torch"], out)),
                ("backends", lambda: _backends(rep["backends"], out)),
                ("selected variant per device and op", lambda: _selections(rep["selections"], out, colour))]
    for title, fn in sections:
        head(title)
        try:
            fn()
        except Exception as e:  # a surprise in the data must not hide the other sections
            out.append(f"  (could not render this section: {type(e).__name__}: {e})")
    if rep.get("plans") is not None:
        head("mla_decode per shape: the variant that runs it, its plan (--mla-shape)")
        for r in rep["plans"]:
            runs = f"{r['variant']} ({r['reason']}): " if r.get("variant") else \
                (f"{r['reason']}: " if r.get("reason") else "")
            out.append(f"  {r['device']}  {r['shape']}: {runs}{r['plan'] or 'no plan: ' + str(r['error'])}")
    if rep.get("model") is not None:
        head("model: what hmoe.nn.load_model would hold (--model)")
        try:
            _model(rep["model"], out)
        except Exception as e:  # a surprise in the data must not hide the other sections
            out.append(f"  (could not render this section: {type(e).__name__}: {e})")
    if rep.get("selftests") is not None:
        head("self-tests")
        for r in rep["selftests"]:
            res = _paint("pass", "ok", colour) if r["ok"] else _paint("FAIL", "error", colour)
            out.append(f"  {r['name']} on {r['device']}: {res}: {r['detail']}")
        if not rep["selftests"]:
            out.append("  (none ran)")
    head("problems")
    if not rep["problems"]:
        out.append("  none")
    for p in rep["problems"]:
        tag = _paint(p["severity"].upper(), p["severity"], colour)
        out.append(f"  {tag}: {p['what']}")
        out.append(f"    fix: {p['fix']}")
    return "\n".join(out) + "\n"
