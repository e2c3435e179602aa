"""HybridMoE with the model on a GPU: routed experts on the CPU handed over on a side stream (doorbells
and host functions: hmoe/nn/_staging.py), shared experts and GPU-resident experts on the GPU, CUDA
graph capture of decode steps."""
import pytest
import torch

import hmoe.nn as hn
from hmoe import _reference

from . import models
from .test_hybrid_moe import check_gpu_experts_against_fp64

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rel(a, b):
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", ["v3", "v2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_patched_model_on_gpu_matches(kind, dtype):
    m = models.model(kind, dtype).cuda()
    ids = torch.randint(0, 128, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits
    report = hn.patch_model(m, progress=False)
    assert "stay on cuda" in str(report) and "taken from cuda" in str(report)
    moe = [b for b in m.modules() if isinstance(b, hn.HybridMoE)]
    assert moe and all(b.gate_weight.is_cuda and b.experts.packed_bytes > 0 for b in moe)
    with torch.no_grad():
        got = m(ids).logits
    assert got.dtype == dtype and got.is_cuda
    assert _rel(got, ref) <= _reference.tolerance("hybrid_model_logits", dtype)
    for b in moe:
        b.check()


def test_gpu_experts_on_the_gpu():
    m = models.model("v3").cuda()
    block = models.moe_blocks(m)[0]
    x = torch.randn(3, 5, 64, device="cuda")
    with torch.no_grad():
        want = block(x)
        some = hn.HybridMoE.from_hf(block, gpu_experts=[1, 2, 9])
        got = some(x)
        torch.cuda.synchronize()
    assert some.gpu_w13.is_cuda and some.experts.num_experts == 13
    assert some.gpu_w2.permute(0, 2, 1).is_contiguous()  # w2 [G, H, I] laid out as [G, I, H]
    assert _rel(got, want) <= 4 * _reference.unit_roundoff(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_gpu_experts_on_the_gpu_against_the_fp64_routed_sum(dtype):
    check_gpu_experts_against_fp64(dtype, "cuda")


HANDOVERS = ["doorbell", "host_func"]


@pytest.mark.parametrize("handover", HANDOVERS)
@pytest.mark.parametrize("kind", ["v3", "v2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_graph_replay_of_decode_steps_matches_eager(kind, dtype, handover, monkeypatch):
    monkeypatch.setenv("HMOE_CPU_HANDOVER", handover)
    m = models.model(kind, dtype).cuda()
    hn.patch_model(m, progress=False)
    prompt = torch.randint(0, 128, (2, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    eager = hn.GraphDecoder(m, batch_size=2, max_cache_len=40, capture=False).generate(prompt, 20)
    blocks = [b for b in m.modules() if isinstance(b, hn.HybridMoE)]
    for b in blocks:
        b.host_run_times()
    graphed = hn.GraphDecoder(m, batch_size=2, max_cache_len=40)
    got = graphed.generate(prompt, 20)
    assert graphed._graph is not None
    assert torch.equal(got, eager)
    for b in blocks:  # the prefill, the eager first step and 18 replays ran the CPU experts, each timed
        times = b.host_run_times()
        assert len(times) == 20 and min(times) > 0
    if dtype == torch.float32:
        with torch.no_grad():
            want = m.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)


@pytest.mark.parametrize("handover", HANDOVERS)
def test_host_job_failure_is_nan_then_raised(handover, monkeypatch):
    monkeypatch.setenv("HMOE_CPU_HANDOVER", handover)
    m = models.model("v3").cuda()
    block = hn.HybridMoE.from_hf(models.moe_blocks(m)[0])
    x = torch.randn(4, 64, device="cuda")
    with torch.no_grad():
        block(x)
        torch.cuda.synchronize()
        job = next(iter(block._jobs.values()))
        bad = torch.full((4, block.top_k), 99, dtype=torch.int32, device="cuda")
        stream = torch.cuda.current_stream()
        out = job.launch(x, bad, torch.ones(4, block.top_k, device="cuda"), stream).clone()
        torch.cuda.synchronize()
    assert torch.isnan(out).all()
    with pytest.raises(RuntimeError, match="CPU experts failed in an earlier step.*topk_ids holds 99"):
        block(x)


def test_capture_without_warm_up_says_so():
    m = models.model("v3").cuda()
    block = hn.HybridMoE.from_hf(models.moe_blocks(m)[0])
    x = torch.randn(3, 64, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="run one eager step with the same batch before capturing"):
        with torch.no_grad(), torch.cuda.graph(g):
            block(x)


def test_unknown_handover_is_refused(monkeypatch):
    m = models.model("v3").cuda()
    block = hn.HybridMoE.from_hf(models.moe_blocks(m)[0])
    monkeypatch.setenv("HMOE_CPU_HANDOVER", "telepathy")
    with pytest.raises(ValueError, match="HMOE_CPU_HANDOVER must be one of doorbell, host_func"):
        with torch.no_grad():
            block(torch.randn(2, 64, device="cuda"))


@pytest.mark.parametrize("handover", HANDOVERS)
def test_an_empty_batch_on_the_gpu(handover, monkeypatch):
    monkeypatch.setenv("HMOE_CPU_HANDOVER", handover)
    m = models.model("v3").cuda()
    block = hn.HybridMoE.from_hf(models.moe_blocks(m)[0])
    with torch.no_grad():
        y = block(torch.randn(0, 64, device="cuda"))
        torch.cuda.synchronize()
    assert y.shape == (0, 64) and y.is_cuda
