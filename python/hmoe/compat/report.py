"""hmoe.compat.report(): what `python -m hmoe.compat check --json` prints, as plain data. Every
probe is wrapped: a broken environment becomes lines and problems, never an exception."""
from __future__ import annotations

import importlib.machinery
import platform

from .. import _arch, _threads, dispatch
from .._build_info import module_name
from .._native import NativeModuleError, load, mark_failed
from ..hardware import cpu as _cpu
from ..hardware import gpu as _gpu
from . import probes
from . import selftest as _selftest

SCHEMA_VERSION = 1

# CPU ops served by the baseline cpu_core module alone (no ISA variants to choose from).
CPU_CORE_OPS = ("grouped_topk",)

_FIX_NATIVE = "reinstall hmoe: pip install --force-reinstall --no-deps hmoe (or rebuild from source)"
_FIX_THREADS = f"set HMOE_NUM_THREADS to an integer 1..{_threads.MAX_THREADS} or unset it"


def backend_states() -> dict:
    """name -> state of each optional backend (hmoe.backends.BACKENDS); one that fails reads as
    unusable with the reason."""
    from .. import backends

    return backends.states()


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if not isinstance(e, (NativeModuleError, dispatch.NoGpuVariant)) \
        else str(e)


def _guard(fn, *args, **kw):
    """(value, None) or (None, error line)."""
    try:
        return fn(*args, **kw), None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit from a misbehaving import included
        return None, _why(e)


def expected_signatures(module: str) -> dict:
    """What Python expects from hmoe._native.<module>: its table in the installed spec
    (include/hmoe/signatures.h); {} when the spec cannot be read (reported as a problem then)."""
    from .._native import expected_table, spec

    try:
        return expected_table(module)
    except spec.SpecError:
        return {}


class _Problems(list):
    def add(self, severity: str, what: str, fix: str) -> None:
        self.append({"severity": severity, "what": what, "fix": fix})


def _hmoe_section(problems):
    import hmoe
    from pathlib import Path

    sec = {"version": hmoe.__version__, "git_revision": None,
           "install_path": str(Path(hmoe.__file__).resolve().parent),
           "python": platform.python_version(), "platform": platform.platform(),
           "manifest": None, "error": None}
    manifest, err = _guard(hmoe.build_info)
    if err:
        sec["error"] = err
        problems.add("error", f"hmoe's build manifest is unreadable: {err}", _FIX_NATIVE)
        return sec, {}
    sec["manifest"] = manifest
    sec["git_revision"] = manifest.get("git_revision")
    if manifest.get("version") != hmoe.__version__:
        problems.add("error", f"hmoe's Python files are version {hmoe.__version__}, its native "
                     f"build {manifest.get('version')}", _FIX_NATIVE)
    return sec, manifest


def _load_status(module: str) -> dict:
    try:
        load(module)
    except NativeModuleError as e:
        return {"loaded": e.kind == "signature_mismatch", "signature_ok": False,
                "status": e.kind, "detail": str(e)}
    except BaseException as e:  # noqa: BLE001 - whatever a corrupt .so raises
        if isinstance(e, KeyboardInterrupt):
            raise
        return {"loaded": False, "signature_ok": False, "status": "load_error", "detail": _why(e)}
    return {"loaded": True, "signature_ok": True, "status": "ok",
            "detail": "loads, signature table and constants match"}


def _file(module: str):
    """The module's file on disk, found without importing it (and without sys.modules)."""
    from .. import _native

    spec, _ = _guard(importlib.machinery.PathFinder.find_spec, f"hmoe._native.{module}",
                     list(_native.__path__))
    return getattr(spec, "origin", None) if spec is not None else None


