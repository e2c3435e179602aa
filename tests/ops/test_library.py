"""hmoe's torch custom ops (hmoe.ops.library): opcheck, the same results as the eager ops, fake
implementations that refuse what the eager ops refuse, and torch.compile(fullgraph=True) through them."""
import json
import subprocess
import sys
import warnings

import pytest
import torch

import hmoe
from hmoe.ops import library

from .experts_reference import random_problem

# opcheck's default tests, test_autograd_registration included: the ops are not differentiable and say
# so with torch's fallthrough at the Autograd key (their outputs never require grad).


def _topk_args(device="cpu", T=5, E=16, bias=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E, generator=g).to(device, dtype)
    b = torch.randn(E, generator=g).to(device) if bias else None
    return (logits, 4, 4, 2, "sigmoid" if bias else "softmax", b, True, 2.5)


def _eager_topk(args):
    logits, k, n_group, topk_group, scoring, bias, renormalize, scale = args
    return hmoe.ops.grouped_topk(logits, k, n_group=n_group, topk_group=topk_group, scoring=scoring, bias=bias,
                                 renormalize=renormalize, routed_scaling_factor=scale)


@pytest.mark.parametrize("T,bias,dtype", [(1, True, torch.float32), (7, False, torch.float32),
                                          (7, True, torch.bfloat16), (3, True, torch.float16)], ids=str)
def test_grouped_topk_op(T, bias, dtype):
    args = _topk_args(T=T, bias=bias, dtype=dtype)
    torch.library.opcheck(library.grouped_topk, args)
    w, ids = torch.ops.hmoe.grouped_topk(*args)
    w0, ids0 = _eager_topk(args)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (T, 4)
    assert torch.equal(w, w0) and torch.equal(ids, ids0)


@pytest.mark.parametrize("x_dtype,w_dtype,ids_dtype,shape", [
    (torch.float32, torch.bfloat16, torch.int32, (6, 32, 24, 5, 2)),
    (torch.float16, torch.bfloat16, torch.int64, (1, 64, 32, 8, 4)),
    (torch.bfloat16, torch.bfloat16, torch.int32, (6, 32, 24, 5, 2)),
    (torch.bfloat16, torch.float32, torch.int64, (3, 32, 16, 4, 1)),
], ids=str)
def test_experts_ops(x_dtype, w_dtype, ids_dtype, shape):
    T, H, I, E, K = shape
    x, ids, w, w13, w2 = random_problem(T, H, I, E, K, x_dtype, w_dtype, ids_dtype, gen=torch.Generator().manual_seed(T))
    torch.library.opcheck(library.moe_experts_cpu, (x, ids, w, w13, w2, None))
    got = torch.ops.hmoe.moe_experts_cpu(x, ids, w, w13, w2, None)
    assert got.dtype == x_dtype and torch.equal(got, hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2))
    experts = hmoe.CPUExperts(w13, w2)
    packed = (x, ids, w, experts._w13, experts._w2, experts._layout, None)
    torch.library.opcheck(library.cpu_experts_packed, packed)
    assert torch.equal(library.cpu_experts_op(experts, x, ids, w), experts(x, ids, w))


