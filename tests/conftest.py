"""Shared pytest setup: GPU tests skip cleanly without a GPU; HMOE_* variables never leak in."""
import os

import pytest


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_hmoe_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("HMOE_") and k != "HMOE_NUM_THREADS":
            monkeypatch.delenv(k, raising=False)
