"""hmoe's torch custom ops (hmoe.ops.library): opcheck, the same results as the eager ops, and
torch.compile(fullgraph=True) through them."""
import pytest
import torch

import hmoe
from hmoe.ops import library

from .experts_reference import random_problem

# No autograd formula (inference only): opcheck's autograd-registration test does not apply.
TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def _topk_args(device="cpu", T=5, E=16, bias=True):
    g = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E, generator=g).to(device)
    b = torch.randn(E, generator=g).to(device) if bias else None
    return (logits, 4, 4, 2, "sigmoid" if bias else "softmax", b, True, 2.5)


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_topk_op(T, bias):
    args = _topk_args(T=T, bias=bias)
    torch.library.opcheck(library.grouped_topk, args, test_utils=TESTS)
    w, ids = torch.ops.hmoe.grouped_topk(*args)
    w0, ids0 = hmoe.ops.grouped_topk(args[0], 4, n_group=4, topk_group=2, scoring=args[4], bias=args[5],
                                     renormalize=True, routed_scaling_factor=2.5)
    assert torch.equal(w, w0) and torch.equal(ids, ids0)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_experts_ops(x_dtype):
    x, ids, w, w13, w2 = random_problem(6, 32, 24, 5, 2, x_dtype, torch.bfloat16)
    torch.library.opcheck(library.moe_experts_cpu, (x, ids, w, w13, w2, None), test_utils=TESTS)
    assert torch.equal(torch.ops.hmoe.moe_experts_cpu(x, ids, w, w13, w2, None),
                       hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2))
    experts = hmoe.CPUExperts(w13, w2)
    packed = (x, ids, w, experts._w13, experts._w2, [experts._code, 5, 32, 24], None)
    torch.library.opcheck(library.cpu_experts_packed, packed, test_utils=TESTS)
    assert torch.equal(library.cpu_experts_op(experts, x, ids, w), experts(x, ids, w))


def test_fake_impls_refuse_wrong_ranks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(ValueError, match=r"router_logits must be \[T, E\]"):
            torch.ops.hmoe.grouped_topk(torch.empty(3), 2, 1, 1, "softmax", None, True, 1.0)
        with pytest.raises(ValueError, match=r"x must be \[T, H\]"):
            torch.ops.hmoe.moe_experts_cpu(torch.empty(3), torch.empty(1, 2), torch.empty(1, 2),
                                           torch.empty(2, 4, 3), torch.empty(2, 3, 2), None)


def test_compile_fullgraph_routing_and_experts():
    x, _, _, w13, w2 = random_problem(9, 32, 24, 8, 2, torch.float32, torch.float32)
    gate = torch.randn(8, 32)

    def moe(x):
        w, ids = torch.ops.hmoe.grouped_topk(x @ gate.T, 2, 1, 1, "softmax", None, False, 1.0)
        return torch.ops.hmoe.moe_experts_cpu(x, ids, w, w13, w2, None)

    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), moe(x))
    x2 = torch.randn(4, 32)  # another token count: the fake impls give the shapes
    assert torch.equal(compiled(x2), moe(x2))


def test_compile_hybrid_moe_fullgraph_and_small_model():
    transformers = pytest.importorskip("transformers", reason="the model test needs transformers")
    from tests.nn import models

    import hmoe.nn as hn

    m = models.model("v3")
    hn.patch_model(m, progress=False)
    block = next(b for b in m.modules() if isinstance(b, hn.HybridMoE))
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want = block(x)
        got = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, want)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        want = m(ids).logits
        got = torch.compile(m, backend="aot_eager")(ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert transformers


@pytest.mark.gpu
def test_cuda_ops():
    args = _topk_args("cuda", T=6)
    torch.library.opcheck(library.grouped_topk, args, test_utils=TESTS)
    B, H, P, page = 2, 16, 4, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 512, generator=g).bfloat16().cuda()
    qpe = torch.randn(B, H, 64, generator=g).bfloat16().cuda()
    ckv = torch.randn(P, page, 512, generator=g).bfloat16().cuda()
    kpe = torch.randn(P, page, 64, generator=g).bfloat16().cuda()
    pt = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32).cuda()
    lens = torch.tensor([100, 37], dtype=torch.int32).cuda()
    for lse in (True, False):
        a = (q, qpe, ckv, kpe, pt, lens, 0.07, lse, None)
        torch.library.opcheck(library.mla_decode, a, test_utils=TESTS)
        out, l = torch.ops.hmoe.mla_decode(*a)
        ref = hmoe.ops.mla_decode(q, qpe, ckv, kpe, pt, lens, sm_scale=0.07, return_lse=lse)
        assert torch.equal(out, ref[0] if lse else ref)
        assert torch.equal(l, ref[1]) if lse else l.shape == (0,)
