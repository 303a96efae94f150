"""Every csrc/*.cu compiles for sm_90 with nvcc (no GPU needed), and the generated code keeps docs/spec.md §1's
arithmetic: no FMA, no flush-to-zero, round-to-nearest adds and conversions. Also the run-time NVRTC path,
where cupy's NVRTC is importable."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from detcomm.workspace import kernels

CSRC = Path(__file__).resolve().parents[1] / "csrc"
# rms_norm.cu is its own run-time module (detcomm/norm_cuda.py), checked by tests/test_norm_csrc.py.
CU_FILES = sorted(p.name for p in CSRC.glob("*.cu") if p.name != "rms_norm.cu")
NVCC = shutil.which("nvcc")
FLAGS = ["-arch=sm_90", "-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true"]

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")


def test_every_kernel_file_is_in_the_runtime_module():
    assert set(CU_FILES) == set(kernels.KERNEL_FILES)


@needs_nvcc
@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("cu", CU_FILES)
def test_nvcc_compiles(cu, world, tmp_path):
    p = subprocess.run([NVCC, *FLAGS, f"-DDETCOMM_W={world}", "-c", str(CSRC / cu), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@needs_nvcc
@pytest.mark.parametrize("cu", ["one_shot.cu", "two_shot.cu", "reduce_scatter.cu", "fold_local.cu"])
def test_ptx_has_no_fma_and_no_ftz(cu, tmp_path):
    out = tmp_path / "k.ptx"
    p = subprocess.run([NVCC, *FLAGS, "-DDETCOMM_W=4", "-ptx", str(CSRC / cu), "-o", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    ptx = out.read_text()
    assert not re.search(r"\bfma\.", ptx)
    assert ".ftz" not in ptx
    assert "add.rn.f32" in ptx and "cvt.rn.bf16.f32" in ptx and "cvt.rn.f16.f32" in ptx
    assert not re.search(r"\badd\.f32", ptx)  # every fp32 add names its rounding
    if cu != "fold_local.cu":  # the only kernel without barriers
        assert "st.release.sys" in ptx and "ld.acquire.sys" in ptx and "%globaltimer" in ptx and "trap;" in ptx


@needs_nvcc
def test_rotated_negative_control_compiles_differently(tmp_path):
    ptx = {}
    for variant, extra in (("canonical", []), ("rotated", [f"-D{kernels.ROTATE_MACRO}=1"])):
        out = tmp_path / f"{variant}.ptx"
        p = subprocess.run([NVCC, *FLAGS, "-DDETCOMM_W=3", *extra, "-ptx", str(CSRC / "one_shot.cu"), "-o", str(out)],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        ptx[variant] = out.read_text()
    assert ptx["canonical"] != ptx["rotated"]


def test_nvrtc_options_are_exact():
    opts = kernels.nvrtc_options(4, "sm_90")
    assert "--fmad=false" in opts and "-ftz=false" in opts and "-prec-div=true" in opts and "-prec-sqrt=true" in opts
    assert "-arch=sm_90" in opts and "--std=c++17" in opts and "-DDETCOMM_W=4" in opts
    assert not any("fast" in o or "ftz=true" in o for o in opts)
    assert kernels.ROTATE_MACRO not in " ".join(opts)
    assert f"-D{kernels.ROTATE_MACRO}=1" in kernels.nvrtc_options(4, "sm_90", rotated=True)
    with pytest.raises(ValueError):
        kernels.nvrtc_options(9, "sm_90")
    with pytest.raises(ValueError):
        kernels.nvrtc_options(2, "compute_90; rm -rf")


def test_flattened_source_inlines_each_header_once():
    src = kernels.flatten_source()
    assert "#include \"" not in src
    assert src.count("struct Group {") == 1
    for cu in CU_FILES:
        assert f"// ---- {cu}" in src


def test_nvrtc_compiles_the_runtime_module(tmp_path, monkeypatch):
    pytest.importorskip("cupy")
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - no NVRTC library on this machine
        pytest.skip(f"NVRTC unavailable: {e}")
    monkeypatch.setenv("DETCOMM_CACHE_DIR", str(tmp_path))
    src = kernels.flatten_source()
    cubin = kernels.compile_cubin(src, kernels.nvrtc_options(3, "sm_90"))
    assert cubin[:4] == b"\x7fELF"
    assert len(list(tmp_path.glob("*.cubin"))) == 1
    assert kernels.compile_cubin(src, kernels.nvrtc_options(3, "sm_90")) == cubin  # served from the cache
