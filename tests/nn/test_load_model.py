"""hmoe.nn.load_model on checkpoints the tests write: transformers' save_pretrained of the small random
DeepSeek-V2/V3 models, and DeepSeek-V3's fp8 layout (float8_e4m3fn linears with weight_scale_inv). The
loaded model must compute exactly what transformers' from_pretrained followed by patch_model computes."""
import json
import re

import pytest
import torch

import hmoe.nn as hn
from hmoe import quant

from . import models

transformers = models.transformers
safetensors = pytest.importorskip("safetensors.torch", reason="load_model reads safetensors")


def _saved(tmp_path, kind, **kw):
    m = models.model(kind, torch.bfloat16, **kw)
    m.save_pretrained(tmp_path)
    return m


def _reference(path, device="cpu", **patch):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    hn.patch_model(ref, progress=False, **patch)
    return ref


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_loaded_model_computes_what_from_pretrained_and_patch_model_do(kind, tmp_path):
    _saved(tmp_path, kind)
    got = hn.load_model(str(tmp_path), device="cpu", progress=False)
    assert not got.training and all(isinstance(b, hn.HybridMoE) for b in got.model.layers[1:].modules()
                                    if type(b).__name__.endswith(("Moe", "MoE")))
    assert not any(t.is_meta for t in list(got.parameters()) + list(got.buffers()))
    report = got.hmoe_report
    assert report.swapped == 2 and "read from the checkpoint one expert at a time" in str(report)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(got, ids), _logits(_reference(tmp_path), ids))
    want = hn.GraphDecoder(_reference(tmp_path), batch_size=2, max_cache_len=24, capture=False).generate(ids, 8)
    assert torch.equal(hn.GraphDecoder(got, batch_size=2, max_cache_len=24, capture=False).generate(ids, 8), want)


def test_experts_quantised_as_they_are_read(tmp_path):
    _saved(tmp_path, "v3")
    got = hn.load_model(str(tmp_path), device="cpu", quant="int4", group_size=32, progress=False)
    blocks = [b for b in got.modules() if isinstance(b, hn.HybridMoE)]
    assert blocks and all(b.experts.format == "int4" for b in blocks)
    assert "bfloat16 as int4" in str(got.hmoe_report)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_logits(got, ids), _logits(_reference(tmp_path, quant="int4", group_size=32), ids))


def test_experts_kept_on_the_device_by_id(tmp_path):
    # the chosen experts read again in float (here the "device" is the CPU: the same module code), the others
    # quantised: what patch_model(gpu_experts=ids, quant=...) of the from_pretrained model computes
    _saved(tmp_path, "v3")
    got = hn.load_model(str(tmp_path), device="cpu", quant="int4", group_size=32, gpu_experts=[0, 3],
                        progress=False)
    blocks = [b for b in got.modules() if isinstance(b, hn.HybridMoE)]
    assert all(b.gpu_ids.tolist() == [0, 3] and b.gpu_w13.dtype == torch.bfloat16 for b in blocks)
    assert [b.gpu_experts for b in got.hmoe_report.blocks] == [[0, 3]] * len(blocks)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    want = _reference(tmp_path, quant="int4", group_size=32, gpu_experts=[0, 3])
    assert torch.equal(_logits(got, ids), _logits(want, ids))


def test_experts_kept_by_id_are_read_once_in_float_and_never_packed(tmp_path, monkeypatch):
    # each block reads its CPU experts without the ids (quantised), then the ids alone in float for the device,
    # and builds its HybridMoE so: no stack of every expert, no copy of a subset of the packed experts
    from hmoe import checkpoint

    _saved(tmp_path, "v3")
    reads, real = [], checkpoint._read_experts

    def recorded(names, path, layer, quant, group_size, dtype, *args, only=None):
        reads.append((layer, quant, dtype, only))
        return real(names, path, layer, quant, group_size, dtype, *args, only=only)

    monkeypatch.setattr(checkpoint, "_read_experts", recorded)
    monkeypatch.setattr(hn.HybridMoE, "keep_on_device", lambda *a: pytest.fail("keep_on_device was called"))
    monkeypatch.setattr(hn.CPUExperts, "subset", lambda *a: pytest.fail("CPUExperts.subset was called"))
    got = hn.load_model(str(tmp_path), device="cpu", quant="int8", gpu_experts=torch.tensor([3, 0]), progress=False)
    E = models.v3_config().n_routed_experts
    rest = [e for e in range(E) if e not in (0, 3)]
    assert reads == [r for layer in (1, 2) for r in ((layer, "int8", None, rest), (layer, None, torch.bfloat16, [0, 3]))]
    blocks = [b for b in got.modules() if isinstance(b, hn.HybridMoE)]
    assert all(b.experts.num_experts == E - 2 and b.gpu_ids.tolist() == [0, 3] for b in blocks)
    assert [(r.gpu_experts, r.packed_bytes) for r in got.hmoe_report.blocks] == [([0, 3], b.experts.packed_bytes)
                                                                                 for b in blocks]


