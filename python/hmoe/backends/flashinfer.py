"""The flashinfer backend (hmoe.backends): mla_decode's variants "flashinfer-fa2"/"flashinfer-fa3" (flashinfer's
BatchMLAPagedAttentionWrapper), used only after pre-validation; not capturable: plan() needs seq_lens on the host,
so each call synchronises."""
from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import pathlib
import re
import shutil
import sys
import threading

from .. import _reference, validation as V
from ..ops import _cuda, _pages

log = logging.getLogger("hmoe.backends.flashinfer")

BACKENDS = ("fa2", "fa3")
HOPPER = (9, 0)
# backend -> (SMs, flashinfer versions [lo, hi)) known to pass hmoe's checks; others need HMOE_FLASHINFER_TRUST=1.
# fa2 leaves out 8.6/8.9: their ~100 KB of shared memory per block selects another fa2 MLA configuration,
# which returned wrong results on 8.6 (flashinfer issue #3219, 0.6.8.post1).
KNOWN = {"fa2": ({(8, 0), (9, 0)}, ((0, 6, 0), (0, 7, 0))),
         "fa3": ({HOPPER}, ((0, 6, 0), (0, 7, 0)))}
FA3_MIN_CUDA = (12, 3)          # flashinfer's own floor for its sm90a kernels
WORKSPACE_BYTES = 128 << 20     # flashinfer's recommended split-KV workspace, per (device, backend)
D_CKV, D_PE = 512, 64


def _dot(v) -> str:
    return ".".join(map(str, v))


