"""csrc/rms_norm.cu compiles with nvcc (no GPU needed) and its code keeps docs/spec.md §9's arithmetic: no FMA,
no flush-to-zero, round-to-nearest adds, products, divisions and square roots, no approximate reciprocal root."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from detcomm.numerics import norm_cuda
from detcomm.workspace import kernels

CU = Path(__file__).resolve().parents[1] / "csrc" / norm_cuda.SOURCE_FILE
NVCC = shutil.which("nvcc")
# The run-time options spelled for nvcc, the device constants included (kernels.constant_options: the headers define
# none of them).
FLAGS = ["-arch=sm_90", "-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
         "-DDETCOMM_W=1", *kernels.constant_options()]


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_ptx_keeps_the_canonical_arithmetic(tmp_path: Path) -> None:
    out = tmp_path / "norm.ptx"
    p = subprocess.run([NVCC, *FLAGS, "-ptx", str(CU), "-o", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    ptx = out.read_text()
    assert not re.search(r"\bfma\.", ptx) and ".ftz" not in ptx
    assert not re.search(r"\b(rsqrt|rcp|ex2|lg2)\.", ptx)
    for op in ("add.rn.f32", "mul.rn.f32", "div.rn.f32", "sqrt.rn.f32", "cvt.rn.bf16.f32", "cvt.rn.f16.f32"):
        assert op in ptx, op
    assert not re.search(r"\b(add|mul|div|sqrt)\.(approx\.)?f32", ptx)  # every operation names its rounding
    names = set(re.findall(r"\.entry (detcomm_\w+)\(", ptx))
    assert names == {f"detcomm_{k}_{a}_w{b}" for k in ("rms_norm", "add_rms_norm")
                     for a in ("f32", "bf16", "f16") for b in ("f32", "bf16", "f16")}


def test_runtime_source_is_one_unit() -> None:
    src = kernels.flatten_source((norm_cuda.SOURCE_FILE,))
    assert '#include "' not in src and "detcomm_add_rms_norm" in src and "struct Traits" in src


FUSED = CU.parent / "fused_rmsnorm.cu"


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("world", [2, 8])
def test_fused_kernel_ptx_keeps_the_canonical_arithmetic(tmp_path: Path, world: int) -> None:
    """The fused workspace kernels (plain and tree-order): the same arithmetic rules as the norm alone, and the
    workspace's barriers."""
    out = tmp_path / "fused.ptx"
    flags = [f for f in FLAGS if not f.startswith("-DDETCOMM_W=")] + [f"-DDETCOMM_W={world}"]
    p = subprocess.run([NVCC, *flags, "-ptx", str(FUSED), "-o", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    ptx = out.read_text()
    assert not re.search(r"\bfma\.", ptx) and ".ftz" not in ptx
    assert not re.search(r"\b(rsqrt|rcp|ex2|lg2)\.", ptx)
    assert not re.search(r"\b(add|mul|div|sqrt)\.(approx\.)?f32", ptx)
    for op in ("add.rn.f32", "mul.rn.f32", "div.rn.f32", "sqrt.rn.f32", "st.release.sys", "ld.acquire.sys"):
        assert op in ptx, op
    assert "trap;" not in ptx
    names = set(re.findall(r"\.entry (detcomm_\w+)\(", ptx))
    assert names == {f"detcomm_fused_rmsnorm_{k}{wide}_{a}_w{b}" for k in ("1shot", "2shot", "tree_1shot", "tree_2shot")
                     for wide in ("", "_wide") for a in ("f32", "bf16", "f16") for b in ("f32", "bf16", "f16")}


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("world", [2, 8])
def test_fused_one_store_kernel_ptx_keeps_the_canonical_arithmetic(tmp_path: Path, world: int) -> None:
    """The one-store fused kernel: the same arithmetic rules, no barrier (no release/acquire flag), volatile polls
    of its own region, the deadline and abort checks."""
    out = tmp_path / "fused_one_store.ptx"
    flags = [f for f in FLAGS if not f.startswith("-DDETCOMM_W=")] + [f"-DDETCOMM_W={world}"]
    p = subprocess.run([NVCC, *flags, "-ptx", str(CU.parent / "fused_rmsnorm_one_store.cu"), "-o", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    ptx = out.read_text()
    assert not re.search(r"\bfma\.", ptx) and ".ftz" not in ptx
    assert not re.search(r"\b(rsqrt|rcp|ex2|lg2)\.", ptx)
    assert not re.search(r"\b(add|mul|div|sqrt)\.(approx\.)?f32", ptx)
    for op in ("add.rn.f32", "mul.rn.f32", "div.rn.f32", "sqrt.rn.f32", "ld.volatile.global.v4.u32", "%globaltimer",
               "ld.relaxed.sys"):
        assert op in ptx, op
    assert "st.release.sys" not in ptx and "ld.acquire.sys" not in ptx  # no barrier
    assert "trap;" not in ptx
    names = set(re.findall(r"\.entry (detcomm_\w+)\(", ptx))
    assert names == {f"detcomm_fused_rmsnorm_one_store{wide}_{a}_w{b}" for wide in ("", "_wide")
                     for a in ("f32", "bf16", "f16") for b in ("f32", "bf16", "f16")}
