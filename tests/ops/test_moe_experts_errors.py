"""Bad input to moe_experts_cpu / CPUExperts: a clear error naming the argument, never a crash."""
import pytest
import torch

import hmoe

from .experts_reference import random_problem


def good():
    return random_problem(4, 16, 8, 3, 2, torch.float32, torch.bfloat16)


def call(x, ids, w, w13, w2):
    return hmoe.ops.moe_experts_cpu(x, ids, w, w13, w2)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.__setitem__(0, a[0].numpy()), TypeError, "x must be a torch.Tensor"),
    (lambda a: a.__setitem__(0, a[0].double()), TypeError, "x must have dtype"),
    (lambda a: a.__setitem__(0, a[0][None]), ValueError, "x must be 2-D"),
    (lambda a: a.__setitem__(0, a[0][:, :15].contiguous()), ValueError, "x has shape"),
    (lambda a: a.__setitem__(0, torch.randn(16, 4).T), ValueError, "x must be contiguous"),
    (lambda a: a.__setitem__(1, a[1].float()), TypeError, "topk_ids must have dtype"),
    (lambda a: a.__setitem__(1, a[1][:3]), ValueError, "topk_ids has 3 rows"),
    (lambda a: a.__setitem__(1, a[1] + 3), ValueError, "topk_ids holds"),
    (lambda a: a.__setitem__(1, a[1] - 5), ValueError, "topk_ids holds -"),
    (lambda a: a.__setitem__(1, a[1][:, :0]), ValueError, "top-k must be at least 1"),
    (lambda a: a.__setitem__(2, a[2].half()), TypeError, "topk_weights must have dtype"),
    (lambda a: a.__setitem__(2, a[2][:, :1].contiguous()), ValueError, "topk_weights has shape"),
    (lambda a: a.__setitem__(3, a[3].float()), TypeError, "w13 and w2 must share a dtype"),
    (lambda a: a.__setitem__(3, a[3][:, :15].contiguous()), ValueError, "w13 has shape"),
    (lambda a: a.__setitem__(3, a[3][:2]), ValueError, "w2 has shape"),
    (lambda a: a.__setitem__(4, a[4][:, :, :7].contiguous()), ValueError, "w2 has shape"),
    # the right shape, strided: only the contiguity check can refuse it ("w2" alone also matched the
    # shape error of a plain transpose)
    (lambda a: a.__setitem__(4, a[4].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "w2 must be contiguous"),
    (lambda a: a.__setitem__(3, a[3].int()), TypeError, "w13 must have dtype"),
    (lambda a: a.__setitem__(3, a[3][0]), ValueError, "w13 must be 3-D"),
])
def test_bad_input(mutate, exc, match):
    args = list(good())
    mutate(args)
    with pytest.raises(exc, match=match):
        call(*args)


def test_cpuexperts_bad_input():
    x, ids, w, w13, w2 = good()
    experts = hmoe.CPUExperts(w13, w2)
    with pytest.raises(ValueError, match="x has shape"):
        experts(x[:, :8].contiguous(), ids, w)
    with pytest.raises(ValueError, match="topk_ids holds 3"):
        experts(x, torch.full_like(ids, 3), w)
    with pytest.raises(TypeError, match="w13 must be a torch.Tensor"):
        hmoe.CPUExperts(None, w2)


def test_unknown_isa():
    with pytest.raises(ValueError, match="known levels"):
        hmoe.ops.moe_experts_cpu(*good(), isa="avx1024")


def _selected_module():
    from hmoe.ops import experts as _experts

    return _experts.module(_experts.select())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_no_weight_format_for_dtype(dtype):
    """A weight dtype no format covers is refused by name wherever the native layer meets it."""
    from hmoe._dtypes import code

    mod = _selected_module()
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=f"no weight format for dtype {name}"):
        mod.packed_bytes(code(dtype), 64, 32, 0, 0)
    x, ids, w, _, _ = good()
    blob = torch.zeros(1 << 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"no weight format for dtype {name}"):
        mod.moe_experts_packed(x, ids, w, blob, blob, code(dtype), 3, 16, 8, 0, 0, None, 1)


@pytest.mark.parametrize("dtype,H,I", [(torch.bfloat16, 33, 17), (torch.bfloat16, 64, 32),
                                       (torch.float16, 33, 17), (torch.float32, 7, 40)])
def test_packed_sizes_follow_the_layout(dtype, H, I):
    """Blocks of 16 columns over the whole reduction; bf16 pads the reduction to 32 (pairs)."""
    from hmoe._dtypes import code

    esz = torch.empty(0, dtype=dtype).element_size()
    kpad = (lambda k: -(-k // 32) * 32) if dtype == torch.bfloat16 else (lambda k: k)
    blocks = lambda n: -(-n // 16)  # noqa: E731
    want = (2 * blocks(I) * 16 * kpad(H) * esz, blocks(H) * 16 * kpad(I) * esz)
    assert tuple(_selected_module().packed_bytes(code(dtype), H, I, 0, 0)) == want