def _dtname(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _error(e: BaseException) -> str:
    """One line; a failed JIT build's message is pages of compiler output: its first and last lines."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    text = (lines[0][:200] + (f" ... {lines[-1][:200]}" if len(lines) > 1 else "")) if lines else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _version_tuple(text):
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(x or 0) for x in m.groups()) if m else None


def installed(module: str = "flashinfer", *dists) -> tuple[bool, str | None]:
    """(installed, version) without importing `module` (importing flashinfer loads torch and takes
    seconds; hmoe.compat must stay fast): an imported module's __version__, else its metadata."""
    mod = sys.modules.get(module, False)
    if mod is not False:  # None: Python's marker for a blocked import
        v = getattr(mod, "__version__", None)
        return mod is not None, v if isinstance(v, str) else None
    try:
        if importlib.util.find_spec(module) is None:
            return False, None
    except (ImportError, ValueError):
        return False, None
    from importlib import metadata  # here, not at import: it costs `import hmoe.ops` ~10 ms

    for dist in dists or ("flashinfer-python", "flashinfer"):
        try:
            return True, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return True, None


class _Hardware:
    """Device and toolkit queries in one place, so that the CPU tests can stand in for a GPU."""
    index = staticmethod(lambda torch, dev: _cuda.device_index(torch, dev))
    device = staticmethod(lambda torch, index: torch.device("cuda", index))
    cc = staticmethod(lambda torch, index: tuple(torch.cuda.get_device_capability(index)))
    sync = staticmethod(lambda torch, dev: torch.cuda.current_stream(dev).synchronize())
    driver_cuda = staticmethod(lambda: importlib.import_module("hmoe.hardware.gpu").detect().driver_cuda)

    capturing = staticmethod(lambda torch, index: _cuda.capturing(torch, index))

    def torch_cuda(self):
        """torch's CUDA (major, minor), None for a CPU-only torch; from torch/version.py if not imported."""
        torch, v = sys.modules.get("torch"), None
        try:
            v = torch.version.cuda if torch else re.search(r"^cuda\b[^=\n]*=\s*['\"]([\d.]+)['\"]", pathlib.Path(
                importlib.util.find_spec("torch").origin).with_name("version.py").read_text(), re.M)[1]
        except Exception:  # no torch, or a layout this does not know: unknown, which the checks refuse
            pass
        t = _version_tuple(v)
        return t[:2] if t else None


_hw = _Hardware()


@functools.lru_cache(maxsize=16)
def nvcc_version(path: str) -> tuple:
    """((major, minor), "") or (None, why), from `nvcc --version`; cached per path."""
    import subprocess  # here, not at import (only the flashinfer checks run nvcc)

    exe = path if os.sep in path else shutil.which(path)
    if not exe or not os.path.isfile(exe):
        return None, f"there is no nvcc at {path}"
    try:
        text = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{exe} does not run ({_error(e)})"
    m = re.search(r"release (\d+)\.(\d+)", text or "")
    return ((int(m[1]), int(m[2])), "") if m else (None, f"`{exe} --version` names no release")


def _compiler(backend: str, version: str, driver_cuda) -> tuple[bool, str]:
    """How flashinfer gets its MLA module: prebuilt (flashinfer-jit-cache of its release), or built by
    ninja and an nvcc of torch's CUDA major (it links torch), new enough, for a driver that loads it."""
    has, pre = installed("flashinfer_jit_cache", "flashinfer-jit-cache")
    if has and pre and pre.split("+")[0] == version.split("+")[0]:
        return True, f"prebuilt kernels (flashinfer-jit-cache {pre})"
    tc = _hw.torch_cuda()
    if tc is None:
        return False, "torch is a CPU-only build (torch.version.cuda is None): flashinfer cannot run"
    # the nvcc flashinfer's JIT runs, found in its order: $FLASHINFER_NVCC, else bin/nvcc of $CUDA_HOME,
    # $CUDA_PATH, the toolkit of the nvcc on PATH, /usr/local/cuda
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    home = home or (os.path.dirname(os.path.dirname(found)) if (found := shutil.which("nvcc")) else None)
    path = os.environ.get("FLASHINFER_NVCC") or os.path.join(home or "/usr/local/cuda", "bin", "nvcc")
    nv, why = nvcc_version(path)
    fix = f"install the CUDA {tc[0]} toolkit and set CUDA_HOME to it, or flashinfer-jit-cache {version}"
    if nv is None:
        return False, f"flashinfer JIT-compiles its MLA kernels on first use and {why}: {fix}"
    if nv[0] != tc[0]:
        return False, f"nvcc {_dot(nv)} ({path}) does not match torch's CUDA {_dot(tc)}: {fix}"
    if backend == "fa3" and min(nv, tc) < FA3_MIN_CUDA:
        return False, f"fa3 needs CUDA >= {_dot(FA3_MIN_CUDA)} (nvcc {_dot(nv)}, torch's CUDA {_dot(tc)})"
    if driver_cuda is not None and tuple(driver_cuda)[0] < nv[0]:
        return False, f"nvcc {_dot(nv)} writes code the driver (CUDA {_dot(driver_cuda)}) cannot load"
    if shutil.which("ninja") is None:
        return False, "flashinfer's JIT runs ninja, which is not on PATH (pip install ninja)"
    return True, f"JIT-compiles on first use with nvcc {_dot(nv)} ({path})"


def check(backend: str, cc, driver_cuda=None) -> tuple[bool, str]:
    """The cheap checks (no import, no JIT) of flashinfer `backend` on a GPU of compute capability cc:
    installed, its (version, SM) in KNOWN or HMOE_FLASHINFER_TRUST=1, a way to get its kernels."""
    cc, ccs = tuple(cc), _dot(cc)
    found, version = installed()
    if not found:
        return False, "flashinfer is not installed (pip install flashinfer-python)"
    if not version:
        return False, "flashinfer reports no version: hmoe cannot tell whether it works"
    if cc < (8, 0) or (backend == "fa3" and cc != HOPPER):
        return False, f"flashinfer {backend} needs {'sm_90' if backend == 'fa3' else 'sm_80+'}; this GPU is {ccs}"
    sms, (lo, hi) = KNOWN[backend]
    v, notes = _version_tuple(version), []
    for bad, what in ((cc not in sms, f"hmoe has not validated flashinfer {backend} on {ccs} (validated: "
                                      f"{', '.join(_dot(s) for s in sorted(sms))})"),
                      (v is None or not lo <= v < hi, f"flashinfer {version} is not a version hmoe knows "
                                                      f"for {backend} ({_dot(lo)} <= version < {_dot(hi)})")):
        if bad and os.environ.get("HMOE_FLASHINFER_TRUST") != "1":
            return False, f"{what}; HMOE_FLASHINFER_TRUST=1 accepts it (the self-check still runs)"
        notes += [f"{what}: trusted (HMOE_FLASHINFER_TRUST=1)"] if bad else []
    ok, how = _compiler(backend, version, driver_cuda)
    return (True, "; ".join([f"flashinfer {version} {backend} on {ccs}", how] + notes)) if ok else (False, how)


def _has_fallback(backend: str, cc) -> bool:
    """fa3 refused on Hopper is served by fa2 (off Hopper fa3 does not run at all)."""
    return backend == "fa3" and tuple(cc) == HOPPER


def selectable(name: str, cc, driver_cuda=None) -> tuple[bool, str]:
    """hmoe.backends' check: check() for "flashinfer-<backend>"; on Hopper a refused fa3 is served by
    fa2, as the reason then says."""
    backend = name.removeprefix("flashinfer-")
    ok, why = check(backend, cc, driver_cuda)
    if ok or not _has_fallback(backend, cc):
        return ok, why
    ok2, why2 = check("fa2", cc, driver_cuda)
    return (True, f"fa3 refused ({why}); falls back to fa2: {why2}") if ok2 else \
        (False, f"fa3: {why}; fa2 (its fallback): {why2}")


# --- the expensive checks, once per process, and the runs (dict reads and setdefault are atomic) ---------
_checked: dict = {}    # (index, backend, dtype name) -> state (see states())
_engines: dict = {}    # (index, backend) -> _Engine


def states() -> list[dict]:
    """The expensive checks done so far in this process, one dict per (device, backend, dtype): usable,
    stage reached, detail (the self-check's numbers or what failed), fallback ("fa2" where fa3 fell back)."""
    return [dict(s) for s in list(_checked.values())]


class _Engine:
    """A wrapper and its workspace for one (device, backend); plan() again when its inputs change."""

    def __init__(self, torch, mla, device, backend):
        self.device, self.key, self.lock = device, None, threading.Lock()
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=backend)

    def launch(self, torch, q_nope, q_pe, ckv, kpe, lens, used, ids, sm_scale, out, lse):
        B, H, _ = q_nope.shape
        key = (B, H, ckv.shape[1], q_nope.dtype, ckv.dtype, float(sm_scale), bytes(lens.numpy()), bytes(ids.numpy()))
        with self.lock:
            if key != self.key:
                self.key = None
                indptr = torch.zeros(B + 1, dtype=torch.int32)
                indptr[1:] = used.cumsum(0)
                self.wrapper.plan(qo_indptr=torch.arange(B + 1, dtype=torch.int32), kv_indptr=indptr,
                                  kv_indices=ids.to(self.device), kv_len_arr=lens, num_heads=H, head_dim_ckv=D_CKV,
                                  head_dim_kpe=D_PE, page_size=ckv.shape[1], causal=False, sm_scale=float(sm_scale),
                                  q_data_type=q_nope.dtype, kv_data_type=ckv.dtype)
                self.key = key
            self.wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=lse is not None)