def _variants(manifest, real_cpu, cpu_err, problems) -> list:
    """Every native module of the build: present, loads, signature ok. A CPU module is loaded
    only when this CPU can run its ISA: a static initialiser compiled with -mavx512f could
    otherwise execute an instruction this CPU lacks while the module loads."""
    out = []
    levels = {lv["name"]: lv for lv in _cpu.levels(manifest.get("processor"))}
    cpu_mods = [("cpu_core", None, "baseline")] + [
        (name, e["op"], e["isa"]) for name, e in manifest.get("cpu_modules", {}).items()]
    for name, op, isa in cpu_mods:
        row = {"kind": "cpu", "module": name, "ops": [op] if op else list(CPU_CORE_OPS),
               "isa": isa, "file": _file(name), "kernels": []}
        row["present"] = row["file"] is not None
        missing = [] if isa == "baseline" else \
            (_cpu.missing_requirements(levels[isa], real_cpu) if real_cpu and isa in levels else None)
        if not row["present"]:
            row.update(loaded=False, signature_ok=None, status="missing",
                       detail="file not in the installation")
        elif missing is None:
            row.update(loaded=False, signature_ok=None, status="not_loaded",
                       detail=f"present, not loaded: CPU features unknown ({cpu_err or 'unknown level'})")
        elif missing:
            row.update(loaded=False, signature_ok=None, status="not_loaded",
                       detail=f"present, not loaded: CPU lacks {', '.join(missing)}")
        else:
            row.update(_load_status(name))
        out.append(row)
    by_module = {}
    for e in manifest.get("cuda_kernels", {}).values():
        mod = module_name(e)
        by_module.setdefault(mod, []).append({"op": e["op"], "family": e["family"],
                                              "sass": list(e.get("sass", [])),
                                              "ptx": list(e.get("ptx", []))})
    for mod, kernels in by_module.items():
        # CUDA modules are compiled for the baseline ISA on the host side: safe to load.
        row = {"kind": "cuda", "module": mod, "ops": sorted({k["op"] for k in kernels}),
               "isa": None, "file": _file(mod), "kernels": kernels}
        row["present"] = row["file"] is not None
        if not row["present"]:
            row.update(loaded=False, signature_ok=None, status="missing",
                       detail="file not in the installation")
        else:
            row.update(_load_status(mod))
        out.append(row)
    for row in out:
        if row["status"] in ("missing", "load_error", "signature_mismatch"):
            problems.add("error", f"native module {row['module']}: {row['status'].replace('_', ' ')}"
                         f": {row['detail']}", _FIX_NATIVE)
    return out


def _row(device, op, sel=None, reason="", simulated=False):
    return {"device": device, "op": op, "variant": sel.variant if sel else None,
            "module": (sel.module or None) if sel else None, "target": (sel.target or None) if sel else None,
            "reason": sel.reason if sel else reason, "ok": sel is not None, "simulated": simulated,
            "alternatives": []}


def _alternatives(op, sel, families, cc, driver_cuda, label) -> list:
    """What each other family built for `op` would do on this device, as if forced (mla_decode's
    fallback family runs the shapes the selected one declines: see hmoe.ops.mla.route)."""
    from ..ops import mla

    out = []
    for family in families:
        if family == sel.variant:
            continue
        try:
            alt = dispatch.select_gpu(op, cc=cc, driver_cuda=driver_cuda, device_label=label, variant=family,
                                      use_env=False)
            why, target, ok = alt.reason.removeprefix(f"forced by variant={family}: "), alt.target or None, True
        except ValueError as e:  # cannot run here: "variant='sm90a' cannot run on <label>: <why>"
            why, target, ok = str(e).split(f"{label}: ", 1)[-1], None, False
        except Exception as e:  # noqa: BLE001 - its module is broken: said in the native modules too
            why, target, ok = _why(e), None, False
        if ok and op == "mla_decode" and family == mla.FALLBACK and not sel.backend:
            why += f"; runs the shapes {sel.variant} declines (--mla-shape shows which)"
        out.append({"variant": family, "target": target, "reason": why, "ok": ok})
    return out