def test_experts_kept_on_the_device_by_count_are_the_busiest_on_the_calibration(tmp_path):
    _saved(tmp_path, "v2")
    calib = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(6))
    cpu_only = hn.load_model(str(tmp_path), device="cpu", progress=False)
    _logits(cpu_only, calib)
    busiest = [sorted(torch.argsort(b.routing_counts, descending=True, stable=True)[:3].tolist())
               for b in cpu_only.modules() if isinstance(b, hn.HybridMoE)]
    got = hn.load_model(str(tmp_path), device="cpu", gpu_experts=3, calibration={"input_ids": calib},
                        progress=False)
    blocks = [b for b in got.modules() if isinstance(b, hn.HybridMoE)]
    assert [b.gpu_ids.tolist() for b in blocks] == busiest == [b.gpu_experts for b in got.hmoe_report.blocks]
    assert all(b.routing_counts.sum() == 0 and b.experts.num_experts == b.num_experts - 3 for b in blocks)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(7))
    a, b = _logits(got, ids).double(), _logits(cpu_only, ids).double()
    assert torch.isfinite(a).all() and ((a - b).norm() / b.norm()).item() < 0.05  # bf16 on either side


def test_gpu_experts_refused_before_anything_is_read(tmp_path):
    _saved(tmp_path, "v2")
    with pytest.raises(ValueError, match="pass calibration="):
        hn.load_model(str(tmp_path), device="cpu", gpu_experts=2, progress=False)
    with pytest.raises(TypeError, match="calibration must be input ids"):
        hn.load_model(str(tmp_path), device="cpu", gpu_experts=2, calibration=[1, 2], progress=False)
    with pytest.raises(ValueError, match="distinct expert ids"):
        hn.load_model(str(tmp_path), device="cpu", gpu_experts=[1, 1], progress=False)
    E = models.model("v2", torch.bfloat16).config.n_routed_experts
    for every in (E, list(range(E))):
        with pytest.raises(ValueError, match="leave at least one on the CPU"):
            hn.load_model(str(tmp_path), device="cpu", gpu_experts=every, calibration=torch.ones(1, 2, dtype=torch.long),
                          progress=False)


def _load_counted(path, monkeypatch, **load):
    """load_model, and the bytes of the tensors other than the routed experts that it read into the model."""
    from hmoe.nn import _load

    placed, real = [], _load._set

    def record(module, name, t):  # once a tensor (a tied one is not set again)
        placed.append(t.numel() * t.element_size())
        real(module, name, t)

    monkeypatch.setattr(_load, "_set", record)
    got = hn.load_model(path, progress=False, **load)
    monkeypatch.setattr(_load, "_set", real)
    return got, sum(placed)


def _host_bytes(path, monkeypatch, **load):
    """What a load onto the CPU holds at its peak, counted from a finished load: every CPU expert packed, the
    largest block's CPU experts once more (read, beside their packed copy), the model's other tensors and the
    experts kept on the device (here the CPU, in float)."""
    got, other = _load_counted(path, monkeypatch, device="cpu", **load)
    packed = [b.packed_bytes for b in got.hmoe_report.blocks]
    kept = sum(b.gpu_w13.nbytes + b.gpu_w2.nbytes for b in got.modules()
               if isinstance(b, hn.HybridMoE) and b.gpu_w13 is not None)
    return sum(packed) + max(packed) + other + kept, packed


@pytest.mark.parametrize("load", [{}, {"quant": "int8"}, {"quant": "int4", "group_size": 32}, {"quant": "fp8"},
                                  {"quant": "int4", "group_size": 32, "gpu_experts": [0, 3]}])