def _bad_calls():
    """(id, eager call, the custom op's arguments) of calls the eager op refuses on rank, dtype or device
    (and grouped_topk on its sizes and scalars: top_k shapes its outputs)."""
    f32, i32 = torch.float32, torch.int32
    e = lambda *s, dtype=f32: torch.empty(*s, dtype=dtype)  # noqa: E731
    topk = lambda lg, bias=None, scoring="softmax", k=2, groups=1, kept=1, scale=1.0: (  # noqa: E731
        lambda: hmoe.ops.grouped_topk(lg, k, n_group=groups, topk_group=kept, scoring=scoring, bias=bias,
                                      routed_scaling_factor=scale),
        (library.grouped_topk, (lg, k, groups, kept, scoring, bias, True, scale)))
    exp = lambda x, ids, w, w13, w2: (  # noqa: E731
        lambda: hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2), (library.moe_experts_cpu, (x, ids, w, w13, w2, None)))
    ok = (e(1, 3), e(1, 2, dtype=i32), e(1, 2), e(2, 4, 3), e(2, 3, 2))
    q, c, pe = e(1, 16, 512, dtype=torch.bfloat16), e(2, 64, 512, dtype=torch.bfloat16), e(1, 16, 64)
    mla = lambda qn, qp: (  # noqa: E731
        lambda: hmoe.ops.mla_decode(qn, qp, c, c, e(1, 2, dtype=i32), e(1, dtype=i32), sm_scale=0.1),
        (library.mla_decode, (qn, qp, c, c, e(1, 2, dtype=i32), e(1, dtype=i32), 0.1, None)))
    return [
        ("topk-1d", *topk(e(3))),
        ("topk-int", *topk(e(3, 8, dtype=i32))),
        ("topk-meta", *topk(torch.empty(3, 8, device="meta"))),
        ("topk-scoring", *topk(e(3, 8), scoring="top")),
        ("topk-bias-softmax", *topk(e(3, 8), bias=e(8))),
        ("topk-bias-int", *topk(e(3, 8), bias=e(8, dtype=i32), scoring="sigmoid")),
        ("topk-no-experts", *topk(e(3, 0))),
        ("topk-k-above-experts", *topk(e(3, 8), k=9)),
        ("topk-k-0", *topk(e(3, 8), k=0)),
        ("topk-k-negative", *topk(e(3, 8), k=-1)),
        ("topk-k-above-kept-groups", *topk(e(3, 8), k=5, groups=4, kept=2)),
        ("topk-groups-not-dividing", *topk(e(3, 8), groups=3)),
        ("topk-kept-above-groups", *topk(e(3, 8), groups=2, kept=3)),
        ("topk-sigmoid-one-per-group", *topk(e(3, 8), scoring="sigmoid", groups=8)),
        ("topk-bias-shape", *topk(e(3, 8), bias=e(7), scoring="sigmoid")),
        ("topk-scale-nan", *topk(e(3, 8), scale=float("nan"))),
        ("experts-x-1d", *exp(e(3), *ok[1:])),
        ("experts-x-int", *exp(e(1, 3, dtype=i32), *ok[1:])),
        ("experts-ids-float", *exp(ok[0], e(1, 2), *ok[2:])),
        ("experts-weights-bf16", *exp(*ok[:2], e(1, 2, dtype=torch.bfloat16), *ok[3:])),
        ("experts-w13-2d", *exp(*ok[:3], e(8, 3), ok[4])),
        ("experts-mixed-weights", *exp(*ok[:4], e(2, 3, 2, dtype=torch.float16))),
        ("experts-x-H", *exp(e(1, 5), *ok[1:])),
        ("mla-q-on-cpu", *mla(q, pe)),  # the eager op's first complaint about CPU tensors
        ("mla-q-meta", *mla(q.to("meta"), pe)),  # "on the CUDA", as for CPU tensors
        ("mla-q-fp32", *mla(q.float(), pe)),
        ("mla-q-2d", *mla(q[0], pe)),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_fake_impls_raise_what_the_eager_ops_raise(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, eager, (op, args) = case
    with pytest.raises((TypeError, ValueError)) as want:
        eager()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(want.type) as got:
            op(*fake_args)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("case", [c for c in _bad_calls() if c[0].startswith("mla")], ids=lambda c: c[0])
def test_cuda_ops_on_cpu_tensors_raise_what_the_eager_op_raises(case):
    # not torch's "Could not run 'hmoe::mla_decode' with arguments from the 'CPU' backend"
    _, eager, (op, args) = case
    with pytest.raises((TypeError, ValueError)) as want:
        eager()
    for custom in (op, library.mla_decode_lse):
        with pytest.raises(want.type) as got:
            custom(*args)
        assert str(got.value) == str(want.value)


def _mla_shape_cases(make):
    """(id, mla_decode's custom-op arguments with one size, dtype or scalar wrong, the error and message of
    the eager op's checks) with tensors from make(*shape, dtype=...) on one CUDA device."""
    bf, i32 = torch.bfloat16, torch.int32
    B, H, P, page = 2, 16, 3, 64
    ok = dict(q_nope=make(B, H, 512, dtype=bf), q_pe=make(B, H, 64, dtype=bf), ckv=make(P, page, 512, dtype=bf),
              kpe=make(P, page, 64, dtype=bf), pt=make(B, 2, dtype=i32), lens=make(B, dtype=i32), sm_scale=0.1)
    cases = [
        ("q-dim", dict(q_nope=make(B, H, 256, dtype=bf)), ValueError,
         "q_nope has shape (2, 16, 256): the last dimension must be 512"),
        ("no-heads", dict(q_nope=make(B, 0, 512, dtype=bf), q_pe=make(B, 0, 64, dtype=bf)), ValueError,
         "q_nope has 0 heads; mla_decode supports 1 to 128"),
        ("129-heads", dict(q_nope=make(B, 129, 512, dtype=bf), q_pe=make(B, 129, 64, dtype=bf)), ValueError,
         "q_nope has 129 heads; mla_decode supports 1 to 128"),
        ("q_pe-shape", dict(q_pe=make(B, H, 32, dtype=bf)), ValueError, "q_pe has shape (2, 16, 32), expected (2, 16, 64)"),
        ("q_pe-fp16", dict(q_pe=make(B, H, 64, dtype=torch.float16)), TypeError,
         "q_pe has dtype float16, q_nope bfloat16: they must match"),
        ("ckv-fp16", dict(ckv=make(P, page, 512, dtype=torch.float16)), TypeError,
         "ckv_cache has dtype float16, q_nope bfloat16: they must match"),
        ("ckv-dim", dict(ckv=make(P, page, 576, dtype=bf)), ValueError,
         "ckv_cache has shape (3, 64, 576): the last dimension must be 512"),
        ("no-pages", dict(ckv=make(0, page, 512, dtype=bf), kpe=make(0, page, 64, dtype=bf)), ValueError,
         "ckv_cache has shape (0, 64, 512): no pages"),
        ("kpe-shape", dict(kpe=make(P, 32, 64, dtype=bf)), ValueError, "kpe_cache has shape (3, 32, 64), expected (3, 64, 64)"),
        ("page_table-batch", dict(pt=make(3, 2, dtype=i32)), ValueError,
         "page_table has shape (3, 2), expected [2, max_pages >= 1]"),
        ("seq_lens-batch", dict(lens=make(3, dtype=i32)), ValueError, "seq_lens has shape (3,), expected (2,)"),
        ("sm_scale-nan", dict(sm_scale=float("nan")), ValueError, "sm_scale must be finite in float32 (|x| <= 3.4e38), got nan"),
        ("sm_scale-inf", dict(sm_scale=float("inf")), ValueError, "sm_scale must be finite in float32 (|x| <= 3.4e38), got inf"),
    ]
    return [(name, tuple({**ok, **bad}.values()) + (None,), exc, msg) for name, bad, exc, msg in cases]


_MLA_SHAPE_IDS = [c[0] for c in _mla_shape_cases(lambda *s, dtype: torch.empty(*s, dtype=dtype))]


@pytest.mark.parametrize("i", range(len(_MLA_SHAPE_IDS)), ids=_MLA_SHAPE_IDS)
def test_mla_fakes_refuse_the_sizes_the_eager_op_refuses(i):
    # On fake CUDA tensors (no GPU needed): the fakes returned [B, H, 256] for a q_nope of last dimension 256
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        _, args, exc, msg = _mla_shape_cases(lambda *s, dtype: torch.empty(*s, dtype=dtype, device="cuda"))[i]
        for op in (library.mla_decode, library.mla_decode_lse):
            with pytest.raises(exc) as got:
                op(*args)
            assert str(got.value) == msg


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(_MLA_SHAPE_IDS)), ids=_MLA_SHAPE_IDS)
def test_mla_fake_shape_messages_are_the_eager_ops(i):
    _, args, exc, msg = _mla_shape_cases(lambda *s, dtype: torch.zeros(*s, dtype=dtype, device="cuda"))[i]
    with pytest.raises(exc) as got:
        hmoe.ops.mla_decode(*args[:6], sm_scale=args[6])
    assert str(got.value) == msg


