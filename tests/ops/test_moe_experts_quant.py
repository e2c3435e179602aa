"""CPUExperts with quantised weights (hmoe.quant int8, int4, fp8) on every ISA variant this CPU runs,
against the reference that rounds where the contract does and against fp64 on the dequantised weights."""
import pickle

import pytest
import torch

import hmoe
from hmoe import _reference, quant
from hmoe.ops import library

from .experts_reference import random_problem, rel_err
from .test_moe_experts import ISAS, empty_slots

X_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (format, group_size): int8 per row and per group, int4 per group, fp8 in DeepSeek's 128 x 128
# blocks and in narrower ones.
FORMATS = [("int8", None), ("int8", 32), ("int4", 128), ("int4", 64), ("int4", 32), ("fp8", (128, 128)),
           ("fp8", (64, 32))]


def _quantise(w, fmt, group):
    if fmt == "fp8":
        return quant.quantize(w, "fp8", block=group)
    return quant.quantize(w, fmt, group_size=group)


def _check_isas(isas, x, ids, w, q13, q2):
    """Every ISA's CPUExperts output against both references (computed once)."""
    ref_c = _reference.moe_experts(x, ids, w, q13, q2, contract=True)
    ref_p = _reference.moe_experts(x, ids, w, q13, q2, contract=False)
    tol_c = _reference.tolerance("moe_experts", x.dtype, w_dtype=q13.format, contract=True)
    tol_p = _reference.tolerance("moe_experts", x.dtype, w_dtype=q13.format, contract=False)
    for isa in isas:
        y = hmoe.CPUExperts(q13, q2, isa=isa)(x, ids, w)
        assert y.dtype == x.dtype and y.shape == x.shape
        err_c, err_p = rel_err(y, ref_c), rel_err(y, ref_p)
        assert err_c < tol_c and err_p < tol_p, (isa, err_c, err_p)


def _problem(T, H, I, E, K, fmt, group, x_dtype=torch.float32, seed=0):
    x, ids, w, w13, w2 = random_problem(T, H, I, E, K, x_dtype, torch.float32, gen=torch.Generator().manual_seed(seed))
    return x, ids, w, _quantise(w13, fmt, group), _quantise(w2, fmt, group)


@pytest.mark.parametrize("fmt,group", FORMATS, ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=str)
def test_formats_against_references(fmt, group, x_dtype):
    # T = 1 and 3: decode (register kernels); T = 40: about 20 rows an expert (the matrix unit where
    # the ISA has one); H, I multiples of every group.
    for T, H, I, E, K in [(1, 256, 128, 6, 2), (3, 128, 256, 5, 3), (40, 256, 384, 6, 3)]:
        _check_isas(ISAS, *_problem(T, H, I, E, K, fmt, group, x_dtype, seed=T))


@pytest.mark.parametrize("fmt,group", FORMATS[::2], ids=str)
def test_empty_slots(fmt, group):
    """-1 slots add nothing and read nothing (their weights and an all-empty token's x are NaN)."""
    g = torch.Generator().manual_seed(5)
    for T, H, I, E, K in [(3, 128, 256, 5, 3), (40, 256, 384, 6, 3)]:
        x, ids, w, q13, q2 = _problem(T, H, I, E, K, fmt, group, seed=T)
        empty_slots(x, ids, w, g)
        keep = torch.arange(T) != 1
        _check_isas(ISAS, x[keep], ids[keep], w[keep], q13, q2)
        for isa in ISAS:
            y = hmoe.CPUExperts(q13, q2, isa=isa)(x, ids, w)
            assert torch.equal(y[1], torch.zeros_like(y[1]))
            ref = hmoe.CPUExperts(q13, q2, isa=isa)(x[keep], ids[keep], w[keep])
            assert torch.equal(y[keep], ref), isa


@pytest.mark.parametrize("fmt,group", [("int8", None), ("fp8", (128, 128))], ids=str)
def test_padded_reductions(fmt, group):
    """Lengths no group divides (int8 per row and fp8 blocks pad K with zeros) and partial blocks."""
    for T, H, I, E, K in [(2, 67, 37, 4, 2), (33, 200, 150, 3, 2)]:
        _check_isas(ISAS, *_problem(T, H, I, E, K, fmt, group, seed=H))


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int4", 128), ("fp8", (128, 128))], ids=str)
def test_many_rows_per_expert(fmt, group):
    """More rows an expert than one pass of the tile path takes (256), not a multiple of 32."""
    _check_isas(ISAS, *_problem(300, 128, 128, 3, 2, fmt, group, seed=3))


