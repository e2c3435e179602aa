"""The examples run as documented (tiny sizes)."""
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from hmoe import _reference

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("gpu_experts", [0, 3])
def test_deepseek_hybrid_example_runs_on_the_cpu(gpu_experts):
    pytest.importorskip("transformers", reason="the example builds a transformers model")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "deepseek_hybrid.py"), "--preset", "tiny",
                          "--tokens", "4", "--cpu", "--gpu-experts", str(gpu_experts)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    where = ", 3 experts a layer on cpu" if gpu_experts else ""
    assert "original (all on the CPU)" in out.stdout and f"patched (experts on the CPU, eager{where})" in out.stdout
    # patch_model's report: every MoE layer keeps gpu_experts of its experts with the hidden states
    cpu_n, all_n, kept = map(int, re.search(r"routed experts: (\d+) of (\d+) on the CPU .*, (\d+) kept on cpu",
                                            out.stdout).groups())
    assert kept == all_n - cpu_n and (kept > 0) == (gpu_experts > 0) and kept % 3 == 0, out.stdout
    assert "greedy tokens equal to the original's" in out.stdout  # a count only: bf16 ties may go either way
    # what the patched model computes: its logits against the original's, within the dtype's bound
    rel = float(re.search(r"patched against the original: (\S+) relative", out.stdout).group(1))
    assert rel <= _reference.tolerance("hybrid_model_logits", torch.bfloat16), out.stdout


def _word_tokenizer(path):
    """A word-level tokenizer of the small models' 128 ids: w0 .. w124, then [UNK], [PAD], [EOS]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(125)} | {"[UNK]": 125, "[PAD]": 126, "[EOS]": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                            eos_token="[EOS]").save_pretrained(path)


def test_checkpoint_example_generates_a_padded_batch_on_the_cpu(tmp_path):
    pytest.importorskip("transformers", reason="the example loads a transformers model")
    pytest.importorskip("safetensors", reason="load_model reads safetensors")
    from tests.nn import models

    models.model("v3", torch.bfloat16).save_pretrained(tmp_path)
    _word_tokenizer(tmp_path)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "deepseek_checkpoint.py"), str(tmp_path), "--cpu",
                          "--quant", "int8", "--gpu-experts", "2", "--max-new-tokens", "5", "--prompt", "w1 w2 w3 w4",
                          "--prompt", "w7"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hmoe.nn.load_model: swapped 2 MoE blocks" in out.stderr and "bfloat16 as int8" in out.stderr
    assert re.search(r"load_model: routed experts [\d.]+ KiB packed as int8 on the CPU", out.stderr), out.stderr[-3000:]
    assert len(re.findall(r"mlp: experts \[\d+, \d+\] onto cpu", out.stderr)) == 2, out.stderr[-3000:]
    texts = re.findall(r"--- '([^']*)'\n(.*)\n", out.stdout)
    assert [t for t, _ in texts] == ["w1 w2 w3 w4", "w7"], out.stdout
    assert all(w in {f"w{i}" for i in range(125)} for _, new in texts for w in new.split()), out.stdout
    # on the CPU the decode attention is transformers' own (GraphDecoder's attention="auto")
    assert re.search(r"\d decode steps of 2 sequences in .* eager\); decode attention: model", out.stdout), out.stdout