def _forward(torch, engine, q_nope, q_pe, ckv, kpe, page_table, seq_lens, sm_scale, out, lse, lse_scale):
    """Fills out (and lse, times lse_scale). One synchronisation brings the lengths (clamped as hmoe's kernels
    clamp them) and page table to the host, for plan() and flashinfer's CSR page list (used ids, request after
    request); a used id outside the cache is a ValueError. Requests of length 0 get out 0, lse -inf here."""
    lens, pt = seq_lens.to("cpu", non_blocking=True), page_table.to("cpu", non_blocking=True)
    _hw.sync(torch, seq_lens.device)
    page, P = ckv.shape[1], ckv.shape[0]
    lens = lens.clamp(0, pt.shape[1] * page)
    used, mask = _pages.used_pages(torch, pt, lens, page)
    ids = pt[mask]
    if (bad := _pages.bad_entry(pt, mask, P)) is not None:
        b, j = bad
        raise ValueError(f"page_table[{b}, {j}] = {int(pt[b, j])} is outside [0, {P}): the flashinfer "
                         "backend refuses it (it would read outside the cache)")
    live = (lens > 0).nonzero().flatten()
    n, B = live.numel(), lens.numel()
    if n == B:
        engine.launch(torch, q_nope, q_pe, ckv, kpe, lens, used, ids, sm_scale, out, lse)
    else:
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        if n:
            rows = live.to(q_nope.device)
            o = out.new_empty((n,) + tuple(out.shape[1:]))
            l = None if lse is None else lse.new_empty((n, lse.shape[1]))
            engine.launch(torch, q_nope.index_select(0, rows), q_pe.index_select(0, rows), ckv, kpe, lens[live],
                          used[live], ids, sm_scale, o, l)
            out.index_copy_(0, rows, o)
            if lse is not None:
                lse.index_copy_(0, rows, l)
    if lse is not None and lse_scale != 1.0:
        lse.mul_(lse_scale)  # -inf stays -inf


