"""hmoe.load_experts on checkpoints the tests write: transformers' save_pretrained (per-expert names),
the fused layout, and DeepSeek-V3's fp8 layout with weight_scale_inv."""
import json

import pytest
import torch

import hmoe
from hmoe import quant

safetensors = pytest.importorskip("safetensors.torch", reason="load_experts reads safetensors")
models = pytest.importorskip("tests.nn.models", reason="needs transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
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
    experts = hmoe.CPUExperts(w13, w2)
    x = torch.randn(2, 160)
    y = experts(x, torch.tensor([[0, 2], [1, 0]], dtype=torch.int32), torch.ones(2, 2))
    assert y.shape == (2, 160) and torch.isfinite(y).all()


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
