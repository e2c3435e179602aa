"""decode_linear on the GPU against an fp64 matmul (the dtype-derived tolerance of hmoe._reference),
for the row counts, widths and dtypes of a decode step; its checks, with and without a GPU."""
import pytest
import torch

import hmoe
from hmoe import _reference
from hmoe.ops import linear


def rel(got, want):
    assert torch.isfinite(got).all(), "NaN or inf in the output"
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp32_out", [False, True])
def test_shapes_against_fp64(dtype, fp32_out):
    g = torch.Generator().manual_seed(1)
    out_dtype = torch.float32 if fp32_out else None
    for M, N, K in ((1, 3072, 2048), (1, 576, 2048), (1, 64, 2048), (2, 7, 8), (3, 2048, 2048), (5, 1, 7168),
                    (8, 1536, 7168), (9, 100, 64), (16, 33, 520), (0, 5, 16)):
        x = torch.randn(M, K, generator=g).to(dtype).cuda()
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).cuda()
        y = hmoe.ops.decode_linear(x, w, out_dtype=out_dtype)
        assert y.shape == (M, N) and y.dtype == (out_dtype or dtype) and y.is_contiguous()
        if M:
            want = x.double() @ w.double().T
            assert rel(y, want) <= _reference.tolerance("decode_linear", y.dtype), (M, N, K)


@pytest.mark.gpu
def test_nan_stays_in_its_row_and_graph_replay():
    x = torch.randn(3, 256, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(40, 256, dtype=torch.bfloat16, device="cuda")
    x[1, 7] = float("nan")
    y = hmoe.ops.decode_linear(x, w)
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()
    hmoe.prewarm()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = hmoe.ops.decode_linear(x, w, out_dtype=torch.float32)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel(y, x.double() @ w.double().T) <= _reference.tolerance("decode_linear", torch.float32)


@pytest.mark.gpu
def test_bad_input_on_gpu():
    x = torch.randn(2, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(8, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(TypeError, match="weight must have dtype"):
        hmoe.ops.decode_linear(x, w.half())
    with pytest.raises(ValueError, match=r"weight must be \[N, 64\]"):
        hmoe.ops.decode_linear(x, w[:, :32].contiguous())
    with pytest.raises(ValueError, match="17 rows; decode_linear takes at most 16"):
        hmoe.ops.decode_linear(torch.zeros(17, 64, dtype=torch.bfloat16, device="cuda"), w)
    with pytest.raises(ValueError, match="multiple of 8"):
        hmoe.ops.decode_linear(x[:, :60].contiguous(), w[:, :60].contiguous())
    with pytest.raises(ValueError, match="16-byte boundary"):
        hmoe.ops.decode_linear(x.view(-1)[4:68].view(1, 64), w)
    with pytest.raises(ValueError, match="contiguous"):
        hmoe.ops.decode_linear(x, w.t().contiguous().t())
    with pytest.raises(TypeError, match="out_dtype must be None"):
        hmoe.ops.decode_linear(x, w, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="must be on the CUDA"):
        hmoe.ops.decode_linear(x, w.cpu())


def test_bad_input_without_gpu():
    assert linear.MAX_ROWS == 16
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        hmoe.ops.decode_linear([1.0], None)
    with pytest.raises(ValueError, match="must be on the CUDA"):
        hmoe.ops.decode_linear(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.bfloat16))
