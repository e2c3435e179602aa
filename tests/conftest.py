"""Shared pytest setup: GPU tests skip cleanly without a GPU or in a build without CUDA kernels; HMOE_*
variables never leak in, and a test's hmoe.set_num_threads never leaks out."""
import os
import sys

import pytest


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _no_cuda_kernels() -> bool:
    """A build without CUDA kernels (HMOE_CUDA=OFF) on a machine with a GPU."""
    import hmoe

    return not hmoe.build_info()["cuda_kernels"]


def pytest_collection_modifyitems(config, items):
    if not _has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    elif _no_cuda_kernels():
        skip = pytest.mark.skip(reason="needs hmoe built with CUDA kernels (this build has none: HMOE_CUDA=OFF)")
    else:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_hmoe_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("HMOE_") and k != "HMOE_NUM_THREADS":
            monkeypatch.delenv(k, raising=False)
    # set_num_threads(old) after a test's own count would pin the count, and a later test's HMOE_NUM_THREADS
    # would go unread
    before = getattr(sys.modules.get("hmoe._threads"), "_num_threads", None)
    yield
    threads = sys.modules.get("hmoe._threads")
    if threads is not None:
        threads._num_threads = before