def _selfcheck(torch, engine, device, dtype) -> tuple[bool, str, float]:
    """The engine on a small problem (shuffled pages, NaN in unused slots, page-table garbage, a 0-length request)
    against reference(): (ok, numbers, the factor making its lse natural: flashinfer's default is base 2)."""
    g = torch.Generator().manual_seed(0)
    B, H, page, lens, scale = 4, 16, 16, [57, 0, 48, 1], 192 ** -0.5
    cols = 5  # at most 4 pages used per request, then garbage
    ckv, kpe = (torch.randn(B * cols, page, d, generator=g).to(dtype) for d in (D_CKV, D_PE))
    pt = torch.randperm(B * cols, generator=g).view(B, cols).to(torch.int32)
    for b, L in enumerate(lens):
        n = (L + page - 1) // page
        pt[b, n:] = -7
        if n and L % page:
            ckv[pt[b, n - 1], L % page:], kpe[pt[b, n - 1], L % page:] = math.nan, math.nan
    qn, qp = (torch.randn(B, H, d, generator=g).to(dtype) for d in (D_CKV, D_PE))
    args = [t.to(device) for t in (qn, qp, ckv, kpe, pt, torch.tensor(lens, dtype=torch.int32))]
    out = torch.empty(B, H, D_CKV, dtype=dtype, device=device)
    lse = torch.empty(B, H, dtype=torch.float32, device=device)
    _forward(torch, engine, *args, scale, out, lse, 1.0)
    ref_o, ref_l = (t.cpu() for t in _reference.mla_decode(*args, scale))
    o, l, live = out.float().cpu(), lse.cpu(), torch.tensor(lens) > 0
    if not bool(o[live].isfinite().all() and l[live].isfinite().all()):
        return False, "self-check failed: non-finite output or lse", 1.0
    err = float((o - ref_o).norm() / ref_o.norm())
    e_nat, e_two = (float((l[live] * f - ref_l[live]).abs().max()) for f in (1.0, math.log(2)))
    factor, lse_err = (1.0, e_nat) if e_nat <= e_two else (math.log(2), e_two)
    zero_ok = bool((o[~live] == 0).all() and l[~live].isneginf().all())
    tol, lse_tol = _reference.tolerance("mla_decode", dtype), _reference.MLA_LSE_ATOL
    numbers = (f"out rel. error {err:.1e} (tol {tol:.0e}), lse max error {lse_err:.1e} (tol {lse_tol:.0e}, "
               f"{'natural' if factor == 1.0 else 'base 2, converted'})" + ("" if zero_ok else ", 0-length rows wrong"))
    ok = err <= tol and lse_err <= lse_tol and zero_ok
    return ok, f"self-check {'passed' if ok else 'failed'}: {numbers}", factor


def _validated(torch, index: int, backend: str, dtype) -> dict:
    """backend's state on cuda:<index> for dtype; the first call checks (cheap ones, import, JIT build, self-check)."""
    key = (index, backend, _dtname(dtype))
    if key in _checked:
        return _checked[key]
    ok, why = check(backend, _hw.cc(torch, index), _hw.driver_cuda())
    st = {"device": f"cuda:{index}", "backend": backend, "dtype": _dtname(dtype), "usable": False,
          "stage": "check", "detail": why, "lse_scale": 1.0, "fallback": None}
    if ok:
        try:
            st["stage"] = "import"
            mla = importlib.import_module("flashinfer.mla")
            st["stage"] = "build"  # the first plan() builds (or loads the cached) JIT module
            device = _hw.device(torch, index)
            engine = _engines.get((index, backend))
            if engine is None:
                engine = _engines.setdefault((index, backend), _Engine(torch, mla, device, backend))
            good, numbers, factor = _selfcheck(torch, engine, device, dtype)
            st.update(stage="self-check", usable=good, detail=f"{why}; {numbers}", lse_scale=factor)
        except Exception as e:  # noqa: BLE001 - whatever an import or a JIT build raises refuses it
            st["detail"] = f"{st['stage']} failed: {_error(e)}"
    if not st["usable"]:
        log.warning("hmoe: flashinfer-%s refused on cuda:%d (%s): %s", backend, index, _dtname(dtype), st["detail"])
    return _checked.setdefault(key, st)