def _cpu_selections(manifest, info, problems, simulated) -> list:
    rows = []
    ops = sorted({e["op"] for e in manifest.get("cpu_modules", {}).values()})
    for op in ops:
        try:
            # A simulated CPU's modules are not loaded: this CPU may not run their ISA.
            sel = dispatch.select_cpu(op, info=info,
                                      load_module=not simulated)
            rows.append(_row("cpu", op, sel, simulated=simulated))
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            rows.append(_row("cpu", op, reason=_why(e), simulated=simulated))
            fix = ("unset HMOE_CPU_ISA or pick a level this CPU runs" if isinstance(e, ValueError)
                   else _FIX_NATIVE)
            problems.add("error", f"cpu: {op}: {_why(e)}", fix)
    for op in CPU_CORE_OPS:
        _, err = _guard(load, "cpu_core")
        sel = None if err else dispatch.Selection(op, "baseline", "cpu_core",
                                                  "one build for every CPU (cpu_core)")
        rows.append(_row("cpu", op, sel, reason=err or "", simulated=simulated))
        if err:
            problems.add("error", f"cpu: {op}: {err}", _FIX_NATIVE)
    return rows


def _gpu_selections(manifest, det, torch_info, problems) -> list:
    rows = []
    failed = {}  # (reason, fix) -> ([devices], [ops]): one problem for what many rows share
    kernels = manifest.get("cuda_kernels", {})
    # A build without GPU kernels still lists every GPU op (each then says why none runs), from
    # arch/gpu.json; when that is unreadable _package_data has said so, and there is no op to list.
    ops = sorted({e["op"] for e in kernels.values()}) or (_guard(_arch.gpu_ops)[0] or [])
    families = {op: sorted(e["family"] for e in kernels.values() if e["op"] == op) for op in ops}
    devices = [(d.label, d.compute_capability, det.driver_cuda) for d in det.visible]
    if not det.ok and torch_info.get("devices"):
        # No NVML: the devices torch saw (in its child process) stand in for it.
        devices = [(f"cuda:{d['ordinal']} ({d['name']}, {d['cc'][0]}.{d['cc'][1]}) [from torch]",
                    tuple(d["cc"]), None) for d in torch_info["devices"]]
    for label, cc, driver_cuda in devices:
        if cc is None:
            rows += [_row(label, op, reason="compute capability unknown (see the GPU problems)")
                     for op in ops]
            problems.add("error", f"{label}: compute capability unknown", "check that nvidia-smi "
                         "works; update the driver")
            continue
        for op in ops:
            try:
                sel = dispatch.select_gpu(op, cc=cc, driver_cuda=driver_cuda, device_label=label)
                rows.append(_row(label, op, sel, simulated=det.simulated))
                rows[-1]["alternatives"] = _alternatives(op, sel, families[op], cc, driver_cuda, label)
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                reason = getattr(e, "reason", None) or _why(e)
                rows.append(_row(label, op, reason=reason, simulated=det.simulated))
                fix = getattr(e, "fix", "") or ("unset HMOE_CUDA_VARIANT or pick a variant this GPU runs"
                                                if isinstance(e, ValueError) else _FIX_NATIVE)
                devs, ops_ = failed.setdefault((reason, fix), ({}, {}))
                devs[label] = ops_[op] = True  # dicts as ordered sets
    for (reason, fix), (devs, ops_) in failed.items():
        problems.add("error", f"{', '.join(devs)}: {', '.join(ops_)}: {reason}", fix)
    return rows


SIMULATED_SMS = 132  # the SMs of a simulated GPU, for route's shape rules (an H100 or H200 SXM)


