"""hmoe.nn.patch_model on whole transformers models (CPU): what it swaps, frees, fuses and refuses, its
memory check, and the state dict and other DeepSeek families it takes."""
import copy
import warnings

import numpy as np
import pytest
import torch

import hmoe.nn as hn
from hmoe import _reference

from . import models
from .test_hybrid_moe import DTYPES, _logits, _moe, _rel


def test_patch_model_errors_and_second_patch():
    with pytest.raises(ValueError, match="has no DeepSeek-V2/V3 MoE block"):
        hn.patch_model(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        hn.patch_model("model")
    m = models.model("v3")
    first = hn.patch_model(m, progress=False)
    assert "swapped 2 MoE blocks" in str(first) and "routed experts: 32 of 32 on the CPU" in str(first)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        second = hn.patch_model(m, progress=False)
    assert second.swapped == 0 and "already HybridMoE" in str(second) and w
    with pytest.raises(TypeError, match="not a DeepSeek-V2/V3 MoE block"):
        hn.HybridMoE.from_hf(torch.nn.Linear(2, 2))


def test_patch_frees_the_original_routed_weights():
    m = models.model("v3")
    old = models.moe_blocks(m)
    report = hn.patch_model(m, progress=False)
    assert all(p.numel() == 0 for b in old for p in b.experts.parameters())
    assert report.freed_bytes == 2 * (16 * 2 * 32 * 64 + 16 * 64 * 32) * 4


def test_patch_model_checks_host_memory_before_the_first_swap(monkeypatch):
    from hmoe.hardware import cpu
    from hmoe.nn import _hf

    m = models.model("v3", torch.bfloat16)
    monkeypatch.setattr(cpu, "mem_available_bytes", lambda: 1000)
    with pytest.raises(MemoryError, match=r"patch_model: not enough host memory: the CPU experts take .* packed as "
                                          r"int8 \(2 MoE blocks\), .* at the swap's peak .* available \(MemAvailable, "
                                          r"or the memory cgroup's .*\)\. The experts would take in bfloat16 .* "
                                          r"\(quant=\); or pass check_memory=False") as e:
        hn.patch_model(m, quant="int8", progress=False)
    assert not any(isinstance(b, hn.HybridMoE) for b in m.modules())  # refused before the first block
    report = hn.patch_model(m, quant="int8", check_memory=False, progress=False)
    assert report.swapped == 2
    assert f"take {_hf._size(sum(b.packed_bytes for b in report.blocks))} packed" in str(e.value)


@pytest.mark.parametrize("kind", ["v3", "v2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_fused_norms_compute_what_transformers_does(kind, dtype):
    from hmoe.nn._hf import FusedRMSNorm

    m = models.model(kind, dtype)
    norms = [mod for mod in m.modules() if type(mod).__name__.endswith("RMSNorm")]
    assert norms
    g = torch.Generator().manual_seed(5)
    for mod in norms:
        with torch.no_grad():
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=g))
            x = (torch.randn(9, mod.weight.shape[0], generator=g) * 4).to(dtype)
            want, got = mod(x), FusedRMSNorm(mod.weight, mod.variance_epsilon)(x)
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)  # the same roundings, on the CPU
    report = hn.patch_model(m, progress=False)
    assert report.norms == len(norms) and f"RMSNorms: {len(norms)} fused" in str(report)
    assert not [mod for mod in m.modules() if type(mod).__name__ in ("DeepseekV2RMSNorm", "DeepseekV3RMSNorm")]


def test_fuse_norms_false_keeps_the_models_norms():
    m = models.model("v3")
    before = [n for n, mod in m.named_modules() if type(mod).__name__.endswith("RMSNorm")]
    report = hn.patch_model(m, fuse_norms=False, progress=False)
    assert report.norms == 0 and "RMSNorms" not in str(report)
    assert [n for n, mod in m.named_modules() if type(mod).__name__.endswith("RMSNorm")] == before


def _other_moe(name, **kw):
    """A random 2-layer MoE model of another family (Mixtral, Qwen2-MoE): fused experts and a `gate`, like
    DeepSeek's blocks, but another routing."""
    config = getattr(models.transformers, name, None)
    if config is None:
        pytest.skip(f"this transformers has no {name}")
    torch.manual_seed(0)
    cfg = config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, **kw)
    return models.transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("name,kw", [("MixtralConfig", dict(num_local_experts=4)),
                                     ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=32,
                                                             shared_expert_intermediate_size=32))])