def resolve(torch, index: int, backend: str, dtype) -> str:
    """The backend serving `backend` on cuda:<index> for dtype: itself once validated, or for fa3 on Hopper fa2
    (warned once; in states()). RuntimeError when none can (the user asked for flashinfer) and under capture."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown flashinfer backend {backend!r} (known: {', '.join(BACKENDS)})")
    if _hw.capturing(torch, index):
        raise RuntimeError(f"mla_decode flashinfer-{backend} cannot run inside CUDA-graph capture: its plan() needs "
                           "seq_lens on the host (a synchronisation) and its first use builds a JIT module. Capture "
                           "hmoe's own variants (leave variant= and HMOE_CUDA_VARIANT unset)")
    st = _validated(torch, index, backend, dtype)
    if st["usable"]:
        return backend
    where = f"mla_decode on cuda:{index} ({_dtname(dtype)})"
    if not _has_fallback(backend, _hw.cc(torch, index)):
        raise RuntimeError(f"flashinfer-{backend} cannot run {where}: {st['detail']}")
    st2 = _validated(torch, index, "fa2", dtype)
    if not st2["usable"]:
        raise RuntimeError(f"flashinfer-fa3 cannot run {where}: fa3: {st['detail']}; "
                           f"fa2 (its fallback): {st2['detail']}")
    if st["fallback"] is None:
        st["fallback"] = "fa2"
        log.warning("hmoe: flashinfer-fa3 falls back to fa2 for %s: %s", where, st["detail"])
    return "fa2"


def prewarm(index: int, backends=BACKENDS, dtypes=("bfloat16",)) -> list[dict]:
    """Builds, loads and self-checks each backend per dtype (name or torch dtype) on cuda:<index>, outside capture;
    fa3 is skipped off Hopper when fa2 is asked for too, else raises as run() would. Returns states()."""
    torch = V.torch_module()
    hopper = _hw.cc(torch, index) == HOPPER
    for dt in dtypes:
        for b in backends:
            if hopper or b != "fa3" or "fa2" not in backends:
                resolve(torch, index, b, getattr(torch, dt) if isinstance(dt, str) else dt)
    return states()


def run(variant, q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, *, sm_scale, return_lse=False, out=None):
    """mla_decode through `variant` ("flashinfer-fa2"/"-fa3") on inputs hmoe.ops.mla_decode validated:
    out [B, H, 512] in q's dtype (into `out` when given), and lse [B, H] fp32, natural log, when
    return_lse. Synchronises the stream (plan() needs the lengths); raises under graph capture."""
    torch = V.torch_module()
    index = _hw.index(torch, q_nope.device)
    backend = resolve(torch, index, str(variant).removeprefix("flashinfer-"), q_nope.dtype)
    scale = _checked[(index, backend, _dtname(q_nope.dtype))]["lse_scale"]
    B, H, _ = q_nope.shape
    if out is None:
        out = torch.empty((B, H, D_CKV), dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty((B, H), dtype=torch.float32, device=q_nope.device) if return_lse else None
    if B:
        _forward(torch, _engines[(index, backend)], q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens,
                 sm_scale, out, lse, scale)
    return (out, lse) if return_lse else out


def warm(name: str, index: int) -> None:
    """hmoe.backends' warm-up: prewarm() of this one backend (bfloat16)."""
    prewarm(index, backends=(name.removeprefix("flashinfer-"),))


def run_mla_decode(name, *args, **kwargs):
    """hmoe.backends' entry for mla_decode: run()."""
    return run(name, *args, **kwargs)


def compat_state(name: str) -> dict:
    """hmoe.backends' state of "flashinfer-<backend>": the cheap checks for each visible GPU (no
    flashinfer import, no JIT), then what this process's expensive checks found (states())."""
    backend = name.removeprefix("flashinfer-")
    det = importlib.import_module("hmoe.hardware.gpu").detect()
    ccs = sorted({d.compute_capability for d in det.visible if d.compute_capability})
    results = [(ok, why if len(ccs) == 1 else f"{_dot(cc)}: {why}") for cc in ccs
               for ok, why in [selectable(name, cc, det.driver_cuda)]] or \
        [(False, ("" if installed()[0] else "flashinfer is not installed; ") + "no CUDA GPU visible")]
    done = [f"{s['device']} {s['dtype']}: {s['detail']}" + ("; fa3 requests run on fa2" if s.get("fallback") else "")
            for s in states() if s["backend"] == backend]
    return {"usable": any(ok for ok, _ in results), "detail": "; ".join([w for _, w in results] + done)}