def test_memory_checked_before_anything_is_read(load, tmp_path, monkeypatch, capsys):
    # the count is exact: the host's available memory at the count loads, one byte less is a MemoryError that
    # comes before any expert is read
    from hmoe import checkpoint
    from hmoe.hardware import cpu

    _saved(tmp_path, "v3")
    need, packed = _host_bytes(str(tmp_path), monkeypatch, **load)
    if "gpu_experts" in load:  # ids: the count and the CPU experts are E - 2 experts a block, not every one
        E, every = models.v3_config().n_routed_experts, {k: v for k, v in load.items() if k != "gpu_experts"}
        full = [b.packed_bytes for b in hn.load_model(str(tmp_path), device="cpu", progress=False,
                                                       **every).hmoe_report.blocks]
        assert packed == [p // E * (E - 2) for p in full]
    monkeypatch.setattr(cpu, "mem_available_bytes", lambda: need)
    got = hn.load_model(str(tmp_path), device="cpu", **load)
    fmt = load.get("quant", "bfloat16")
    assert f"packed as {fmt} on the CPU" in capsys.readouterr().err
    assert got.hmoe_report.blocks[0].format == {"bfloat16": "bf16"}.get(fmt, fmt)
    monkeypatch.setattr(cpu, "mem_available_bytes", lambda: need - 1)

    def read(*a, **k):
        raise AssertionError("an expert was read")

    monkeypatch.setattr(checkpoint, "_read_experts", read)
    with pytest.raises(MemoryError, match=rf"not enough host memory .* packed as {fmt} \(2 MoE blocks;.* "
                                          r"check_memory=False to go ahead anyway"):
        hn.load_model(str(tmp_path), device="cpu", progress=False, **load)
    with pytest.raises(AssertionError, match="an expert was read"):  # the check alone stood in the way
        hn.load_model(str(tmp_path), device="cpu", progress=False, check_memory=False, **load)


def test_memory_error_names_the_formats_that_would_take_less(tmp_path, monkeypatch):
    from hmoe.hardware import cpu

    _saved(tmp_path, "v3", hidden_size=128, moe_intermediate_size=128)  # int4 in groups of 128 fits these experts
    monkeypatch.setattr(cpu, "mem_available_bytes", lambda: 1000)
    with pytest.raises(MemoryError) as e:
        hn.load_model(str(tmp_path), device="cpu", progress=False)
    assert re.search(r"would take as int8 \(per row\) [\d.]+ [KM]iB, as int4 \(groups of 128\) [\d.]+ [KM]iB "
                     r"\(quant=\)", str(e.value))
    _saved(tmp_path / "small", "v3")  # H = 64, I = 32: int4 in groups of 128 cannot take them, and is not offered
    with pytest.raises(MemoryError, match=r"would take as int8 \(per row\) [\d.]+ [KM]iB \(quant=\); or pass"):
        hn.load_model(str(tmp_path / "small"), device="cpu", progress=False)


@pytest.mark.parametrize("gpu_experts", [[0, 3], 2], ids=["ids", "count"])
def test_host_count_of_a_gpu_load_holds_the_kept_experts_passing_through(gpu_experts, tmp_path, monkeypatch):
    # onto a CUDA device the kept experts' float weights are read on the host first: beside a block's CPU stacks
    # (ids) or beside the subset copy of the block's CPU experts (a count): more than a block's int4 stacks alone
    from hmoe.hardware import cpu
    from hmoe.nn import _load

    _saved(tmp_path, "v3")
    packed = _host_bytes(str(tmp_path), monkeypatch, quant="int4", group_size=32, gpu_experts=[0, 3])[1]
    cfg = models.v3_config()
    E, f = cfg.n_routed_experts, 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2  # an expert in bf16
    per = [p // (E - 2) for p in packed]  # an int4 expert's packed bytes, per block
    on_cpu = E - 2 if isinstance(gpu_experts, list) else E  # a count is chosen with every expert on the CPU
    need = sum(on_cpu * b for b in per) + max((E - 2) * b + 2 * f for b in per)
    assert 2 * f > 2 * max(per)  # the float weights, not a block's stacks, set the peak here
    _, model, blocks, block = _load._meta_model(str(tmp_path), torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 50, 1 << 50))

    def check():
        _load._check_memory(str(tmp_path), model, blocks, "int4", 32, torch.bfloat16, block, None, 2,
                            isinstance(gpu_experts, list), torch.device("cuda", 0), False)

    monkeypatch.setattr(cpu, "mem_available_bytes", lambda: need)
    check()
    monkeypatch.setattr(cpu, "mem_available_bytes", lambda: need - 1)
    with pytest.raises(MemoryError, match="not enough host memory"):
        check()


@pytest.mark.gpu
def test_device_memory_checked_before_anything_is_read(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from hmoe import checkpoint

    _saved(tmp_path, "v3")
    cfg = models.v3_config()
    kept = 2 * 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2  # 2 blocks x 2 experts, bf16
    need = _load_counted(str(tmp_path), monkeypatch)[1] + kept
    total = torch.cuda.mem_get_info()[1]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need, total))
    got = hn.load_model(str(tmp_path), gpu_experts=[0, 3], progress=False)
    assert all(b.gpu_w13.is_cuda for b in got.modules() if isinstance(b, hn.HybridMoE))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - 1, total))
    monkeypatch.setattr(checkpoint, "_read_experts", lambda *a, **k: pytest.fail("an expert was read"))
    with pytest.raises(MemoryError, match=r"not enough memory on cuda:0 .* the 2 experts a block kept there"):
        hn.load_model(str(tmp_path), gpu_experts=[0, 3], progress=False)