def _simulated_routes(rows, shapes) -> list:
    """--mla-shape with --simulate-gpu: which variant would run each shape on each simulated device
    (hmoe.ops.mla.route's rule, asked of the selected family's installed module: it depends on the
    shape and the SM count, SIMULATED_SMS here; a family forced by HMOE_CUDA_VARIANT that declines the
    shape is route's error); the plan needs the real GPU, and a device no variant serves (a build
    without GPU kernels) says why."""
    from .. import _env
    from ..ops import mla

    forced = _env.get("HMOE_CUDA_VARIANT")
    out = []
    for r in (r for r in rows if r["op"] == "mla_decode" and r["device"] != "cpu"):
        for B, S, H, page in shapes:
            variant, reason = (r["variant"], r["reason"]) if r["ok"] else (None, None)
            if r["ok"] and r["module"]:
                max_pages = -(-S // page)
                why, err = _guard(lambda: load(r["module"]).mla_decode_declines(SIMULATED_SMS, B, H, max_pages, page))
                shape = mla.shape_text(B, H, max_pages, page)
                if err:  # the rule is the module's: without it, which variant runs the shape is unknown
                    variant, reason = None, f"unknown: hmoe._native.{r['module']} cannot say ({err})"
                elif why and r["variant"] == forced:
                    variant, reason = None, mla.forced_declined(forced, "HMOE_CUDA_VARIANT=", shape, r["device"], why)
                elif why:
                    variant, reason = mla.FALLBACK, mla.declined_reason(r["variant"], shape, why)
                if reason and not err and r["variant"] != mla.FALLBACK:  # the selected family's rule counts SMs
                    reason += f" (as on {SIMULATED_SMS} SMs)"
            error = ("plans need the real GPU (not with --simulate-gpu)" if r["ok"] else
                     f"no variant runs it: {r['reason']}")  # e.g. a build without GPU kernels
            out.append({"device": r["device"], "shape": f"{B}x{S}x{H} page {page}", "variant": variant,
                        "reason": reason, "plan": None, "error": error})
    return out


def _gpu_problems(det, problems) -> None:
    if not det.ok and not det.nvml_missing:
        problems.add("error", f"NVML: {det.reason}", "fix the NVIDIA driver (nvidia-smi must work)")
    elif not det.ok and "nvidia-ml-py" in (det.reason or ""):
        problems.add("warning", det.reason, "pip install nvidia-ml-py")
    for line in list(det.problems) + [p for g in det.gpus for p in g.problems]:
        problems.add("warning", f"NVML query failed: {line}", "update the NVIDIA driver; "
                     "information from this query is missing from the report")
    for note in det.notes:
        if "every entry after it" in note or "twice" in note or "without MIG devices" in note:
            problems.add("warning", note, "fix CUDA_VISIBLE_DEVICES (nvidia-smi -L lists the UUIDs)")


def _package_data(problems) -> None:
    """The data files the package reads at run time (arch/*.json, the native spec): each one
    missing or corrupt is a problem of its own, whatever else the report can still say."""
    from .. import _arch
    from .._native import spec

    for what, read in (("arch/cpu.json", lambda: _arch.load("cpu")), ("arch/gpu.json", lambda: _arch.load("gpu")),
                       ("the native spec (constants.h)", spec.constants),
                       ("the native spec (signatures.h)", spec.entry_points)):
        _, err = _guard(read)
        if err:
            problems.add("error", f"package data {what}: {err}", _FIX_NATIVE)


def _environment(problems) -> str | None:
    """Environment variables with values hmoe refuses, as problems: HMOE_COMPAT_TIMEOUT (this check's
    own, ignored then) and HMOE_NUM_THREADS (every CPU experts call raises). Returns the error that
    hmoe.get_num_threads() raises, or None."""
    why = probes.timeout_problem()
    if why:
        problems.add("warning", why, probes.TIMEOUT_FIX)
    try:
        _threads.get_num_threads()  # the library's own reading of HMOE_NUM_THREADS (unless set_num_threads overrides it)
    except ValueError as e:
        problems.add("error", f"{e}: every call of hmoe's CPU experts raises this", _FIX_THREADS)
        return str(e)
    return None


def _isolate(module_probes) -> None:
    """Modules whose load killed or hung a child are marked failed: this process never maps them."""
    for probe in module_probes:
        why = probe.crashed()
        if why is not None:
            mark_failed(probe.name, why, "load_error")


def _loadable(manifest, real_cpu) -> list[str]:
    """The native modules the report loads in-process: CPU modules whose ISA this CPU runs, and
    every CUDA family module (cpu_core is probed before the CPU is known)."""
    levels = {lv["name"]: lv for lv in _cpu.levels(manifest.get("processor"))}
    names = [name for name, e in manifest.get("cpu_modules", {}).items()
             if real_cpu is not None and e["isa"] in levels and not _cpu.missing_requirements(levels[e["isa"]], real_cpu)]
    return names + sorted({module_name(e) for e in manifest.get("cuda_kernels", {}).values()})


_MODEL_KEYS = ("path", "model_type", "dtype", "moe_blocks", "experts", "hidden_size", "intermediate_size",
               "fp8_block", "formats", "other_bytes", "expert_float_bytes", "host_available_bytes", "devices")


def _model_section(data: dict, problems) -> dict:
    """--model's section: memory_needs' counts with what fits where (a format fits the host when its packed
    experts and one block's more are available; the other tensors fit a device whose free memory holds them),
    or the error that stopped the count. A model no format fits is an error, other tensors no GPU holds a
    warning (load_model(device="cpu") remains)."""
    sec = {k: data.get(k) for k in _MODEL_KEYS}
    sec["path"], sec["error"] = data.get("path"), data.get("error")
    if sec["error"] is not None:
        problems.add("error", f"--model {sec['path']}: {sec['error']}",
                     "point --model at a DeepSeek-V2/V3 checkpoint directory (its config.json is enough) with "
                     "transformers installed")
        return sec
    avail = sec["host_available_bytes"]
    for f in sec["formats"].values():
        if f is not None:
            f["fits"] = None if not avail else f["experts_bytes"] + f["block_bytes"] <= avail
    for d in sec["devices"]:
        d["fits_other"] = sec["other_bytes"] <= d["free_bytes"]
    fits = [k for k, f in sec["formats"].items() if f is not None and f["fits"]]
    if avail and not fits:
        smallest = min((f["experts_bytes"] + f["block_bytes"] for f in sec["formats"].values() if f is not None),
                       default=0)
        problems.add("error", f"--model {sec['path']}: its routed experts fit this host's available memory "
                              f"({avail / 2**30:.1f} GiB) in no format (the smallest needs {smallest / 2**30:.1f} GiB)",
                     "a host with more memory, or free some")
    if sec["devices"] and not any(d["fits_other"] for d in sec["devices"]):
        problems.add("warning", f"--model {sec['path']}: its tensors other than the routed experts "
                                f"({sec['other_bytes'] / 2**30:.1f} GiB) fit no GPU's free memory",
                     "free GPU memory, or load_model(path, device=\"cpu\")")
    return sec


def report(*, simulate_gpu=(), simulate_cpu: str | None = None, selftest: bool = False,
           mla_shapes=(), model: str | None = None, _python=None) -> dict:
    """The full report as JSON-ready data (see schema.json). simulate_gpu: compute capabilities
    ("8.6", "9.0", ...) to select for instead of this machine's GPUs; simulate_cpu: an ISA level
    of arch/cpu.json; selftest: run the selected variants once against references; mla_shapes:
    (batch, seq_len, heads, page_size) tuples whose mla_decode plan to show for each CUDA device;
    model: a DeepSeek-V2/V3 checkpoint directory (its config.json is enough) whose load_model memory to
    count against this host and its GPUs."""
    problems = _Problems()
    # Children first (they run while the rest is probed): what could crash or hang this process.
    child = probes.PythonProbe(python=_python, mla_shapes=() if simulate_gpu else mla_shapes)
    model_probe = probes.ModelProbe(model, python=_python) if model is not None else None
    nvml = probes.NvmlProbe() if not simulate_gpu and _gpu._NVML_HOOK is None else None
    core = probes.ModuleProbe("cpu_core")
    rep = {"schema_version": SCHEMA_VERSION, "simulated": {"gpu": [str(c) for c in simulate_gpu],
                                                           "cpu": simulate_cpu}}
    rep["hmoe"], manifest = _hmoe_section(problems)
    _package_data(problems)
    threads_err = _environment(problems)
    _isolate([core])

    real_cpu, cpu_err = _guard(_cpu.cpu_info, request_amx=True)
    if cpu_err:
        problems.add("error", f"CPU detection failed: {cpu_err}", _FIX_NATIVE)
    cpu_info = _cpu.simulated(simulate_cpu) if simulate_cpu else real_cpu
    rep["cpu"] = probes.cpu_section(cpu_info) if cpu_info else {
        "processor": _cpu.processor(), "vendor": None, "model": None, "features": {}, "xcr0": None,
        "os_support": {}, "amx_permission": None, "simulated": False, "error": cpu_err}
    if manifest:
        _isolate([probes.ModuleProbe(name) for name in _loadable(manifest, real_cpu)])
    rep["variants"] = _variants(manifest, real_cpu, cpu_err, problems) if manifest else []

    if nvml is not None:
        _gpu.prime(nvml.result())  # detect() below (and every backend probe) uses the child's answer
    det, err = _guard(lambda: _gpu.simulated(*simulate_gpu) if simulate_gpu else _gpu.detect())
    if err:  # detect() does not raise; this is the last line of defence
        det = _gpu.GpuDetection(False, f"GPU detection failed: {err}", None, None, (), (), None,
                                "FASTEST_FIRST")
    rep["gpus"] = probes.gpu_section(det)
    _gpu_problems(det, problems)

    py = child.result()
    torch_sec, more = probes.torch_section(py.get("torch", {}), det)
    flash, more2 = probes.flashinfer_section(py.get("flashinfer", {}))
    for sev, what, fix in more + more2:
        problems.add(sev, what, fix)
    rep["torch"] = torch_sec
    rep["backends"] = {"flashinfer": flash, "states": backend_states()}

    rows = []
    if manifest:
        if cpu_info is not None:
            rows += _cpu_selections(manifest, cpu_info, problems, bool(simulate_cpu))
        rows += _gpu_selections(manifest, det, {} if simulate_gpu else torch_sec, problems)
    rep["selections"] = rows
    rep["plans"] = None
    if mla_shapes:
        rep["plans"] = (_simulated_routes(rows, mla_shapes) if simulate_gpu else py.get("plans")) or [
            {"device": "-", "shape": f"{B}x{S}x{H} page {page}", "variant": None, "reason": None, "plan": None,
             "error": "plans need the real GPU (not with --simulate-gpu)" if simulate_gpu else
             (py.get("torch") or {}).get("error") or "the torch child process gave no plans"}
            for B, S, H, page in mla_shapes]

    rep["model"] = _model_section(model_probe.result(), problems) if model_probe is not None else None

    rep["selftests"] = None
    if selftest:
        devices = ["cpu"] + ([f"cuda:{d['ordinal']}" for d in torch_sec.get("devices", [])]
                             if torch_sec.get("cuda_available") else [])
        rep["selftests"] = _selftest.run(devices)
        for r in rep["selftests"]:
            if not r["ok"] and threads_err and threads_err in r["detail"]:  # the test could not run, not a bad variant
                problems.add("error", f"self-test {r['name']} on {r['device']} could not run: {r['detail']}",
                             _FIX_THREADS)
            elif not r["ok"]:
                problems.add("error", f"self-test {r['name']} on {r['device']} failed: {r['detail']}",
                             "report it with this output; force another variant meanwhile "
                             "(HMOE_CPU_ISA / HMOE_CUDA_VARIANT)")
    rep["problems"] = list(problems)
    bad = any(p["severity"] == "error" for p in problems)
    rep["exit_code"] = 1 if bad else 0
    rep["status"] = "problems" if bad else "ok"
    return rep
