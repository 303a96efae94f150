"""GPU tests: marked `gpu`, skipped where there is no CUDA device (and the workspace tests where cupy is missing)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):  # tests/gpu (helpers) and tests/ (oracle.py)
    if _p not in sys.path:
        sys.path.insert(0, _p)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (and cupy for the workspace)")


def _gpu_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch missing"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("cupy") is None:
        return "cupy missing"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _gpu_missing()
    if why is None:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        # Only the workspace's tests need cupy; other gpu tests here keep tests/conftest.py's CUDA-only rule.
        if "gpu" in item.keywords and (why != "cupy missing" or item.path.name.startswith("test_workspace")):
            item.add_marker(skip)
