"""The examples run as documented (tiny sizes)."""
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from hmoe import _reference

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_deepseek_hybrid_example_runs_on_the_cpu():
    pytest.importorskip("transformers", reason="the example builds a transformers model")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "deepseek_hybrid.py"), "--preset", "tiny",
                          "--tokens", "4", "--cpu"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "original (all on the CPU)" in out.stdout and "patched (experts on the CPU, eager)" in out.stdout
    assert "greedy tokens equal to the original's" in out.stdout  # a count only: bf16 ties may go either way
    # what the patched model computes: its logits against the original's, within the dtype's bound
    rel = float(re.search(r"patched against the original: (\S+) relative", out.stdout).group(1))
    assert rel <= _reference.tolerance("hybrid_model_logits", torch.bfloat16), out.stdout
