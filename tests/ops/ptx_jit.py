"""Runs a check script in a child process whose driver ignores the SASS and JIT-compiles the PTX."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_forced_ptx(code: str, timeout: float):
    """The child's CompletedProcess (CUDA_FORCE_PTX_JIT=1, run from the repository root)."""
    env = dict(os.environ, CUDA_FORCE_PTX_JIT="1")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
