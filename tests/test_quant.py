"""hmoe.quant: int8 / int4 / fp8 quantised weights against a reference written out element by element."""
import pickle

import pytest
import torch

import hmoe
from hmoe import quant


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


@pytest.mark.parametrize("piece", [7 * 64, 3 * 128 * 40, 1 << 20])
def test_pieces_give_the_same_bytes(monkeypatch, piece):
    # quantize works through a stack in pieces of about quant._PIECE weights (whole matrices, or runs
    # of rows: a multiple of fp8's block rows); whatever their size, the bytes and scales are those of
    # one piece. Shapes with partial fp8 blocks (200 rows, 300 columns) and int8 per row.
    w = _w(3, 200, 384, seed=9, dtype=torch.bfloat16)
    whole = {(fmt, g): quant.quantize(w, fmt, group_size=g) for fmt, g in (("int8", None), ("int4", 32), ("fp8", None))}
    whole["fp8", "narrow"] = quant.quantize(w[..., :300], "fp8", block=(64, 32))
    monkeypatch.setattr(quant, "_PIECE", piece)
    for (fmt, g), want in whole.items():
        got = (quant.quantize(w[..., :300], "fp8", block=(64, 32)) if g == "narrow"
               else quant.quantize(w, fmt, group_size=g))
        assert got.data.shape == want.data.shape and got.scales.shape == want.scales.shape
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (fmt, g)
        assert torch.equal(got.scales, want.scales), (fmt, g)
    f8 = whole["fp8", None]
    as4 = quant.from_fp8(f8.data, f8.scales, to="int4", group_size=64)
    assert torch.equal(as4.data, quant.quantize(quant.dequantize(f8), "int4", group_size=64).data)
    bad = w.clone()
    bad[2, 199, 383] = float("inf")  # in the last piece
    with pytest.raises(ValueError, match="NaN or infinity"):
        quant.quantize(bad, "int4", group_size=32)


def test_pickle_round_trip():
    qw = quant.quantize(_w(5, 64), "int4", group_size=32)
    twin = pickle.loads(pickle.dumps(qw))
    assert repr(twin) == repr(qw) and torch.equal(twin.data, qw.data) and torch.equal(twin.scales, qw.scales)
    state = qw.__getstate__()
    state["version"] = 7
    with pytest.raises(ValueError, match="another hmoe version"):
        quant.QuantizedWeights.__new__(quant.QuantizedWeights).__setstate__(state)
    assert hmoe.quant is quant


def test_errors():
    w = _w(4, 64)
    with pytest.raises(ValueError, match="unknown format 'int3'"):
        quant.quantize(w, "int3")
    with pytest.raises(ValueError, match="group_size must be one of"):
        quant.quantize(w, "int4", group_size=48)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quant.quantize(w, "int8", group_size=True)
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
    f8 = w.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale_inv has shape \(2, 1\), expected \(1, 1\)"):
        quant.from_fp8(f8, torch.ones(2, 1))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quant.from_fp8(w, torch.ones(1, 1))
    with pytest.raises(ValueError, match="to must be None"):
        quant.from_fp8(f8, torch.ones(1, 1), to="fp4")
    for nan in (0x7F, 0xFF):  # both signs of e4m3fn's NaN, found piece by piece in a stack
        stack = torch.zeros(3, 4, 128, dtype=torch.float8_e4m3fn)
        stack.view(torch.uint8)[2, 3, 127] = nan
        with pytest.raises(ValueError, match="w_fp8 holds NaN"):
            quant.from_fp8(stack, torch.ones(3, 1, 1))
    edge = torch.tensor([448.0, -448.0, 0.0, -0.0]).to(torch.float8_e4m3fn).view(1, 4).expand(4, 4).contiguous()
    assert quant.from_fp8(edge, torch.ones(1, 1)).format == "fp8"  # the largest finite bytes 0x7E/0xFE are not NaN
    with pytest.raises(TypeError, match="expected QuantizedWeights"):
        quant.dequantize(w)