def test_fake_packed_checks_layout_and_weights():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, ids, w, w13, w2 = random_problem(2, 32, 24, 4, 2, torch.float32, torch.bfloat16,
                                        gen=torch.Generator().manual_seed(0))
    experts = hmoe.CPUExperts(w13, w2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for bad in ("1,2", "1,2,3,4,5,x", ""):
            with pytest.raises(ValueError, match=r"layout must be 'weight format code"):
                library.cpu_experts_packed(x, ids, w, experts._w13, experts._w2, bad, None)
        with pytest.raises(TypeError, match=r"w13 \(packed\) must have dtype uint8; got float32"):
            library.cpu_experts_packed(x, ids, w, x.flatten(), experts._w2, experts._layout, None)
        with pytest.raises(ValueError, match=r"dimension 1 must be H \(the experts' hidden size\) = 32"):
            library.cpu_experts_packed(x[:, :16], ids, w, experts._w13, experts._w2, experts._layout, None)
    with pytest.raises(ValueError, match=r"layout must be 'weight format code"):
        library.cpu_experts_packed(x, ids, w, experts._w13, experts._w2, "1,2", None)
    assert experts._layout == ",".join(map(str, experts._dims))


def test_not_differentiable_outputs_never_require_grad():
    args = _topk_args(T=3)
    logits = args[0].clone().requires_grad_()
    x, ids, w, w13, w2 = random_problem(3, 32, 24, 4, 2, torch.float32, torch.float32,
                                        gen=torch.Generator().manual_seed(1))
    x.requires_grad_()
    w13.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "no autograd kernel" warning would be an error here
        outs = [*torch.ops.hmoe.grouped_topk(logits, *args[1:]), torch.ops.hmoe.moe_experts_cpu(x, ids, w, w13, w2, None)]
    assert not any(o.requires_grad for o in outs)  # as the eager ops' outputs
    torch.library.opcheck(library.grouped_topk, (logits, *args[1:]))  # test_autograd_registration has work to do
    assert not hmoe.ops.grouped_topk(logits, 4, n_group=4, topk_group=2)[0].requires_grad


def test_import_contract_and_reload():
    """import hmoe / hmoe.ops registers nothing; hmoe.ops.library registers once and survives a reload."""
    code = """
import importlib, json, sys
import hmoe, hmoe.ops
before = "hmoe.ops.library" in sys.modules
import torch
import hmoe.ops.library as lib
import hmoe.ops.library
importlib.reload(lib)
w, ids = torch.ops.hmoe.grouped_topk(torch.randn(2, 8), 2, 1, 1, "softmax", None, True, 1.0)
print(json.dumps({"before": before, "shape": list(w.shape), "same": lib.grouped_topk is torch.ops.hmoe.grouped_topk.default}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"before": False, "shape": [2, 2], "same": True}


def _moe_fn():
    x, _, _, w13, w2 = random_problem(9, 32, 24, 8, 2, torch.float32, torch.float32,
                                      gen=torch.Generator().manual_seed(2))
    gate = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))

    def moe(x):
        w, ids = torch.ops.hmoe.grouped_topk(x @ gate.T, 2, 1, 1, "softmax", None, False, 1.0)
        return torch.ops.hmoe.moe_experts_cpu(x, ids, w, w13, w2, None) + x

    return moe, x


def test_compile_fullgraph_routing_and_experts():
    moe, x = _moe_fn()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), moe(x))
    x2 = torch.randn(4, 32)  # another token count: the fake impls give the shapes
    assert torch.equal(compiled(x2), moe(x2))


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
def test_compile_fullgraph_inductor():
    """The default backend (inductor, C++ codegen for the residual add): about 10 s cold on 2 cores."""
    torch._dynamo.reset()
    moe, x = _moe_fn()
    compiled = torch.compile(moe, fullgraph=True)
    assert torch.equal(compiled(x), moe(x))
    x2 = torch.randn(4, 32)
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
    torch.library.opcheck(library.grouped_topk, args)
    w, ids = torch.ops.hmoe.grouped_topk(*args)
    w0, ids0 = _eager_topk(args)
    assert w.is_cuda and torch.equal(w, w0) and torch.equal(ids, ids0)
    B, H, P, page = 2, 16, 4, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 512, generator=g).bfloat16().cuda()
    qpe = torch.randn(B, H, 64, generator=g).bfloat16().cuda()
    ckv = torch.randn(P, page, 512, generator=g).bfloat16().cuda()
    kpe = torch.randn(P, page, 64, generator=g).bfloat16().cuda()
    pt = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32).cuda()
    lens = torch.tensor([100, 37], dtype=torch.int32).cuda()
    a = (q, qpe, ckv, kpe, pt, lens, 0.07, None)
    torch.library.opcheck(library.mla_decode, a)
    torch.library.opcheck(library.mla_decode_lse, a)
    out, (out_l, lse) = torch.ops.hmoe.mla_decode(*a), torch.ops.hmoe.mla_decode_lse(*a)
    ref, ref_lse = hmoe.ops.mla_decode(q, qpe, ckv, kpe, pt, lens, sm_scale=0.07, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(out_l, ref) and torch.equal(lse, ref_lse)
    assert lse.dtype == torch.float32 and lse.shape == (B, H)
