"""rms_norm on the GPU against hmoe._reference.rms_norm (fp64; rounded where transformers' RMSNorm
rounds, and not rounded) and against transformers' own DeepSeek RMSNorm; its checks, with and without
a GPU."""
import pytest
import torch

import hmoe
from hmoe import _reference


def rel(got, want):
    assert torch.isfinite(got).all(), "NaN or inf in the output"
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shapes_against_fp64(dtype):
    g = torch.Generator().manual_seed(1)
    for shape in ((1, 2048), (3, 1, 512), (512, 2048), (2, 7168), (1, 8), (5, 8192), (0, 64)):
        x = (torch.randn(shape, generator=g) * 4).to(dtype).cuda()
        w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(dtype).cuda()
        y = hmoe.ops.rms_norm(x, w, eps=1e-6)
        assert y.shape == x.shape and y.dtype == dtype
        if x.numel():
            assert rel(y, _reference.rms_norm(x, w, 1e-6, contract=False)) <= _reference.tolerance("rms_norm", dtype)
            assert rel(y, _reference.rms_norm(x, w, 1e-6)) <= _reference.tolerance("rms_norm_same_rounding", dtype)


@pytest.mark.gpu
def test_same_as_transformers_deepseek_rmsnorm():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    norm = v3.DeepseekV3RMSNorm(2048, eps=1e-6).cuda().to(torch.bfloat16)
    norm.weight.data.normal_(1, 0.2)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    want = norm(x)
    got = hmoe.ops.rms_norm(x, norm.weight, eps=norm.variance_epsilon)
    assert (got != want).float().mean() < 1e-2  # the same rounding points; the fp32 sums differ in order
    assert rel(got, want) <= _reference.tolerance("rms_norm_same_rounding", torch.bfloat16)


@pytest.mark.gpu
def test_graph_replay():
    x = torch.randn(2, 1024, device="cuda", dtype=torch.float16)
    w = torch.rand(1024, device="cuda", dtype=torch.float16)
    hmoe.prewarm()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = hmoe.ops.rms_norm(x, w, eps=1e-5)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert rel(y, _reference.rms_norm(x, w, 1e-5)) <= _reference.tolerance("rms_norm_same_rounding", torch.float16)


@pytest.mark.gpu
def test_bad_input_on_gpu():
    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="weight must have dtype"):
        hmoe.ops.rms_norm(x, w.half(), eps=1e-6)
    with pytest.raises(ValueError, match="weight has shape"):
        hmoe.ops.rms_norm(x, w[:32], eps=1e-6)
    with pytest.raises(ValueError, match="multiples of 8 up to 8192"):
        hmoe.ops.rms_norm(x[:, :60].contiguous(), w[:60], eps=1e-6)
    with pytest.raises(ValueError, match="multiples of 8 up to 8192"):
        hmoe.ops.rms_norm(torch.zeros(1, 8200, device="cuda", dtype=torch.bfloat16),
                          torch.zeros(8200, device="cuda", dtype=torch.bfloat16), eps=1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        hmoe.ops.rms_norm(x.t(), w[:2], eps=1e-6)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        hmoe.ops.rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="must be on the CUDA"):
        hmoe.ops.rms_norm(x, w.cpu(), eps=1e-6)


def test_bad_input_without_gpu():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        hmoe.ops.rms_norm("x", None, eps=1e-6)
    with pytest.raises(ValueError, match="must be on the CUDA"):
        hmoe.ops.rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16), eps=1e-6)


def test_fused_norm_on_the_cpu_matches_transformers():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2

    from hmoe.nn._hf import FusedRMSNorm

    norm = v2.DeepseekV2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    norm.weight.data.normal_(1, 0.2)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    got = FusedRMSNorm(norm.weight, norm.variance_epsilon)(x)
    assert got.dtype == torch.bfloat16
    assert rel(got, norm(x)) <= _reference.tolerance("rms_norm_same_rounding", torch.bfloat16)
