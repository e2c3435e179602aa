"""`python -m hmoe.compat check --model PATH`: the memory hmoe.nn.load_model would hold for a checkpoint,
counted from its config.json in a child process: the same bytes a load packs, what fits where, and what
cannot be counted said as a problem."""
import json
from pathlib import Path

import pytest
import torch

from hmoe import compat
from hmoe.compat import render
from hmoe.compat.report import _model_section, _Problems

from . import minischema
from .test_cli import cli

transformers = pytest.importorskip("transformers", reason="--model builds the model from its config")
SCHEMA = json.loads((Path(compat.__file__).parent / "schema.json").read_text())


def _report(env, path):
    rep = compat.report(model=str(path))
    assert minischema.errors(rep, SCHEMA) == []
    return rep


def test_model_counts_what_load_model_packs(env, tmp_path):
    pytest.importorskip("safetensors", reason="load_model reads safetensors")
    import hmoe.nn as hn
    from tests.nn import models

    models.model("v3", torch.bfloat16, hidden_size=128, moe_intermediate_size=128).save_pretrained(tmp_path)
    rep = _report(env, tmp_path)
    m = rep["model"]
    assert m["error"] is None and rep["exit_code"] == 0, rep["problems"]
    assert (m["model_type"], m["moe_blocks"], m["experts"], m["hidden_size"], m["intermediate_size"]) == \
        ("deepseek_v3", 2, 16, 128, 128)
    assert m["expert_float_bytes"] == 3 * 128 * 128 * 2 and m["other_bytes"] > 0
    for fmt, quant in (("bfloat16", None), ("int8", "int8"), ("int4", "int4"), ("fp8", "fp8")):
        got = hn.load_model(str(tmp_path), device="cpu", quant=quant, progress=False)
        packed = [b.packed_bytes for b in got.hmoe_report.blocks]
        assert m["formats"][fmt] == {"experts_bytes": sum(packed), "block_bytes": max(packed), "fits": True}, fmt
    text = render.render(rep)
    assert "== model: what hmoe.nn.load_model would hold (--model)" in text
    assert "deepseek_v3, 2 MoE blocks of 16 routed experts (hidden 128, intermediate 128), bfloat16" in text
    assert "    int4      816.00 KiB (+ 408.00 KiB)  fits" in text


def test_model_from_its_config_alone_and_what_cannot_be_counted(env, tmp_path):
    from tests.nn import models

    models.v3_config().save_pretrained(tmp_path / "config-only")  # H = 64: no int4 in groups of 128
    rep = _report(env, tmp_path / "config-only")
    assert rep["model"]["error"] is None and rep["exit_code"] == 0
    assert rep["model"]["formats"]["int4"] is None and rep["model"]["formats"]["int8"]["fits"] is True
    assert "int4      the kernels cannot take these shapes" in render.render(rep)
    transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2).save_pretrained(tmp_path / "llama")
    for path, why in ((tmp_path / "nowhere", "is not a checkpoint directory: it has no config.json"),
                      (tmp_path / "llama", "holds a 'llama' model; this loader reads DeepSeek-V2/V3")):
        rep = _report(env, path)
        assert why in rep["model"]["error"] and rep["model"]["formats"] is None
        assert rep["exit_code"] == 1 and any(f"--model {path}: " in p for p in (q["what"] for q in rep["problems"]))


def test_model_verdicts():
    data = {"path": "p", "model_type": "deepseek_v3", "dtype": "bfloat16", "moe_blocks": 1, "experts": 4,
            "hidden_size": 128, "intermediate_size": 128, "fp8_block": [128, 128], "other_bytes": 50,
            "expert_float_bytes": 8, "host_available_bytes": 40,
            "formats": {"bfloat16": {"experts_bytes": 100, "block_bytes": 10}, "int4": {"experts_bytes": 30,
                                                                                        "block_bytes": 10}},
            "devices": [{"device": "cuda:0", "free_bytes": 49, "total_bytes": 100}]}
    problems = _Problems()
    sec = _model_section(json.loads(json.dumps(data)), problems)
    assert [f["fits"] for f in sec["formats"].values()] == [False, True]  # 30 + 10 <= 40
    assert sec["devices"][0]["fits_other"] is False
    assert [p["severity"] for p in problems] == ["warning"] and "fit no GPU's free memory" in problems[0]["what"]
    data["host_available_bytes"], data["devices"][0]["free_bytes"] = 39, 50
    problems = _Problems()
    sec = _model_section(json.loads(json.dumps(data)), problems)
    assert sec["devices"][0]["fits_other"] is True
    assert [p["severity"] for p in problems] == ["error"] and "in no format (the smallest needs" in problems[0]["what"]
    data["host_available_bytes"] = 0  # unknown: no verdict, no problem
    problems = _Problems()
    assert all(f["fits"] is None for f in _model_section(json.loads(json.dumps(data)), problems)["formats"].values())
    assert not problems


def test_cli_model_json(tmp_path):
    p = cli("--json", "--model", str(tmp_path / "nowhere"), cwd=tmp_path)
    rep = json.loads(p.stdout)
    assert minischema.errors(rep, SCHEMA) == [] and p.returncode == rep["exit_code"] == 1
    assert "has no config.json" in rep["model"]["error"]
