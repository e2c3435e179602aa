"""hmoe.quant: int8 / int4 / fp8 quantised weights against a reference written out element by element."""
import copy
import pickle

import numpy as np
import pytest
import torch

import hmoe
from hmoe import quant

from .ops.test_moe_experts import ISAS


def _w(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference(w, qmax, group):
    """Symmetric round-to-nearest-even per group of `group` along K, dequantised: the scale and the
    quotient in fp32 (the contract), the dequantised product in fp64."""
    w = w.float()
    out = torch.empty_like(w, dtype=torch.float64)
    K = w.shape[-1]
    for k0 in range(0, K, group):
        blk = w[..., k0:k0 + group]
        s = blk.abs().amax(dim=-1, keepdim=True) / qmax
        q = (blk / torch.where(s > 0, s, 1.0)).round().clamp(-qmax, qmax)
        out[..., k0:k0 + group] = q.double() * s.double()
    return out


@pytest.mark.parametrize("group", [None, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_int8_matches_the_reference(group, dtype):
    w = _w(3, 10, 256, dtype=dtype)
    qw = quant.quantize(w, "int8", group_size=group)
    assert qw.data.dtype == torch.int8 and qw.data.shape == w.shape
    assert qw.scales.shape == (3, 10, 256 // (group or 256)) and qw.scales.dtype == torch.float32
    got = quant.dequantize(qw)
    want = _reference(w.float(), 127, group or 256)
    assert got.dtype == torch.float32 and got.shape == w.shape
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-6)
    # the error per element is at most half a step of its group
    step = qw.scales.repeat_interleave(group or 256, dim=-1)
    assert ((got - w.float()).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [None, 32, 128])
def test_int4_packs_two_per_byte_and_matches_the_reference(group):
    w = _w(2, 6, 256, seed=1)
    qw = quant.quantize(w, "int4", group_size=group)
    g = group or 128
    assert qw.group_size == g and qw.data.dtype == torch.uint8 and qw.data.shape == (2, 6, 128)
    assert qw.bits_per_weight == pytest.approx(4 + 32 / g)
    want = _reference(w, 7, g)
    assert torch.allclose(quant.dequantize(qw).double(), want, rtol=0, atol=1e-6)
    # nibble order: element 2j low, 2j + 1 high, two's complement
    q = torch.round(w[0, 0, :2] / qw.scales[0, 0, 0]).to(torch.int64)
    byte = int(qw.data[0, 0, 0])
    assert ((byte & 0xF) ^ 8) - 8 == q[0] and ((byte >> 4) ^ 8) - 8 == q[1]


def test_int4_is_more_accurate_with_smaller_groups_and_int8_more_than_int4():
    w = _w(64, 1024, seed=2)

    def err(qw):
        return ((quant.dequantize(qw) - w).norm() / w.norm()).item()

    e8 = err(quant.quantize(w, "int8"))
    e4 = [err(quant.quantize(w, "int4", group_size=g)) for g in (32, 64, 128)]
    assert e4[0] < e4[1] < e4[2] and e8 < e4[0]
    assert e8 < 0.01 and e4[2] < 0.12


def test_fp8_round_trip_and_from_fp8():
    w = _w(300, 320, seed=3)
    qw = quant.quantize(w, "fp8")
    assert qw.data.dtype == torch.float8_e4m3fn and qw.scales.shape == (3, 3) and qw.block == (128, 128)
    got = quant.dequantize(qw)
    assert ((got - w).norm() / w.norm()).item() < 2 ** -4  # e4m3: 3 mantissa bits
    # DeepSeek's layout: weight float8 [N, K] with weight_scale_inv [ceil(N/128), ceil(K/128)]
    again = quant.from_fp8(qw.data, qw.scales)
    assert torch.equal(quant.dequantize(again), got)
    manual = qw.data.float() * qw.scales.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :320]
    assert torch.equal(got, manual)
    as4 = quant.from_fp8(qw.data, qw.scales, to="int4", group_size=64)
    assert as4.format == "int4" and as4.group_size == 64
    assert torch.allclose(quant.dequantize(as4).double(), _reference(got, 7, 64), rtol=0, atol=1e-6)


def test_stacked_experts_and_zero_groups():
    w = _w(4, 16, 64, seed=4)
    w[1] = 0.0
    for fmt, g in (("int8", None), ("int4", 32), ("fp8", None)):
        qw = quant.quantize(w, fmt, group_size=g)
        got = quant.dequantize(qw)
        assert got.shape == w.shape and torch.equal(got[1], torch.zeros(16, 64))
        assert torch.isfinite(got).all()


def _torch_path(w, fmt, group):
    """quantize's int8 / int4 through its torch ops (the path of CUDA weights), on the CPU."""
    L, (N, K) = w[..., 0, 0].numel(), w.shape[-2:]
    gk = quant._group(fmt, K, group) or K
    q = torch.empty(L, N, K // 2 if fmt == "int4" else K, dtype=torch.uint8 if fmt == "int4" else torch.int8)
    scales = torch.empty(L, N, K // gk)
    quant._quantize_torch(w.reshape(L, N, K), fmt, gk, q, scales)
    return q.reshape(*w.shape[:-1], q.shape[-1]), scales.reshape(*w.shape[:-1], K // gk)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt,group", [("int8", None), ("int8", 32), ("int8", 128), ("int4", 32), ("int4", 128)])
def test_cpu_kernel_gives_the_torch_paths_bits(monkeypatch, isa, dtype, fmt, group):
    # CPU weights are quantised by the experts module of the CPU's ISA level (threads, no fp32 copy; each
    # level's build vectorises it its own way), others by torch ops: the same bytes and scales bit for bit,
    # and fp8 dequantised as torch does. Rows from 1e-40 (fp32 subnormals; zero in fp16) to 1e4, zero groups and
    # rows, exact half steps (round half to even), a group whose max sits at its last element; odd row counts
    # so that the native tasks end inside a matrix; and a transposed view (made contiguous first).
    w = _w(3, 37, 256, seed=11) * torch.logspace(-40, 4, 37).view(1, 37, 1)
    w[0, 0] = 0.0
    w[1, 2, :128] = 0.0
    w[2, 3, :10] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -3.5, 6.5, 7.0, -7.0])
    w[2, 4, :128] = torch.arange(128.0)
    w = w.to(dtype)
    monkeypatch.setenv("HMOE_CPU_ISA", isa)
    f8 = quant.quantize(w, "fp8", block=(32, 64))  # the torch path
    want = f8.data.float() * f8.scales.repeat_interleave(32, -2)[..., :37, :].repeat_interleave(64, -1)
    assert torch.equal(quant.dequantize(f8), want)
    direct = quant.from_fp8(f8.data, f8.scales, (32, 64), to=fmt, group_size=group)  # from the bytes, no fp32 copy
    q, scales = _torch_path(want, fmt, group)
    assert torch.equal(direct.data, q) and torch.equal(direct.scales.view(torch.int32), scales.view(torch.int32))
    for x in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):
        got = quant.quantize(x, fmt, group_size=group)
        q, scales = _torch_path(x, fmt, group)
        assert torch.equal(got.data, q)
        assert torch.equal(got.scales.view(torch.int32), scales.view(torch.int32))
    last = float(min(group or 256, 128) - 1)  # the first group's max, at its last element
    assert torch.equal(got.scales[2, 4, 0], torch.tensor(last) / (7 if fmt == "int4" else 127))


def test_cpu_kernel_finds_nan_and_infinity_in_any_row():
    w = _w(5, 33, 128, seed=12)
    assert quant.quantize(w, "int4").data.shape == (5, 33, 64)
    for e, n, k, bad in ((0, 0, 0, float("nan")), (4, 32, 127, float("inf")), (2, 17, 64, -float("inf"))):
        x = w.clone()
        x[e, n, k] = bad
        for fmt in ("int8", "int4"):
            with pytest.raises(ValueError, match="the weights hold NaN or infinity; they cannot be quantised"):
                quant.quantize(x, fmt)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_kernel_same_bits_on_any_number_of_threads(threads):
    w = _w(7, 300, 512, seed=13, dtype=torch.bfloat16)  # tasks of about 1 MB: several a matrix
    want = [quant.quantize(w, fmt, group_size=g) for fmt, g in (("int8", None), ("int4", 64))]
    old = hmoe.get_num_threads()
    hmoe.set_num_threads(threads)
    try:
        got = [quant.quantize(w, fmt, group_size=g) for fmt, g in (("int8", None), ("int4", 64))]
    finally:
        hmoe.set_num_threads(old)
    for a, b in zip(got, want):
        _assert_same(a, b)


@pytest.mark.parametrize("piece", [7 * 64, 3 * 128 * 40, 1 << 20])
def test_pieces_give_the_same_bytes(monkeypatch, piece):
    # The torch path (fp8; int8 / int4 of weights that are not on the CPU) works through a stack in pieces
    # of about quant._PIECE weights (whole matrices, or runs of rows: a multiple of fp8's block rows);
    # whatever their size, the bytes and scales are those of one piece. Shapes with partial fp8 blocks (200
    # rows, 300 columns) and int8 per row.
    w = _w(3, 200, 384, seed=9, dtype=torch.bfloat16)
    whole = {(fmt, g): quant.quantize(w, fmt, group_size=g) for fmt, g in (("int8", None), ("int4", 32), ("fp8", None))}
    whole["fp8", "narrow"] = quant.quantize(w[..., :300], "fp8", block=(64, 32))
    monkeypatch.setattr(quant, "_PIECE", piece)
    for (fmt, g), want in whole.items():
        if g == "narrow":
            got = quant.quantize(w[..., :300], "fp8", block=(64, 32))
        elif fmt == "fp8":
            got = quant.quantize(w, fmt, group_size=g)
        else:
            got = quant.QuantizedWeights(fmt, *_torch_path(w, fmt, g), w.shape, group_size=want.group_size)
        assert got.data.shape == want.data.shape and got.scales.shape == want.scales.shape
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (fmt, g)
        assert torch.equal(got.scales, want.scales), (fmt, g)
    f8 = whole["fp8", None]
    as4 = quant.from_fp8(f8.data, f8.scales, to="int4", group_size=64)
    assert torch.equal(as4.data, quant.quantize(quant.dequantize(f8), "int4", group_size=64).data)
    bad = w.clone()
    bad[2, 199, 383] = float("inf")  # in the last piece
    for find in (lambda: _torch_path(bad, "int4", 32), lambda: quant.quantize(bad, "fp8")):
        with pytest.raises(ValueError, match="NaN or infinity"):
            find()


def _fp8_stack(*shape, block=(128, 128), seed=0):
    """A checkpoint-like fp8 weight (every byte but NaN) and its weight_scale_inv, for from_fp8."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    N, K = shape[-2:]
    scale_inv = torch.rand(*shape[:-2], -(-N // block[0]), -(-K // block[1]), generator=gen) + 0.5
    return raw.view(torch.float8_e4m3fn), scale_inv


def _assert_same(a, b):
    """Every exposed field of two QuantizedWeights equal, the tensors' bytes and layout too."""
    assert type(a) is type(b) is quant.QuantizedWeights
    assert (a.format, a.shape, a.group_size, a.block, a.kernel_group, a.nbytes, repr(a)) == \
           (b.format, b.shape, b.group_size, b.block, b.kernel_group, b.nbytes, repr(b))
    assert a.bits_per_weight == b.bits_per_weight
    for x, y in ((a.data, b.data), (a.scales, b.scales)):
        assert (x.dtype, x.shape, x.stride(), x.device) == (y.dtype, y.shape, y.stride(), y.device)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(quant.dequantize(a), quant.dequantize(b))


PICKLED = {
    "int8 per row": lambda: quant.quantize(_w(3, 10, 256), "int8"),
    "int8 per group": lambda: quant.quantize(_w(3, 10, 256), "int8", group_size=32),
    "int4": lambda: quant.quantize(_w(5, 64), "int4", group_size=32),
    "fp8": lambda: quant.quantize(_w(2, 200, 320, seed=5), "fp8"),  # partial blocks
    "fp8 from_fp8": lambda: quant.from_fp8(*_fp8_stack(2, 200, 320, block=(64, 32)), block=(64, 32)),
}


@pytest.mark.parametrize("make", PICKLED.values(), ids=PICKLED.keys())
def test_pickle_and_deepcopy_round_trip(make):
    # Plain pickle cannot load float8 tensors (torch.save and deepcopy can): fp8's data travels as bytes.
    qw = make()
    for proto in (2, pickle.HIGHEST_PROTOCOL):
        _assert_same(pickle.loads(pickle.dumps(qw, protocol=proto)), qw)
    twin = copy.deepcopy(qw)
    _assert_same(twin, qw)
    assert twin.data.data_ptr() != qw.data.data_ptr()


def test_unpickled_fp8_runs_in_cpu_experts():
    gen = torch.Generator().manual_seed(6)
    E, H, I, T, K = 3, 128, 64, 4, 2
    q13, q2 = (quant.quantize(torch.randn(E, n, k, generator=gen), "fp8", block=(64, 64)) for n, k in ((2 * I, H), (H, I)))
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32)
    w = torch.rand(T, K, generator=gen)
    t13, t2 = pickle.loads(pickle.dumps((q13, q2)))
    assert torch.equal(hmoe.CPUExperts(t13, t2)(x, ids, w), hmoe.CPUExperts(q13, q2)(x, ids, w))


def test_cpu_experts_take_fp8_blocks_larger_than_the_matrix():
    # block=(2**64, 64): one scale per 64 columns over all of each matrix's rows, the same weights as
    # block=(rows of the matrix, 64); the sizes given to the module are bounded by the matrix.
    gen = torch.Generator().manual_seed(8)
    E, H, I, T, K = 3, 128, 64, 4, 2
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    huge = [quant.quantize(w, "fp8", block=(2 ** 64, 64)) for w in (w13, w2)]
    exact = [quant.quantize(w, "fp8", block=(w.shape[1], 64)) for w in (w13, w2)]
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32)
    w = torch.rand(T, K, generator=gen)
    got, want = hmoe.CPUExperts(*huge)(x, ids, w), hmoe.CPUExperts(*exact)(x, ids, w)
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_pickle_states():
    qw = quant.quantize(_w(5, 64), "int4", group_size=32)
    state = qw.__getstate__()
    state["version"] = 7
    with pytest.raises(ValueError, match="another hmoe version"):
        quant.QuantizedWeights.__new__(quant.QuantizedWeights).__setstate__(state)
    # version 1 (before fp8's bytes; its int8 and int4 states are the same) still reads
    state = qw.__getstate__()
    state["version"] = 1
    del state["data_dtype"]
    old = quant.QuantizedWeights.__new__(quant.QuantizedWeights)
    old.__setstate__(state)
    _assert_same(old, qw)
    f8 = quant.quantize(_w(4, 128), "fp8").__getstate__()
    assert f8["data"].dtype == torch.uint8 and f8["data_dtype"] == "float8_e4m3fn"
    f8["data_dtype"] = "float8_e9m9"
    with pytest.raises(ValueError, match="dtype float8_e9m9 does not exist in torch"):
        quant.QuantizedWeights.__new__(quant.QuantizedWeights).__setstate__(f8)
    bad = qw.__getstate__()
    bad["format"] = "int2"
    with pytest.raises(ValueError, match="unknown format 'int2'"):
        quant.QuantizedWeights.__new__(quant.QuantizedWeights).__setstate__(bad)
    assert hmoe.quant is quant


