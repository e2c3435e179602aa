"""hmoe.load_experts on checkpoints the tests write: transformers' save_pretrained (per-expert names),
the fused layout, and DeepSeek-V3's fp8 layout with weight_scale_inv."""
import json
import re

import pytest
import torch

import hmoe
from hmoe import _reference, quant

safetensors = pytest.importorskip("safetensors.torch", reason="load_experts reads safetensors")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    models = pytest.importorskip("tests.nn.models", reason="needs transformers")
    m = models.model("v3", torch.bfloat16)
    path = tmp_path_factory.mktemp("ck")
    m.save_pretrained(path)
    return path, models.moe_blocks(m)


def test_per_expert_layout_from_save_pretrained(saved):
    path, blocks = saved
    for layer, block in zip((1, 2), blocks):
        w13, w2 = hmoe.load_experts(str(path), layer, progress=False)
        assert w13.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16
        assert torch.equal(w13, block.experts.gate_up_proj.detach())
        assert torch.equal(w2, block.experts.down_proj.detach())


def test_quantised_on_the_fly(saved):
    path, blocks = saved
    w13, w2 = hmoe.load_experts(str(path), 1, quant="int4", group_size=32, progress=False)
    ref = blocks[0].experts
    assert isinstance(w13, quant.QuantizedWeights) and w13.shape == tuple(ref.gate_up_proj.shape)
    want = quant.quantize(ref.gate_up_proj.detach(), "int4", group_size=32)
    assert torch.equal(w13.data, want.data) and torch.equal(w13.scales, want.scales)
    assert torch.equal(quant.dequantize(w2), quant.dequantize(quant.quantize(ref.down_proj.detach(), "int4",
                                                                              group_size=32)))
    _run_quantised(w13, w2)


def _run_quantised(w13, w2):
    """Loaded QuantizedWeights run as they are by CPUExperts, within the format's contract tolerance."""
    from hmoe import _reference

    g = torch.Generator().manual_seed(3)
    E, H = w13.shape[0], w13.shape[2]
    x = torch.randn(6, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(6)]).int()
    w = torch.rand(6, 2, generator=g)
    experts = hmoe.CPUExperts(w13, w2)
    y, ref = experts(x, ids, w), _reference.moe_experts(x, ids, w, w13, w2)
    assert experts.format == w13.format and y.dtype == torch.bfloat16
    assert ((y.double() - ref).norm() / ref.norm()).item() < _reference.tolerance("moe_experts", x.dtype,
                                                                                  w_dtype=w13.format)


def test_fused_layout_and_a_single_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    gu, down = torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g)
    f = tmp_path / "experts.safetensors"
    safetensors.save_file({"model.layers.3.mlp.experts.gate_up_proj": gu,
                           "model.layers.3.mlp.experts.down_proj": down}, str(f))
    w13, w2 = hmoe.load_experts(str(f), 3, progress=False)
    assert torch.equal(w13, gu) and torch.equal(w2, down)


def _fp8_checkpoint(tmp_path, E=3, H=160, inter=128):
    """DeepSeek-V3's layout: float8_e4m3fn weights with fp32 weight_scale_inv per 128x128 block, sharded
    in two files with an index."""
    g = torch.Generator().manual_seed(1)
    tensors, want13, want2 = {}, [], []
    for e in range(E):
        parts = {}
        for name, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
            qw = quant.quantize(torch.randn(*shape, generator=g), "fp8")
            key = f"model.layers.5.mlp.experts.{e}.{name}"
            tensors[key + ".weight"], tensors[key + ".weight_scale_inv"] = qw.data, qw.scales
            parts[name] = quant.dequantize(qw)
        want13.append(torch.cat([parts["gate_proj"], parts["up_proj"]]))
        want2.append(parts["down_proj"])
    keys = sorted(tensors)
    shard_of = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(keys)}
    for shard in set(shard_of.values()):
        safetensors.save_file({k: tensors[k] for k in keys if shard_of[k] == shard}, str(tmp_path / shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shard_of}))
    return torch.stack(want13), torch.stack(want2)