@pytest.mark.parametrize("fmt,group", FORMATS[::2], ids=str)
def test_variants_agree(fmt, group):
    """Integer products are exact on every ISA: the variants differ by fp32 rounding order only."""
    x, ids, w, q13, q2 = _problem(40, 256, 128, 4, 2, fmt, group, seed=7)
    outs = {isa: hmoe.CPUExperts(q13, q2, isa=isa)(x, ids, w).double() for isa in ISAS}
    base = outs[ISAS[0]]
    for isa, y in outs.items():
        assert float((y - base).norm() / base.norm()) < 2e-6, isa


@pytest.mark.parametrize("isa", ISAS)
def test_every_output_written_and_nan_stays_in_its_token(isa):
    x, ids, w, q13, q2 = _problem(24, 128, 64, 4, 2, "int4", 64, seed=5)
    experts = hmoe.CPUExperts(q13, q2, isa=isa)
    out = torch.full_like(x, float("nan"))
    assert experts(x, ids, w, out=out) is out and torch.isfinite(out).all()
    # what out= holds, not only that it is finite: y[keep] is compared with it below
    ref = _reference.moe_experts(x, ids, w, q13, q2)
    assert rel_err(out, ref) < _reference.tolerance("moe_experts", x.dtype, w_dtype=q13.format)
    x[5, 3] = float("nan")
    y = experts(x, ids, w)
    assert not torch.isfinite(y[5]).any()
    keep = torch.arange(24) != 5
    assert torch.isfinite(y[keep]).all() and torch.equal(y[keep], out[keep])


@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", 32), ("int8", None), ("int8", 32)], ids=str)
def test_extreme_products_stay_exact(fmt, group):
    # Every weight at the format's largest magnitude (w13 positive, w2 negative) and every
    # activation at +-127: the largest partial sums the kernels keep in narrow lanes (int4:
    # isa::VS, int16 on avx2/avx512; int8: vpmaddubsw's int16 pairs of 127 * 127 products there).
    H, I, E = 256, 128, 2
    q13 = quant.quantize(torch.ones(E, 2 * I, H), fmt, group_size=group)
    q2 = quant.quantize(-torch.ones(E, H, I), fmt, group_size=group)
    top = 7 if fmt == "int4" else 127
    assert int((quant._int4_values(q13.data) if fmt == "int4" else q13.data).max()) == top
    x = torch.stack([torch.full((H,), 0.5), torch.full((H,), -0.5)])
    ids = torch.tensor([[0], [1]], dtype=torch.int32)
    _check_isas(ISAS, x, ids, torch.ones(2, 1), q13, q2)


@pytest.mark.parametrize("j0", [40, 41])
def test_every_fp8_byte_reads_exactly(j0):
    # Reads a column of w2 back through the op: x one-hot, w13 (fp8 1.0 and 0) makes h one-hot at
    # row j0 (an even k of a packed pair, then an odd one), so y = w2[:, j0] * h exactly (a 4-bit
    # weight times a bf16 h is exact in fp32, the scales are 1). Column j0 holds every byte that is
    # not NaN, the subnormals and both zeros included, in both signs; each must read as its value.
    H, I = 256, 128
    one = torch.tensor(1.0).to(torch.float8_e4m3fn).view(torch.uint8)
    w13 = torch.zeros(1, 2 * I, H, dtype=torch.uint8)
    w13[0, j0, 0] = w13[0, I + j0, 0] = one  # gate and up of row j0 read x[0]
    bytes_ = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F] + [0x38, 0xB8], dtype=torch.uint8)
    w2 = torch.zeros(1, H, I, dtype=torch.uint8)
    w2[0, :, j0] = bytes_
    blk = (128, 128)
    q13 = quant.from_fp8(w13.view(torch.float8_e4m3fn), torch.ones(1, 2, 2), blk)
    q2 = quant.from_fp8(w2.view(torch.float8_e4m3fn), torch.ones(1, 2, 1), blk)
    x = torch.zeros(1, H)
    x[0, 0] = 3.0
    ids, w = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    values = bytes_.view(torch.float8_e4m3fn).float()
    for isa in ISAS:
        y = hmoe.CPUExperts(q13, q2, isa=isa)(x, ids, w)[0]
        h = y[-2]  # the row of byte 0x38 (1.0)
        assert h > 0 and torch.equal(y, values * h), isa