def _fp8_checkpoint(tmp_path):
    """The small V3 model written as DeepSeek-V3 ships: every linear (attention, dense and shared MLPs,
    each routed expert) float8_e4m3fn with fp32 weight_scale_inv per 128 x 128 block; embeddings, norms,
    router and lm_head in bf16; a multi-token-prediction tensor the model has no place for; two shards
    and an index. Returns the model with its linears replaced by their dequantised fp8 values."""
    m = models.model("v3", torch.bfloat16)
    tensors = {}
    for name, t in m.state_dict().items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            continue
        tensors[name] = t
    linears = {n + ".weight": mod for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)
               and n != "lm_head"}
    for key, mod in linears.items():
        qw = quant.quantize(mod.weight.detach().float(), "fp8")
        tensors[key], tensors[key.removesuffix(".weight") + ".weight_scale_inv"] = qw.data, qw.scales
        with torch.no_grad():
            mod.weight.copy_(quant.dequantize(qw))
    for block in models.moe_blocks(m):
        prefix = next(n for n, mod in m.named_modules() if mod is block) + ".experts."
        gu, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
        inter = down.shape[2]
        for e in range(gu.shape[0]):
            for proj, w in (("gate_proj", gu[e, :inter]), ("up_proj", gu[e, inter:]), ("down_proj", down[e])):
                qw = quant.quantize(w.float(), "fp8")
                tensors[f"{prefix}{e}.{proj}.weight"] = qw.data
                tensors[f"{prefix}{e}.{proj}.weight_scale_inv"] = qw.scales
                with torch.no_grad():
                    w.copy_(quant.dequantize(qw))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)  # V3's MTP layer: unread
    keys = sorted(tensors)
    shard_of = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(keys)}
    for shard in set(shard_of.values()):
        safetensors.save_file({k: tensors[k].contiguous() for k in keys if shard_of[k] == shard},
                              str(tmp_path / shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shard_of}))
    cfg = m.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return m


def test_fp8_checkpoint_in_deepseeks_layout(tmp_path):
    want = _fp8_checkpoint(tmp_path)
    got = hn.load_model(str(tmp_path), device="cpu", progress=False)
    assert "1 tensors of the checkpoint left unread" in str(got.hmoe_report)
    hn.patch_model(want, progress=False)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    a, b = _logits(got, ids), _logits(want, ids)
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_what_load_model_refuses(tmp_path):
    m = _saved(tmp_path / "ok", "v2")
    path = str(tmp_path / "ok")
    with pytest.raises(ValueError, match="quant must be"):
        hn.load_model(path, device="cpu", quant="int3")
    with pytest.raises(ValueError, match="dtype must be"):
        hn.load_model(path, device="cpu", dtype=torch.float64)
    with pytest.raises(ValueError, match="group_size=32 applies to quant"):
        hn.load_model(path, device="cpu", group_size=32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            hn.load_model(path)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory"):
        hn.load_model(str(tmp_path / "nowhere"), device="cpu")
    sd = {k: v for k, v in m.state_dict().items() if "q_a_proj" not in k and ".mlp.experts." not in k}
    (tmp_path / "bad").mkdir()
    m.config.save_pretrained(tmp_path / "bad")
    for block in models.moe_blocks(m):
        prefix = next(n for n, mod in m.named_modules() if mod is block) + ".experts."
        sd[prefix + "gate_up_proj"] = block.experts.gate_up_proj.detach()
        sd[prefix + "down_proj"] = block.experts.down_proj.detach()
    safetensors.save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_a_proj\.weight .* is missing"):
        hn.load_model(str(tmp_path / "bad"), device="cpu", progress=False)
    sd = {k: v for k, v in m.state_dict().items() if ".mlp.experts." not in k}
    last = [n for n, mod in m.named_modules() if mod in models.moe_blocks(m)][-1]
    for block in models.moe_blocks(m)[:-1]:  # every MoE layer's experts but the last one's
        prefix = next(n for n, mod in m.named_modules() if mod is block) + ".experts."
        sd[prefix + "gate_up_proj"] = block.experts.gate_up_proj.detach()
        sd[prefix + "down_proj"] = block.experts.down_proj.detach()
    safetensors.save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"{last}.experts.* (the routed experts of layer "
                                                   f"{last.split('.')[2]}) are missing from")):
        hn.load_model(str(tmp_path / "bad"), device="cpu", progress=False)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="'llama' model; this loader reads DeepSeek-V2/V3"):
        hn.load_model(str(tmp_path / "llama"), device="cpu")


