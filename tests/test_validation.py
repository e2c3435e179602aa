"""Tensor arguments with no real memory behind them (FakeTensor, wrapper subclasses, other
subclasses, null storage, lazy neg/conj views) and out-of-range scalars are refused by every op
before native code runs; nn.Parameter is a plain tensor and is accepted."""
import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hmoe
from hmoe import validation as V

from .ops.experts_reference import random_problem


class Sub(torch.Tensor):
    """A subclass without its own dispatch: it has storage, but hmoe cannot know what it means."""


class Wrapper(torch.Tensor):
    """A wrapper subclass (like DTensor or a quantised tensor): no storage of its own."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Wrapper does not implement {func}")


def _null_storage(t):
    """A tensor of t's shape and dtype whose storage pointer is 0."""
    st = torch._C._construct_storage_from_data_pointer(0, t.device, t.numel() * t.element_size())
    return torch.empty(0, dtype=t.dtype).set_(st, 0, t.shape, t.stride())


BAD = {  # kind -> (make, exception)
    "fake": (lambda t: FakeTensorMode().from_tensor(t), TypeError),
    "wrapper": (Wrapper, TypeError),
    "subclass": (lambda t: t.as_subclass(Sub), TypeError),
    "null_storage": (_null_storage, ValueError),
    "neg_view": (torch._neg_view, ValueError),
}


def _experts_args():
    x, ids, w, w13, w2 = random_problem(5, 40, 24, 4, 2, torch.float32, torch.bfloat16)
    return {"x": x, "topk_ids": ids, "topk_weights": w, "w13": w13, "w2": w2}


def _call_functional(a):
    return hmoe.ops.moe_experts_cpu(a["x"], a["topk_ids"], a["topk_weights"], a["w13"], a["w2"])


def _call_class(a):
    return hmoe.CPUExperts(a["w13"], a["w2"])(a["x"], a["topk_ids"], a["topk_weights"])


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch warns when a FakeTensor's data_ptr is read
@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("arg", ["x", "topk_ids", "topk_weights", "w13", "w2"])
@pytest.mark.parametrize("call", [_call_functional, _call_class], ids=["moe_experts_cpu", "CPUExperts"])
def test_experts_refuse_tensors_without_memory(kind, arg, call):
    make, exc = BAD[kind]
    a = _experts_args()
    a[arg] = make(a[arg])
    with pytest.raises(exc, match=rf"^{arg} (is|has) "):  # the message is about arg ("x" is in most messages)
        call(a)


@pytest.mark.parametrize("arg", ["x", "topk_ids", "topk_weights", "w13", "w2"])
def test_neg_views_are_refused_outside_the_main_thread(arg):
    # There the neg bit of a CPU tensor is read from its dispatch keys, not by is_neg() (which
    # releases the GIL: a daemon thread inside it at exit aborted the process): the same refusal.
    a = _experts_args()
    a[arg] = torch._neg_view(a[arg])
    caught = []

    def run():
        for call in (_call_functional, _call_class):
            try:
                call(a)
            except ValueError as e:
                caught.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(caught) == 2 and all(m.startswith(f"{arg} is a lazily negated") for m in caught), caught


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("arg", ["router_logits", "bias"])
def test_grouped_topk_refuses_tensors_without_memory(kind, arg):
    make, exc = BAD[kind]
    a = {"router_logits": torch.randn(6, 16), "bias": torch.randn(16)}
    a[arg] = make(a[arg])
    with pytest.raises(exc, match=rf"^grouped_topk: {arg} (is|has) "):
        hmoe.ops.grouped_topk(a["router_logits"], 2, n_group=4, topk_group=2, scoring="sigmoid",
                              bias=a["bias"])


def _mla_args(device):
    a = {"q_nope": torch.randn(2, 16, 512).bfloat16(), "q_pe": torch.randn(2, 16, 64).bfloat16(),
         "ckv_cache": torch.randn(4, 16, 512).bfloat16(), "kpe_cache": torch.randn(4, 16, 64).bfloat16(),
         "page_table": torch.zeros(2, 2, dtype=torch.int32), "seq_lens": torch.ones(2, dtype=torch.int32)}
    return {k: v.to(device) for k, v in a.items()}


