# kt-kernel (KTransformers' CPU MoE kernels) as a peer of hmoe's CPU experts in `python -m hmoe.bench experts`.
"""Drives kt-kernel's extension MoE classes directly through `kt_kernel_ext.CPUInfer`: its
`KTMoEWrapper` needs a CUDA build of torch (pinned buffers, streams), the extension itself does not
link torch. Same weights, routing and thread count as hmoe; kt takes bf16 activations and returns
bf16 whatever the bench's activation dtype.

kt's worker threads pin themselves to cores and spin for about 50 ms after each job; `KtExperts.close`
destroys the MoE object and the CPUInfer (which joins its threads), so nothing of kt runs while
hmoe is measured."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import os
import shutil
import sys
import tempfile

# Per weight format: kt-kernel's MoE classes in order of preference (the first one the loaded
# extension has is used; the AMX build has them all, the AVX2 build only the AVX2 ones) and how
# the weights reach it:
#   bf16     the bf16 gate/up/down matrices, one pointer per expert (kt copies them);
#   online   the bf16 matrices; kt quantises them itself, in memory (AMX int8/int4: one scale per
#            output row, no groups);
#   fp8      hmoe.quant's float8_e4m3fn with fp32 scales per (128, 128) block (DeepSeek's layout,
#            kt's FP8 method);
#   rawint4  hmoe.quant's int4 groups as kt's RAWINT4 layout (nibbles offset by 8 instead of two's
#            complement, scales rounded to bf16); kt reads the nibbles from our tensors.
KT_CLASSES = {
    "bf16": (("AMXBF16_MOE", "bf16"), ("AVX2BF16_MOE", "bf16")),
    "int8": (("AMXInt8_MOE", "online"),),
    "int4": (("AMXInt4_MOE", "online"), ("AVX2RawInt4_MOE", "rawint4")),
    "fp8": (("AMXFP8_MOE", "fp8"), ("AVX2FP8_MOE", "fp8")),
}
WEIGHTS_NOTE = {
    "bf16": "the bf16 weights",
    "online": "quantised by kt from the bf16 weights (per output row)",
    "fp8": "hmoe.quant fp8, (128, 128) blocks",
    "rawint4": "hmoe.quant int4 group {g}, scales rounded to bf16",
}
FP8_BLOCK = 128


class KtUnavailable(RuntimeError):
    """kt-kernel cannot be loaded in this process (the message says why)."""


class KtUnsupported(ValueError):
    """The loaded kt-kernel extension has no MoE class for a format."""


@dataclasses.dataclass(frozen=True)
class KtKernel:
    ext: object  # the kt_kernel_ext extension module
    variant: str  # its CPU variant ("amx", "avx512_bf16", "avx2", ...)
    version: str
    how: str  # how it was loaded, with the reason when `import kt_kernel` failed

    def describe(self) -> str:
        return f"kt-kernel {self.version} ({self.variant} extension, {self.how})"


_loaded: KtKernel | None = None


def _package_dirs():
    """kt_kernel package folders on sys.path (e.g. a carried folder put on PYTHONPATH), found
    without importing the package."""
    for entry in sys.path:
        d = os.path.join(entry or os.getcwd(), "kt_kernel")
        if os.path.isfile(os.path.join(d, "_cpu_detect.py")):
            yield d


def _load_extension_directly():
    """kt's own variant detection and loader (`kt_kernel/_cpu_detect.py`), run as a standalone
    module: it imports nothing of the package, so it works where kt_kernel/__init__ does not (its
    Python wrappers import torch-version-specific code)."""
    cached = sys.modules.get("kt_kernel_ext")  # a failed `import kt_kernel` may have loaded it
    if cached is not None and hasattr(cached, "moe"):
        return cached, str(getattr(cached, "__cpu_variant__", "?")), "kt_kernel_ext already loaded"
    dirs = list(_package_dirs())
    if not dirs:
        raise KtUnavailable("no kt_kernel folder on sys.path")
    path = os.path.join(dirs[0], "_cpu_detect.py")
    spec = importlib.util.spec_from_file_location("hmoe_bench_kt_cpu_detect", path)
    detect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(detect)
    ext, variant = detect.initialize()
    sys.modules.setdefault("kt_kernel_ext", ext)
    return ext, str(variant), f"extension loaded from {dirs[0]}"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kt-kernel")
    except Exception:  # a carried folder has no dist-info
        return "?"


def load() -> KtKernel:
    """kt-kernel's extension, loaded once per process; KtUnavailable with every reason when it
    cannot be."""
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        import kt_kernel

        ext, variant, how = kt_kernel.kt_kernel_ext, str(kt_kernel.__cpu_variant__), "import kt_kernel"
        version = str(getattr(kt_kernel, "__version__", None) or _version())
    except Exception as e:  # ImportError mostly; kt's __init__ also raises RuntimeError on a variant mismatch
        first = f"import kt_kernel failed: {type(e).__name__}: {e}".splitlines()[0]
        try:
            ext, variant, how = _load_extension_directly()
        except Exception as e2:
            raise KtUnavailable(f"{first}; loading its extension directly failed: "
                                f"{type(e2).__name__}: {e2}".splitlines()[0]) from None
        how, version = f"{how}; {first}", _version()
    if not hasattr(ext, "CPUInfer") or not hasattr(ext, "moe"):
        raise KtUnavailable(f"kt_kernel_ext ({variant}) has no CPUInfer / moe module")
    _loaded = KtKernel(ext, variant, version, how)
    return _loaded


def pick_class(kt: KtKernel, fmt: str):
    """(class name, handover) kt uses for `fmt` on this extension, or KtUnsupported."""
    for name, handover in KT_CLASSES.get(fmt, ()):
        if getattr(kt.ext.moe, name, None) is not None:
            return name, handover
    raise KtUnsupported(f"kt-kernel has no {fmt} on {kt.variant}")


def bytes_per_expert(handover: str, fmt: str, H: int, I: int, int4_group: int = 128) -> int:
    """Bytes kt streams per expert: its weights and scales as it stores them."""
    n = 3 * H * I
    if handover == "bf16":
        return 2 * n
    if handover == "online":  # AMX int8 / int4: the values, one fp32 scale per output row
        return n * (8 if fmt == "int8" else 4) // 8 + 4 * (2 * I + H)
    if handover == "fp8":
        return n + 4 * 3 * (-(-H // FP8_BLOCK)) * (-(-I // FP8_BLOCK))
    if handover == "rawint4":  # kt converts the bf16 scales to fp32 when it loads
        return n // 2 + 4 * n // int4_group
    raise ValueError(f"unknown handover {handover!r}")


@contextlib.contextmanager
def native_stdout_to_stderr():
    """kt's C++ side reports progress with printf / std::cout on stdout, where the bench's table
    goes: send file descriptor 1 to stderr meanwhile (C's buffers flushed on both sides)."""
    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    libc.fflush(None)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


class KtExperts:
    """One kt-kernel MoE layer over the bench's weights: KtExperts(kt, fmt, w13, w2, top_k=...,
    threads=..., max_tokens=...)(x, ids, weights) -> [T, H] bf16. w13 [E, 2I, H] / w2 [E, H, I] are
    the original bf16 weights; quantised formats are made from them here (see KT_CLASSES). Inputs
    must come from prepare() (bf16 x, int64 ids, fp32 weights, contiguous): the conversion stays
    out of the timed call. close() tears kt's objects and threads down."""

    def __init__(self, kt: KtKernel, fmt: str, w13, w2, *, top_k: int, threads: int, max_tokens: int,
                 int4_group: int = 128):
        import torch

        self.format = fmt
        self.class_name, self.handover = pick_class(kt, fmt)
        E, two_i, H = w13.shape
        I = two_i // 2
        self.E, self.H, self.I, self.top_k, self.max_tokens = E, H, I, top_k, max_tokens
        self.threads = threads
        self.bytes_per_expert = bytes_per_expert(self.handover, fmt, H, I, int4_group)
        self.weights_note = WEIGHTS_NOTE[self.handover].format(g=int4_group)
        self._keep = []  # every tensor kt holds a pointer to lives as long as this object
        self._tmp = None
        self._moe = self._infer = None
        ext = kt.ext
        mats = [w13[:, :I], w13[:, I:], w2]  # gate, up, down: [E, N, K] each
        with native_stdout_to_stderr():
            try:
                pool = ext.WorkerPoolConfig()
                pool.subpool_count, pool.subpool_numa_map, pool.subpool_thread_count = 1, [0], [threads]
                self._infer = ext.CPUInfer(pool)
                self._no_gpu_experts = torch.zeros(E, dtype=torch.bool)
                cfg = ext.moe.MOEConfig(E, top_k, H, I, self._no_gpu_experts.data_ptr())
                # max_len is a capacity; kt's int8 on its AVX-512 builds takes it in multiples of 32
                # rows (M_STEP), so 64 at a time (calls with up to max_tokens tokens are allowed).
                cfg.layer_idx, cfg.pool, cfg.max_len = 0, self._infer.backend_, -(-max_tokens // 64) * 64
                self._hand_over(cfg, mats, int4_group, torch)
                self._moe = getattr(ext.moe, self.class_name)(cfg)
                self._identity = torch.arange(E, dtype=torch.int64)  # physical expert i is logical i
                self._infer.submit(self._moe.load_weights_task(self._identity.data_ptr()))
                self._infer.sync()
            except BaseException:
                self._teardown()
                raise
        self._out_rows = {}

    def _hand_over(self, cfg, mats, int4_group, torch):
        from hmoe import quant

        E = self.E
        if self.handover == "online":
            # contiguous bf16 [E, N, K]; save/load off: kt quantises in memory and writes nothing
            # (the path is a temporary folder all the same, removed by close())
            gate, up, down = (m.to(torch.bfloat16).contiguous() for m in mats)
            self._keep += [gate, up, down]
            self._tmp = tempfile.mkdtemp(prefix="hmoe-bench-kt-")
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
            cfg.save, cfg.load, cfg.path = False, False, self._tmp
            return
        if self.handover == "bf16":
            data = [m.to(torch.bfloat16).contiguous() for m in mats]
            scales = None
        elif self.handover == "fp8":
            qs = [quant.quantize(m, "fp8", block=(FP8_BLOCK, FP8_BLOCK)) for m in mats]
            data = [q.data.view(torch.uint8).contiguous() for q in qs]
            scales = [q.scales.float().contiguous() for q in qs]
            cfg.quant_config.bits, cfg.quant_config.group_size = 8, FP8_BLOCK
        else:  # rawint4: two's complement nibble q -> q + 8 is a flip of each nibble's top bit
            qs = [quant.quantize(m, "int4", group_size=int4_group) for m in mats]
            data = [(q.data ^ 0x88).contiguous() for q in qs]
            scales = [q.scales.to(torch.bfloat16).contiguous() for q in qs]
            cfg.quant_config.bits, cfg.quant_config.group_size = 4, int4_group
        if scales is not None:
            cfg.quant_config.zero_point = False
        self._keep += data + (scales or [])
        per_expert = [[[int(t[e].data_ptr()) for e in range(E)]] for t in data]
        cfg.gate_projs, cfg.up_projs, cfg.down_projs = per_expert
        if scales is None:
            cfg.gate_scales = cfg.up_scales = cfg.down_scales = [[0] * E]
        else:
            cfg.gate_scales, cfg.up_scales, cfg.down_scales = ([[int(t[e].data_ptr()) for e in range(E)]]
                                                               for t in scales)

    @staticmethod
    def prepare(x, ids, weights):
        """The inputs as kt reads them: bf16 x, int64 ids, fp32 weights, all contiguous."""
        import torch

        return (x.to(torch.bfloat16).contiguous(), ids.to(torch.int64).contiguous(),
                weights.to(torch.float32).contiguous())

    def __call__(self, x, ids, weights):
        import torch

        if self._moe is None:
            raise RuntimeError("KtExperts: closed")
        T = x.shape[0]
        # kt reads exactly these layouts through raw pointers: a mistake is a crash, not an error
        if (x.dtype != torch.bfloat16 or ids.dtype != torch.int64 or weights.dtype != torch.float32
                or not (x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous())
                or tuple(x.shape) != (T, self.H) or tuple(ids.shape) != (T, self.top_k)
                or tuple(weights.shape) != (T, self.top_k)):
            raise ValueError("KtExperts: inputs must come from KtExperts.prepare() with this layer's H and top_k")
        if not 1 <= T <= self.max_tokens:
            raise ValueError(f"KtExperts: {T} tokens, built for 1..{self.max_tokens} (max_len)")
        rows = self._out_rows.get(T)
        if rows is None:
            rows = self._out_rows[T] = torch.tensor([T], dtype=torch.int32)
        out = torch.empty(T, self.H, dtype=torch.bfloat16)
        self._infer.submit(self._moe.forward_task(rows.data_ptr(), self.top_k, ids.data_ptr(), weights.data_ptr(),
                                                  x.data_ptr(), out.data_ptr(), False))
        self._infer.sync()
        return out

    def _teardown(self):
        # the MoE object first (it uses the pool), then CPUInfer, whose destructor joins the workers
        self._moe = None
        self._infer = None
        self._keep = []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def close(self):
        with native_stdout_to_stderr():
            self._teardown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