def test_fp8_checkpoint(tmp_path):
    want13, want2 = _fp8_checkpoint(tmp_path)
    w13, w2 = hmoe.load_experts(str(tmp_path), 5, dtype=torch.float32, progress=False)
    assert torch.equal(w13, want13) and torch.equal(w2, want2)
    b13, _ = hmoe.load_experts(str(tmp_path), 5, progress=False)
    assert b13.dtype == torch.bfloat16 and torch.equal(b13, want13.bfloat16())
    k13, k2 = hmoe.load_experts(str(tmp_path), 5, quant="fp8", progress=False)
    # With I a multiple of 128 (DeepSeek-V3: 2048) w13's blocks are the checkpoint's: re-blocking is exact
    assert torch.equal(quant.dequantize(k13), want13)
    _run_quantised(k13, k2)  # H = 160: a partial block of columns
    for fmt, group in (("int8", None), ("int4", 32)):  # gate and up quantised apart: the bits of both together
        i13, i2 = hmoe.load_experts(str(tmp_path), 5, quant=fmt, group_size=group, progress=False)
        for got, want in ((i13, want13), (i2, want2)):
            ref = quant.quantize(want, fmt, group_size=group)
            assert got.shape == ref.shape and torch.equal(got.data, ref.data) and torch.equal(got.scales, ref.scales)
    experts = hmoe.CPUExperts(w13, w2)
    x = torch.randn(2, 160)
    ids, w = torch.tensor([[0, 2], [1, 0]], dtype=torch.int32), torch.ones(2, 2)
    y = experts(x, ids, w)
    assert y.shape == (2, 160) and torch.isfinite(y).all()
    ref = _reference.moe_experts(x, ids, w, want13, want2)  # the checkpoint's weights, not the loaded ones
    assert ((y.double() - ref).norm() / ref.norm()).item() < _reference.tolerance("moe_experts", x.dtype,
                                                                                  w_dtype=w13.dtype)


def test_errors(saved, tmp_path):
    path, _ = saved
    with pytest.raises(KeyError, match="no routed experts under 'model.layers.0.mlp.experts.'"):
        hmoe.load_experts(str(path), 0, progress=False)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory"):
        hmoe.load_experts(str(tmp_path / "nope"), 1)
    with pytest.raises(FileNotFoundError, match="no .safetensors file"):
        hmoe.load_experts(str(tmp_path), 1)
    with pytest.raises(ValueError, match="quant must be"):
        hmoe.load_experts(str(path), 1, quant="int2")
    with pytest.raises(ValueError, match="layer must be"):
        hmoe.load_experts(str(path), -1)
    f = tmp_path / "gap.safetensors"
    w = torch.zeros(4, 4)
    safetensors.save_file({f"model.layers.1.mlp.experts.{e}.{n}.weight": w.clone() for e in (0, 2)
                           for n in ("gate_proj", "up_proj", "down_proj")}, str(f))
    with pytest.raises(ValueError, match=r"experts \[1\] of layer 1 are missing"):
        hmoe.load_experts(str(f), 1)


def _per_expert(path, shapes, layer=1, drop=()):
    """A per-expert checkpoint: expert e's gate/up [I, H] and down [H, I] for (I, H) = shapes[e]."""
    g = torch.Generator().manual_seed(2)
    p = f"model.layers.{layer}.mlp.experts."
    tensors = {f"{p}{e}.{n}.weight": torch.randn(*(s if n != "down_proj" else s[::-1]), generator=g)
               for e, s in enumerate(shapes) for n in ("gate_proj", "up_proj", "down_proj")}
    safetensors.save_file({k: v for k, v in tensors.items() if k not in drop}, str(path / "model.safetensors"))


