"""hmoe.nn.HybridMoE built from a placement already split (gpu_weights=): the CPU experts' stacks without
gpu_experts, and those experts' float weights apart, as hmoe.nn.load_model reads them from a checkpoint."""
import pytest
import torch

import hmoe.nn as hn
from hmoe.quant import quantize

E, H, INTER = 8, 64, 32
IDS, REST = [2, 5, 6], [0, 1, 3, 4, 7]


def _weights():
    gen = torch.Generator().manual_seed(31)
    return tuple(torch.randn(*s, generator=gen) for s in ((E, H), (E, 2 * INTER, H), (E, H, INTER)))


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_a_split_placement_is_the_module_gpu_experts_builds(quant):
    # CPU stacks float (quantised by the module) or quantised already: the same bits and state dict as the
    # module built from every expert's weights with gpu_experts=
    g, w13, w2 = _weights()
    group = 32 if quant == "int4" else None
    want = hn.HybridMoE(g, w13, w2, top_k=3, gpu_experts=IDS, quant=quant, group_size=group)
    on_device = (w13[IDS], w2[IDS])
    split = [hn.HybridMoE(g, w13[REST], w2[REST], top_k=3, gpu_experts=torch.tensor([6, 2, 5]), gpu_weights=on_device,
                          quant=quant, group_size=group)]
    if quant is not None:
        cpu = (quantize(w, quant, group_size=group) for w in (w13[REST], w2[REST]))
        split.append(hn.HybridMoE(g, *cpu, top_k=3, gpu_experts=IDS, gpu_weights=on_device))
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(32))
    ref = want.state_dict()
    with torch.no_grad():
        y = want(x)
        for moe in split:
            assert moe.gpu_ids.tolist() == IDS and moe.experts.num_experts == len(REST)
            assert torch.equal(moe(x), y)
            sd = moe.state_dict()
            assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd if k != "routing_counts")


def test_a_split_placement_is_checked():
    g, w13, w2 = _weights()
    cpu, dev = (w13[REST], w2[REST]), (w13[IDS], w2[IDS])

    def build(cpu=cpu, gpu_weights=dev, gpu_experts=IDS):
        return hn.HybridMoE(g, *cpu, top_k=2, gpu_experts=gpu_experts, gpu_weights=gpu_weights)

    with pytest.raises(ValueError, match=r"w13 \(8, 64, 64\) = \[E - G, 2I, H\].*not in gpu_experts: G = 3"):
        build(cpu=(w13, w2))  # every expert's stacks, not the CPU's
    with pytest.raises(ValueError, match=r"= \[E - G, H, I\]"):
        build(cpu=(w13[REST], w2[REST, :, :-1]))  # I of w13 and w2 differ
    with pytest.raises(ValueError, match=r"= \[E - G, 2I, H\]"):
        build(cpu=(w13[REST, :, :-1], w2[REST]))  # H not the router's
    with pytest.raises(ValueError, match=r"gpu_weights: w13 must be float weights of shape \(3, 64, 64\) \(the 3 "
                                         r"experts' in sorted id order\), got torch.float32 \(2, 64, 64\)"):
        build(gpu_weights=(w13[IDS[:2]], w2[IDS]))
    with pytest.raises(ValueError, match=r"gpu_weights: w2 must be float weights of shape \(3, 64, 32\)"):
        build(gpu_weights=(w13[IDS], w2[IDS, :-1]))  # H of the device experts not the router's
    with pytest.raises(ValueError, match=r"w13 must be float weights .* got torch.int8"):
        build(gpu_weights=(w13[IDS].to(torch.int8), w2[IDS]))
    with pytest.raises(ValueError, match=r"w2 must be float weights .* got QuantizedWeights"):
        build(gpu_weights=(w13[IDS], quantize(w2[IDS], "int8")))
    with pytest.raises(TypeError, match="gpu_weights must be a pair"):
        build(gpu_weights=w13[IDS])
    for count in (None, 3):
        with pytest.raises(ValueError, match="gpu_weights are the float weights of gpu_experts given as expert ids"):
            build(gpu_experts=count)
    with pytest.raises(ValueError, match="distinct expert ids"):
        build(gpu_experts=[2, 2, 5])
    with pytest.raises(ValueError, match="leave at least one on the CPU"):
        build(cpu=(w13[:0], w2[:0]), gpu_weights=(w13, w2), gpu_experts=list(range(E)))
    with pytest.raises(ValueError, match="gpu_weights\\[1\\] is on the meta device"):
        build(gpu_weights=(w13[IDS], w2[IDS].to("meta")))