def _fp8_reference(w, block):
    """fp8 block by block: s = amax / 448 over each (rows, cols) slice, q = w / s in e4m3fn."""
    w = w.float()
    r, c = block
    N, K = w.shape[-2:]
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    scales = torch.empty(*w.shape[:-2], -(-N // r), -(-K // c))
    for i, n0 in enumerate(range(0, N, r)):
        for j, k0 in enumerate(range(0, K, c)):
            blk = w[..., n0:n0 + r, k0:k0 + c]
            s = blk.abs().amax(dim=(-2, -1)) / quant.FP8_MAX
            scales[..., i, j] = s
            s = s[..., None, None]
            q[..., n0:n0 + r, k0:k0 + c] = torch.where(s > 0, blk / torch.where(s > 0, s, 1.0), 0.0).to(q.dtype)
    return q, scales


@pytest.mark.parametrize("block", [(128, 128), (64, 32), (200, 64), (2 ** 40, 64), (64, 2 ** 40), (2 ** 20, 2 ** 20),
                                   (2 ** 62, 2 ** 62)], ids=str)
def test_fp8_blocks_against_the_reference(block):
    # A block larger than the matrix covers it whole (scales [..., ceil(N/rows), ceil(K/cols)]): quantize
    # and dequantize never pad beyond one block within the matrix (2**20 x 2**20 once asked for 4.4 TB).
    w = _w(3, 200, 320, seed=7, dtype=torch.bfloat16)
    w[1, :, :64] = 0.0  # zero blocks
    qw = quant.quantize(w, "fp8", block=block)
    q, scales = _fp8_reference(w, block)
    assert qw.block == block and qw.scales.shape == scales.shape
    assert torch.equal(qw.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(qw.scales, scales)
    want = q.float() * scales.repeat_interleave(min(block[0], 200), -2)[..., :200, :].repeat_interleave(
        min(block[1], 320), -1)[..., :320]
    assert torch.equal(quant.dequantize(qw), want)
    assert torch.equal(quant.dequantize(quant.from_fp8(qw.data, qw.scales, block)), want)


def test_fp8_every_byte_dequantises_as_torch_does():
    # the CPU's native dequantisation against torch's float8 conversion times the expanded scales
    data, scale_inv = _fp8_stack(2, 130, 260, block=(64, 128), seed=14)
    data.view(torch.uint8)[0, 0, :254] = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    got = quant.dequantize(quant.from_fp8(data, scale_inv, (64, 128)))
    want = data.float() * scale_inv.repeat_interleave(64, -2)[..., :130, :].repeat_interleave(128, -1)[..., :260]
    assert torch.equal(got, want)


def test_empty_stacks():
    # An empty stack quantises, prints and converts; its bits per weight are those of one matrix's layout.
    for fmt, g, bits in (("int8", None, 8.25), ("int8", 32, 9.0), ("int4", 64, 4.5), ("fp8", None, 8 + 32 / (8 * 128))):
        empty = quant.quantize(_w(0, 8, 128), fmt, group_size=g)
        one = quant.quantize(_w(1, 8, 128), fmt, group_size=g)
        assert empty.data.shape[0] == empty.scales.shape[0] == 0 and quant.dequantize(empty).shape == (0, 8, 128)
        assert empty.bits_per_weight == one.bits_per_weight == pytest.approx(bits)
        assert repr(empty) == repr(one).replace("shape=[1,", "shape=[0,")
        _assert_same(pickle.loads(pickle.dumps(empty)), empty)
    f8 = torch.zeros(0, 8, 128, dtype=torch.float8_e4m3fn)
    as4 = quant.from_fp8(f8, torch.ones(0, 1, 1), to="int4", group_size=64)
    assert as4.format == "int4" and as4.data.shape == (0, 8, 64) and as4.scales.shape == (0, 8, 2)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quant.from_fp8(f8, torch.ones(0, 1, 1), to="int4", group_size=48)


def test_unknown_formats():
    qw = quant.quantize(_w(2, 64, 128), "int8")
    with pytest.raises(ValueError, match=r"QuantizedWeights: unknown format 'int2'; expected one of \('int8', 'int4', 'fp8'\)"):
        quant.QuantizedWeights("int2", qw.data, qw.scales, qw.shape)
    # the attributes can still be changed: CPUExperts names the format instead of failing on a lookup
    w13, w2 = qw, quant.quantize(_w(2, 128, 32), "int8")
    w13.format = w2.format = "int2"
    with pytest.raises(ValueError, match=r"unknown quantised weight format 'int2'; the kernels take \('int8', 'int4', 'fp8'\)"):
        hmoe.CPUExperts(w13, w2)


def test_errors():
    w = _w(4, 64)
    with pytest.raises(ValueError, match="unknown format 'int3'"):
        quant.quantize(w, "int3")
    with pytest.raises(ValueError, match="group_size must be one of"):
        quant.quantize(w, "int4", group_size=48)
    for not_int in (True, 64.0, np.float32(64), "64"):
        with pytest.raises(TypeError, match=f"group_size must be an int .*, got .* of type {type(not_int).__name__}"):
            quant.quantize(w, "int8", group_size=not_int)
    with pytest.raises(TypeError, match=r"group_size must be an int \(one of \(32, 64, 128\)\), got 32.0"):
        quant.quantize(w, "int4", group_size=32.0)
    assert type(quant.quantize(w, "int8", group_size=np.int64(64)).group_size) is int
    with pytest.raises(ValueError, match="not a multiple of group_size 128"):
        quant.quantize(w, "int4")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        quant.quantize(w.to(torch.int32), "int8")
    with pytest.raises(ValueError, match=r"\[..., N, K\]"):
        quant.quantize(w[0], "int8")
    bad = w.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinity"):
        quant.quantize(bad, "int8")
    with pytest.raises(ValueError, match="not per group"):
        quant.quantize(w, "fp8", group_size=32)
    for block in ((127.9, 128), (True, 128), ("128", 128)):  # int() used to make 127.9 a block of 127
        with pytest.raises(TypeError, match=r"block must be two ints \(rows, cols\)"):
            quant.quantize(w, "fp8", block=block)
    for block in ((128,), 128, (0, 128)):
        with pytest.raises(ValueError, match="block"):
            quant.quantize(w, "fp8", block=block)
    assert quant.quantize(w, "fp8", block=(np.int64(64), 128)).block == (64, 128)
    f8 = w.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale_inv has shape \(2, 1\), expected \(1, 1\)"):
        quant.from_fp8(f8, torch.ones(2, 1))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quant.from_fp8(w, torch.ones(1, 1))
    with pytest.raises(ValueError, match="to must be None"):
        quant.from_fp8(f8, torch.ones(1, 1), to="fp4")
    with pytest.raises(ValueError, match=r"w_fp8 \[..., N, K\] with N, K >= 1, got shape \(4, 0\)"):
        quant.from_fp8(f8[:, :0], torch.ones(1, 0))
    for nan in (0x7F, 0xFF):  # both signs of e4m3fn's NaN, found piece by piece in a stack
        stack = torch.zeros(3, 4, 128, dtype=torch.float8_e4m3fn)
        stack.view(torch.uint8)[2, 3, 127] = nan
        with pytest.raises(ValueError, match="w_fp8 holds NaN"):
            quant.from_fp8(stack, torch.ones(3, 1, 1))
    stack = torch.zeros(3, 4, 128, dtype=torch.float8_e4m3fn)
    stack.view(torch.uint8)[1, 2, 5] = 0xFF  # built around from_fp8's check: dequantize finds it (CPU)
    with pytest.raises(ValueError, match="the fp8 weights hold NaN"):
        quant.dequantize(quant.QuantizedWeights("fp8", stack, torch.ones(3, 1, 1), stack.shape, block=(128, 128)))
    edge = torch.tensor([448.0, -448.0, 0.0, -0.0]).to(torch.float8_e4m3fn).view(1, 4).expand(4, 4).contiguous()
    assert quant.from_fp8(edge, torch.ones(1, 1)).format == "fp8"  # the largest finite bytes 0x7E/0xFE are not NaN
    with pytest.raises(TypeError, match="expected QuantizedWeights"):
        quant.dequantize(w)
