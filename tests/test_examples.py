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
