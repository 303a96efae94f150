"""detcomm.numerics.shard_gemm's Triton kernels on the CPU, under Triton's interpreter: tests/shard_gemm_interp_cases.py
(the fp64 oracle, the bits of a shard / column block whatever the batch count S in 1, 2, 4, 8, the row count and the
block count, and negative controls: a K tile chosen from the batch count, and split-K, must change bits).

The interpreter is chosen when triton is first imported, and any earlier import in this process (torch imports
triton lazily, detcomm's CUDA paths do) would have built the compiled, GPU-only kernels: so the cases run in a fresh
interpreter with TRITON_INTERPRET=1 set from its start. Skipped only where triton is not installed (pip install
triton)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_shard_gemm_kernels_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                        os.path.join(HERE, "shard_gemm_interp_cases.py")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-2000:]