@pytest.mark.parametrize("quant_format", [None, "int8", "int4", "fp8"])
@pytest.mark.parametrize("shape1", [(32, 1), (64, 64)], ids=["H", "I"])
def test_an_expert_whose_shapes_differ_from_expert_0s_is_refused(tmp_path, quant_format, shape1):
    # H = 1 used to broadcast one column into w13[1] (silent garbage); another I failed inside copy_
    _per_expert(tmp_path, [(32, 64), shape1])
    loaded = None
    with pytest.raises(ValueError) as err:
        loaded = hmoe.load_experts(str(tmp_path), 1, quant=quant_format, group_size=32 if quant_format == "int4" else None,
                                   progress=False)
    assert loaded is None
    msg = str(err.value)
    assert "layer 1, expert 1" in msg and "model.layers.1.mlp.experts.1.gate_proj.weight" in msg
    assert f"shape {shape1}, expected (32, 64)" in msg


def _fused(path, **tensors):
    safetensors.save_file({f"model.layers.3.mlp.experts.{k}": v for k, v in tensors.items()}, str(path / "m.safetensors"))


def test_fused_fp8_is_refused(tmp_path):
    # Read as plain floats, fp8 values up to 448 stood for weights of about 0.03 (silent garbage)
    g = torch.Generator().manual_seed(4)
    gu, down = quant.quantize(torch.randn(4, 16, 8, generator=g) * 0.01, "fp8"), quant.quantize(
        torch.randn(4, 8, 8, generator=g) * 0.01, "fp8")
    _fused(tmp_path, gate_up_proj=gu.data, gate_up_proj_scale_inv=gu.scales, down_proj=down.data,
           down_proj_scale_inv=down.scales)
    with pytest.raises(TypeError, match="gate_up_proj is a fused float8_e4m3fn stack, which hmoe does not read"):
        hmoe.load_experts(str(tmp_path), 3, progress=False)
    _fused(tmp_path, gate_up_proj=gu.dequantize(), down_proj=down.data)  # no scales; fp8 only in down_proj
    with pytest.raises(TypeError, match="down_proj is a fused float8_e4m3fn stack"):
        hmoe.load_experts(str(tmp_path), 3, quant="int8", progress=False)


def test_fused_dtypes_and_shapes_are_checked(tmp_path):
    gu, down = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    _fused(tmp_path, gate_up_proj=gu.to(torch.int8), down_proj=down.to(torch.int8))
    with pytest.raises(TypeError, match=r"gate_up_proj has dtype torch.int8; expected a float weight"):
        hmoe.load_experts(str(tmp_path), 3, progress=False)
    for bad in (down[:2], torch.randn(4, 8, 5), down[0]):  # fewer experts; another I; not a stack
        _fused(tmp_path, gate_up_proj=gu, down_proj=bad)
        with pytest.raises(ValueError) as err:
            hmoe.load_experts(str(tmp_path), 3, progress=False)
        assert (f"layer 3: model.layers.3.mlp.experts.gate_up_proj (4, 16, 8) and model.layers.3.mlp.experts.down_proj "
                f"{tuple(bad.shape)} do not fit [E, 2I, H] and [E, H, I]") in str(err.value)
    _fused(tmp_path, gate_up_proj=gu.bfloat16(), down_proj=down.bfloat16())
    w13, w2 = hmoe.load_experts(str(tmp_path), 3, quant="int8", progress=False)
    assert torch.equal(w13.data, quant.quantize(gu.bfloat16(), "int8").data)
    assert torch.equal(w2.scales, quant.quantize(down.bfloat16(), "int8").scales)


@pytest.mark.parametrize("present", ["gate_up_proj", "down_proj"])
def test_a_missing_fused_tensor_is_named(tmp_path, present):
    _fused(tmp_path, **{present: torch.randn(4, 16, 8)})
    missing = "down_proj" if present == "gate_up_proj" else "gate_up_proj"
    with pytest.raises(ValueError, match=re.escape(f"layer 3: model.layers.3.mlp.experts.{missing} is missing from "
                                                   f"'{tmp_path}'")):
        hmoe.load_experts(str(tmp_path), 3, progress=False)