MLA_ARGS = ["q_nope", "q_pe", "ckv_cache", "kpe_cache", "page_table", "seq_lens"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("arg", [pytest.param(a, marks=pytest.mark.gpu) for a in MLA_ARGS])
def test_mla_decode_refuses_tensors_without_memory(kind, arg):
    make, exc = BAD[kind]
    if kind == "null_storage":  # a CUDA storage at address 0
        make = lambda t: torch.empty(0, dtype=t.dtype, device=t.device).set_(  # noqa: E731
            torch._C._construct_storage_from_data_pointer(0, t.device, t.numel() * t.element_size()),
            0, t.shape, t.stride())
    a = _mla_args("cuda")
    a[arg] = make(a[arg])
    with pytest.raises(exc, match=arg):
        hmoe.ops.mla_decode(**a, sm_scale=0.1)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["fake", "wrapper", "subclass"])
def test_mla_decode_refuses_subclasses_without_a_gpu(kind):
    # q_nope is checked first, its type before its device: this runs on any machine.
    make, exc = BAD[kind]
    a = _mla_args("cpu")
    a["q_nope"] = make(a["q_nope"])
    with pytest.raises(exc, match="q_nope"):
        hmoe.ops.mla_decode(**a, sm_scale=0.1)


def test_meta_tensors_are_refused_naming_the_device_the_op_wants():
    # Not "must be on the CPU or CUDA" for an op that takes CUDA (or CPU) tensors only.
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    a = _mla_args("cpu")
    with pytest.raises(ValueError, match=r"^q_nope must be on the CUDA, got device meta$"):
        hmoe.ops.mla_decode(**{**a, "q_nope": meta(2, 16, 512)}, sm_scale=0.1)
    q = meta(5, 16, 192)
    with pytest.raises(ValueError, match=r"^q must be on the CUDA, got device meta$"):
        hmoe.ops.ragged_prefill(q, q, q, a["seq_lens"], a["seq_lens"], sm_scale=0.1)
    with pytest.raises(ValueError, match=r"^x must be on the CUDA, got device meta$"):
        hmoe.ops.decode_linear(meta(2, 64), meta(8, 64))
    e = _experts_args()
    with pytest.raises(ValueError, match=r"^x must be on the CPU, got device meta$"):
        _call_functional({**e, "x": meta(5, 40, dtype=torch.float32)})
    with pytest.raises(ValueError, match=r"^grouped_topk: router_logits must be on the CPU or CUDA, got device meta$"):
        hmoe.ops.grouped_topk(meta(2, 8, dtype=torch.float32), 2)


def test_parameters_are_plain_tensors():
    a = _experts_args()
    want_class, want_functional = _call_class(a), _call_functional(a)
    a["w13"], a["w2"] = torch.nn.Parameter(a["w13"], requires_grad=False), torch.nn.Parameter(a["w2"])
    assert torch.equal(_call_class(a), want_class)
    assert torch.equal(_call_functional(a), want_functional)


def test_conjugate_view_refused():
    # Only complex tensors carry a conjugate bit, and no hmoe kernel takes complex data.
    z = torch.randn(3, dtype=torch.complex64).conj()
    with pytest.raises(TypeError, match="z must have dtype .*; got complex64"):
        V.tensor("z", z)


def test_sparse_refused():
    with pytest.raises(TypeError, match="layout"):
        V.tensor("s", torch.eye(3).to_sparse())


@pytest.mark.parametrize("value, exc", [(1e39, ValueError), (-1e39, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), (True, TypeError), ("1", TypeError)])
def test_float_arguments(value, exc):
    with pytest.raises(exc, match="routed_scaling_factor"):
        hmoe.ops.grouped_topk(torch.randn(2, 8), 2, routed_scaling_factor=value)


@pytest.mark.parametrize("value, exc", [(2 ** 31, ValueError), (2 ** 70, ValueError), (-1, ValueError), (0, ValueError),
                                        (1.0, TypeError), (False, TypeError)])
def test_int_arguments(value, exc):
    with pytest.raises(exc, match="top_k"):
        hmoe.ops.grouped_topk(torch.randn(2, 8), value)
    if exc is ValueError and value < 2 ** 31:  # 0 and -1 alike: below the range the op names
        with pytest.raises(exc, match=r"outside the supported range \[1, "):
            hmoe.ops.grouped_topk(torch.randn(2, 8), value)


def test_prewarm_names_a_missing_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device: prewarm('cuda') does its work")
    hmoe.prewarm("cpu")  # the CPU modules only
    for device in ("cuda", "cuda:1", 0):
        with pytest.raises(RuntimeError, match="this torch sees no CUDA device"):
            hmoe.prewarm(device)