def test_moe_blocks_of_other_models_are_refused_not_miscomputed(name, kw):
    # Mixtral renormalises its top-k softmax weights and Qwen2-MoE gates its shared expert: patched as
    # DeepSeek blocks they computed logits 3-5% off in fp32. Their experts still run through
    # experts_implementation="hmoe", which keeps the model's routing.
    m = _other_moe(name, num_experts_per_tok=2, **kw)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = _logits(m, ids)
    with pytest.raises(ValueError, match="has no DeepSeek-V2/V3 MoE block .*routes differently"):
        hn.patch_model(m, progress=False)
    block = next(mod for mod in m.modules() if hasattr(mod, "gate") and hasattr(mod, "experts"))
    with pytest.raises(TypeError, match=f"{type(block).__name__} is not a DeepSeek-V2/V3 MoE block .*routes differently"):
        hn.HybridMoE.from_hf(block)
    assert not _moe(m) and torch.equal(_logits(m, ids), ref)
    m.set_experts_implementation(hn.register_experts_implementation())
    assert _rel(_logits(m, ids), ref) <= _reference.tolerance("hybrid_model_logits", torch.float32)


def test_experts_implementation_refuses_experts_that_are_not_silu():
    # transformers 5's fused experts keep no config: their act_fn says what they compute (hmoe ran silu
    # in place of gelu, 1.6% off, without a word)
    m = _other_moe("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, hidden_act="gelu")
    m.set_experts_implementation(hn.register_experts_implementation())
    with pytest.raises(ValueError, match="experts_implementation='hmoe': the experts use 'gelu'"):
        _logits(m, torch.zeros(1, 3, dtype=torch.long))


def test_weights_on_the_meta_device_are_refused():
    with torch.device("meta"):
        m = models.transformers.DeepseekV3ForCausalLM(models.v3_config())
    with pytest.raises(ValueError, match="gate_weight, w13, w2 are on the meta device, without data"):
        hn.patch_model(m, progress=False)
    m = models.model("v2")
    models.moe_blocks(m)[0].experts.to("meta")  # experts offloaded, the router loaded
    with pytest.raises(ValueError, match="w13, w2 are on the meta device"):
        hn.patch_model(m, progress=False)


def test_gpu_experts_count_of_any_int_type_and_bad_calibration():
    m = models.model("v2")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    # a numpy count: the calibration run happens (it was skipped, and HybridMoE asked for routing_counts)
    report = hn.patch_model(copy.deepcopy(m), gpu_experts=np.int64(2), calibration=ids, progress=False)
    assert [b.gpu_experts for b in report.blocks] == [b.gpu_experts for b in hn.patch_model(
        copy.deepcopy(m), gpu_experts=2, calibration=ids, progress=False).blocks]
    for bad, err in ((ids.float(), ValueError), (ids[:, :0], ValueError), (ids.tolist(), TypeError)):
        with pytest.raises(err, match="calibration must be input ids"):
            hn.patch_model(m, gpu_experts=2, calibration=bad, progress=False)
    assert not _moe(m)


def test_fp8_with_a_group_size_is_refused():
    # fp8 is scaled per (128, 128) block: a group_size was dropped without a word
    m = models.model("v3")
    with pytest.raises(ValueError, match="fp8 is scaled per block"):
        hn.patch_model(m, quant="fp8", group_size=32, progress=False)
    assert not _moe(m)


def test_state_dict_round_trip_carries_the_routed_experts(tmp_path):
    # The routed experts were in no state dict: load_state_dict into another patched model said "All keys
    # matched" and left its experts as they were (logits 15% off), and save_pretrained dropped them.
    src, dst = models.model("v3", seed=0), models.model("v3", seed=7)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(8))
    hn.patch_model(src, progress=False)
    hn.patch_model(dst, progress=False)
    want = _logits(src, ids)
    torch.save(src.state_dict(), tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert sd["model.layers.1.mlp.experts.w13_packed"].dtype == torch.uint8
    dst.load_state_dict(sd)
    assert torch.equal(_logits(dst, ids), want)
    with pytest.raises(RuntimeError, match="Missing key.*experts.w13_packed"):  # a state dict without them
        dst.load_state_dict({k: v for k, v in sd.items() if "packed" not in k})
    other = models.model("v3")
    hn.patch_model(other, quant="int8", progress=False)
    with pytest.raises(RuntimeError, match="the packed experts .* do not fit this module's"):
        other.load_state_dict(sd)


def test_deepseek_v32_blocks_are_patched():
    # DeepSeek-V3.2's MoE block and router are V3's code under another name
    config = getattr(models.transformers, "DeepseekV32Config", None)
    if config is None:
        pytest.skip("this transformers has no DeepseekV32Config")
    torch.manual_seed(0)
    m = models.transformers.AutoModelForCausalLM.from_config(config(**{**models.COMMON, "n_shared_experts": 1,
                                                                       "num_experts_per_tok": 4})).eval()
    for mod in m.modules():
        if type(mod).__name__.endswith("TopkRouter"):
            with torch.no_grad():
                mod.weight.normal_(0, models.ROUTER_STD)
                mod.e_score_correction_bias.normal_(0, 0.1)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = _logits(m, ids)
    assert hn.patch_model(m, progress=False).swapped == 2
    assert _rel(_logits(m, ids), ref) <= _reference.tolerance("hybrid_model_logits", torch.float32)