def test_zero_weights_and_zero_activations():
    x, ids, w, q13, q2 = _problem(4, 64, 64, 2, 1, "int8", 32)
    q13 = quant.quantize(torch.zeros(2, 128, 64), "int8", group_size=32)
    assert torch.equal(hmoe.CPUExperts(q13, q2)(x, ids, w), torch.zeros_like(x))
    assert torch.equal(hmoe.CPUExperts(*_problem(4, 64, 64, 2, 1, "int4", 32)[3:])(torch.zeros_like(x), ids, w),
                       torch.zeros_like(x))


def test_attributes_bytes_and_repr():
    x, ids, w, q13, q2 = _problem(2, 256, 128, 3, 2, "int4", 128)
    e = hmoe.CPUExperts(q13, q2)
    assert (e.format, e.dtype, e.group13, e.group2) == ("int4", None, 128, 128)
    assert (e.num_experts, e.hidden_size, e.intermediate_size) == (3, 256, 128)
    # 16 columns a block, per group of 128: 1024 bytes of nibbles and 64 of scales
    assert e.packed_bytes == 3 * (2 * 8 * 2 * 1088 + 16 * 1 * 1088)
    assert "format='int4'" in repr(e) and "groups=(128, 128)" in repr(e)
    f = hmoe.CPUExperts(*_problem(2, 200, 128, 3, 2, "int8", None)[3:])  # per row: the whole row a group
    assert (f.format, f.group13, f.group2) == ("int8", 256, 128)
    b = hmoe.CPUExperts(torch.randn(3, 256, 256).bfloat16(), torch.randn(3, 256, 128).bfloat16())
    assert (b.format, b.dtype, b.group13) == ("bf16", torch.bfloat16, 0)


def test_pickle_and_custom_op_path():
    x, ids, w, q13, q2 = _problem(5, 128, 64, 4, 2, "fp8", (64, 64))
    e = hmoe.CPUExperts(q13, q2)
    y = e(x, ids, w)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.format, e2.group13) == ("fp8", 64) and torch.equal(e2(x, ids, w), y)
    assert torch.equal(library.cpu_experts_op(e, x, ids, w), y)
    torch.library.opcheck(library.cpu_experts_packed, (x, ids, w, e._w13, e._w2, e._layout, None))


def _bad(q13, q2, exc, match):
    with pytest.raises(exc, match=match):
        hmoe.CPUExperts(q13, q2)


def test_bad_quantised_weights():
    _, _, _, w13, w2 = random_problem(1, 128, 64, 2, 1, torch.float32, torch.float32)
    i8, i4 = quant.quantize(w13, "int8"), quant.quantize(w2, "int4", group_size=64)
    _bad(i8, i4, ValueError, "w13 is int8 and w2 is int4")
    _bad(i8, w2, TypeError, "both be QuantizedWeights or both float tensors")
    _bad(quant.quantize(w13[0], "int8"), quant.quantize(w2[0], "int8"), ValueError, r"shape \[E, N, K\]")
    f13 = quant.quantize(w13, "fp8", block=(128, 48))
    _bad(f13, quant.quantize(w2, "fp8", block=(128, 48)), ValueError, "blocks of 32, 64 or 128 columns")
    # w2 must be [E, H, I] for w13 [E, 2I, H]
    _bad(quant.quantize(w13, "int8"), quant.quantize(w2[:, :64], "int8"), ValueError, "must agree")
    # values the formats never produce
    bad = quant.quantize(w13, "int8")
    bad.data[1, 3, 5] = -128
    _bad(bad, quant.quantize(w2, "int8"), ValueError, r"-128 \(hmoe's int8 is \[-127, 127\]\).*expert 1")
    nan = quant.quantize(w13, "fp8")
    nan.data.view(torch.uint8)[0, 0, 0] = 0x7F
    _bad(nan, quant.quantize(w2, "fp8"), ValueError, "fp8 weights hold NaN")
    short = quant.quantize(w13, "int8")
    short.scales = short.scales[:, :10]
    _bad(short, quant.quantize(w2, "int8"), ValueError, r"w13 scales has shape \(2, 10, 1\), expected \(2, 128, 1\)")


def test_functional_op_points_to_cpuexperts():
    x, ids, w, q13, q2 = _problem(2, 64, 64, 2, 1, "int8", None)
    with pytest.raises(TypeError, match="CPUExperts"):
        hmoe.ops.moe_experts_cpu(x, ids, w, q13, q2)