@pytest.mark.gpu
def test_loaded_onto_the_gpu_decodes_as_the_patched_original(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _saved(tmp_path, "v2", kv_lora_rank=512, qk_rope_head_dim=64)
    got = hn.load_model(str(tmp_path), progress=False)
    assert got.model.embed_tokens.weight.is_cuda and got.model.rotary_emb.inv_freq.is_cuda
    ids = torch.randint(0, 128, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    want = hn.GraphDecoder(_reference(tmp_path, "cuda"), batch_size=2, max_cache_len=40).generate(ids, 12)
    dec = hn.GraphDecoder(got, batch_size=2, max_cache_len=40)
    assert dec.attention == "hmoe" and torch.equal(dec.generate(ids, 12), want)


@pytest.mark.gpu
def test_experts_kept_on_the_gpu_decode_as_the_patched_original(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _saved(tmp_path, "v3", kv_lora_rank=512, qk_rope_head_dim=64)
    calib = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(8))
    got = hn.load_model(str(tmp_path), gpu_experts=3, calibration=calib, progress=False)  # moved to the GPU
    blocks = [b for b in got.modules() if isinstance(b, hn.HybridMoE)]
    assert all(b.gpu_w13.is_cuda and b.gpu_ids.numel() == 3 for b in blocks)
    chosen = blocks[0].gpu_ids.tolist()
    fixed = hn.load_model(str(tmp_path), gpu_experts=chosen, progress=False)
    ids = torch.randint(0, 128, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    want = hn.GraphDecoder(_reference(tmp_path, "cuda", gpu_experts=chosen), batch_size=2,
                           max_cache_len=40).generate(ids, 12)
    dec = hn.GraphDecoder(fixed, batch_size=2, max_cache_len=40)
    assert dec.attention == "hmoe" and torch.equal(dec.generate(ids, 12), want)
    out = hn.GraphDecoder(got, batch_size=2, max_cache_len=40).generate(ids, 12)
    assert out.shape == want.shape and bool((out[:, :9] == ids).all())


def test_hybrid_moe_takes_quantised_experts_as_they_are():
    E, H, inter = 8, 64, 32
    gen = torch.Generator().manual_seed(5)
    g, w13, w2 = (torch.randn(*s, generator=gen) for s in ((E, H), (E, 2 * inter, H), (E, H, inter)))
    q13, q2 = (quant.quantize(w, "int8") for w in (w13, w2))
    moe = hn.HybridMoE(g, q13, q2, top_k=2)
    assert moe.experts.format == "int8" and moe.gpu_w13 is None
    x = torch.randn(5, H, generator=gen)
    with torch.no_grad():
        assert torch.equal(moe(x), hn.HybridMoE(g, w13, w2, top_k=2, quant="int8")(x))
    with pytest.raises(ValueError, match="gpu_experts needs the float weights"):
        hn.HybridMoE(g, q13, q2, top_k=2, gpu_experts=[1])
    with pytest.raises(ValueError, match="quantised already"):
        hn.HybridMoE(g, q13, q2, top_k=2, quant="int4")
    with pytest.raises(TypeError, match="must both be float tensors or both"):
        hn.HybridMoE(g, q13, w2, top_k=2)