def test_a_missing_per_expert_tensor_is_named(tmp_path):
    _per_expert(tmp_path, [(8, 16)] * 2, drop={"model.layers.1.mlp.experts.1.up_proj.weight"})
    with pytest.raises(ValueError, match=re.escape(f"layer 1: model.layers.1.mlp.experts.1.up_proj.weight is missing "
                                                   f"from '{tmp_path}'")):
        hmoe.load_experts(str(tmp_path), 1, progress=False)


@pytest.mark.parametrize("text, what", [('{"weight_map": {', "is not valid JSON"),
                                        ("[]", 'has no "weight_map"'),
                                        ('{"weight_map": {"a": 1}}', 'has no "weight_map"')])
def test_a_corrupt_index_is_named(tmp_path, text, what):
    _per_expert(tmp_path, [(8, 16)])
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"load_experts: {index} {what}")):
        hmoe.load_experts(str(tmp_path), 1, progress=False)


def test_scales_beside_a_weight_that_is_not_fp8_are_refused(tmp_path):
    # weight_scale_inv means something only for float8_e4m3fn weights; beside a bf16 weight it was ignored
    p = "model.layers.1.mlp.experts.0."
    g = torch.Generator().manual_seed(6)
    tensors = {f"{p}{n}.weight": torch.randn(*s, generator=g).bfloat16()
               for n, s in (("gate_proj", (8, 16)), ("up_proj", (8, 16)), ("down_proj", (16, 8)))}
    tensors[f"{p}up_proj.weight_scale_inv"] = torch.ones(1, 1)
    safetensors.save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"{p}up_proj.weight has dtype torch.bfloat16 but "
                                                   f"{p}up_proj.weight_scale_inv beside it")):
        hmoe.load_experts(str(tmp_path), 1, progress=False)


def test_an_index_that_names_the_wrong_shard_is_named(tmp_path):
    _per_expert(tmp_path, [(8, 16)] * 2)
    safetensors.save_file({"other": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    names = list(safetensors.safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    wrong = "model.layers.1.mlp.experts.1.down_proj.weight"
    weight_map = {n: "other.safetensors" if n == wrong else "model.safetensors" for n in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=re.escape(f"layer 1: {wrong} is not in {tmp_path / 'other.safetensors'}, "
                                                   "the shard model.safetensors.index.json names for it")):
        hmoe.load_experts(str(tmp_path), 1, progress=False)


def test_arguments_it_cannot_honour_are_refused(saved, tmp_path):
    path, _ = saved
    # the layers listed are those with routed experts (layer 0, dense, was listed as an MoE layer)
    for layer in (0, 3):
        with pytest.raises(KeyError, match=r"MoE layers seen: \['model.layers.1', 'model.layers.2'\]"):
            hmoe.load_experts(str(path), layer, progress=False)
    # a dtype CPUExperts does not take (torch.int8 truncated every weight to 0 without a word)
    for dtype in (torch.int8, "bfloat16"):
        with pytest.raises(ValueError, match="dtype must be None"):
            hmoe.load_experts(str(path), 1, dtype=dtype, progress=False)
    # fp8 is scaled per block: a group_size was dropped without a word
    with pytest.raises(ValueError, match="fp8 is scaled per block"):
        hmoe.load_experts(str(path), 1, quant="fp8", group_size=32, progress=False)
    # a file that is not safetensors (safetensors' own "header too large" before)
    with pytest.raises(ValueError, match=r"config.json' is not a safetensors file"):
        hmoe.load_experts(str(path / "config.json"), 1, progress=False)
    # a group_size without quant was dropped without a word
    with pytest.raises(ValueError, match="group_size=64 applies to quant='int8' or 'int4'"):
        hmoe.load_experts(str(path), 1, group_size=64, progress=False)


def test_a_numpy_layer_index_is_taken(saved):
    np = pytest.importorskip("numpy")
    path, blocks = saved
    w13, _ = hmoe.load_experts(str(path), np.int64(1), progress=False)
    assert torch.equal(w13, blocks[0].experts.gate_up_proj.detach())
