"""Every csrc/*.cu compiles for sm_90 with nvcc (no GPU needed), and the generated code keeps docs/spec.md §1's
arithmetic: no FMA, no flush-to-zero, round-to-nearest adds and conversions. Also the run-time NVRTC path,
where cupy's NVRTC is importable.

The heavy builds (whole modules, every file at three widths) go through tests/nvcc_builds.py: each distinct nvcc
command runs once per session, and a test submits all of its builds before reading one, so they run side by side
on the machine's cores. The command lines are the ones each check always ran."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from detcomm.workspace import kernels
from nvcc_builds import Build, Builds

CSRC = Path(__file__).resolve().parents[1] / "csrc"
# rms_norm.cu is its own run-time module (detcomm/numerics/norm_cuda.py), checked by tests/test_norm_csrc.py.
CU_FILES = sorted(p.name for p in CSRC.glob("*.cu") if p.name != "rms_norm.cu")
NVCC = shutil.which("nvcc")
# The run-time options (kernels.nvrtc_options) spelled for nvcc, the device constants included (their one source is
# plan.DEVICE_CONSTANTS: the headers define none).
BASE = ["-arch=sm_90", "-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true"]
FLAGS = [*BASE, *kernels.constant_options()]

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")


@pytest.fixture(scope="module")
def builds() -> Iterator[Builds]:
    """This file's nvcc builds (tests/nvcc_builds.py), removed with the module."""
    assert NVCC is not None
    workdir = Path(tempfile.mkdtemp(prefix="detcomm-nvcc-"))
    b = Builds(NVCC, workdir)
    try:
        yield b
    finally:
        b.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _module_options(world: int, arch: str = "sm_90", *, module: str | None = None, build: str = "canonical"
                    ) -> list[str]:
    """A run-time module's exact NVRTC options (kernels.nvrtc_options) spelled for nvcc: the same set as FLAGS (or
    BASE with `build`'s constants) plus W and the module's dtype, so every check of one module shares its build."""
    return [o.replace("--std=", "-std=") for o in kernels.nvrtc_options(world, arch, module=module, build=build)]


def test_every_kernel_file_is_in_the_runtime_module():
    assert set(CU_FILES) == set(kernels.KERNEL_FILES)


@pytest.fixture(scope="module")
def objects(request: pytest.FixtureRequest, builds: Builds) -> Callable[[str, int], Build]:
    """test_nvcc_compiles' builds: on first use, every selected case's build is submitted at once."""
    def submit(cu: str, world: int) -> Future[Build]:
        return builds.submit(CSRC / cu, [*FLAGS, f"-DDETCOMM_W={world}"], "obj")

    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) == "test_nvcc_compiles" and item.path == Path(__file__) and spec:
            submit(spec.params["cu"], spec.params["world"])
    return lambda cu, world: submit(cu, world).result()


@needs_nvcc
@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("cu", CU_FILES)
def test_nvcc_compiles(cu, world, objects):
    p = objects(cu, world)
    assert p.returncode == 0, p.stderr


@needs_nvcc
@pytest.mark.parametrize("cu", ["one_shot.cu", "two_shot.cu", "reduce_scatter.cu", "fold_local.cu", "virtual_fold.cu",
                                "tree_fold.cu"])
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
        assert "st.release.sys" in ptx and "ld.acquire.sys" in ptx and "%globaltimer" in ptx
        assert "ld.relaxed.sys" in ptx  # the spins poll the abort word
        assert "trap;" not in ptx  # a failing barrier returns; it never destroys the context


@needs_nvcc
def test_headers_refuse_to_compile_without_the_device_constants(tmp_path):
    """The device constants exist once (plan.DEVICE_CONSTANTS): a build missing one stops at the header's #error,
    which names the fix. The control: the same preprocessing with every constant passes."""
    dropped = [o for o in kernels.constant_options() if not o.startswith("-DDETCOMM_PACK_BYTES=")]
    assert len(dropped) == len(kernels.constant_options()) - 1
    for constants, ok in ((kernels.constant_options(), True), (dropped, False)):
        p = subprocess.run([NVCC, *BASE, *constants, "-DDETCOMM_W=2", "-E", str(CSRC / "one_shot.cu"), "-o",
                            str(tmp_path / "one_shot.i")], capture_output=True, text=True)
        assert (p.returncode == 0) is ok, p.stderr[-2000:]
        assert ok or "kernels.constant_options()" in p.stderr, p.stderr[-2000:]


@needs_nvcc
def test_trap_only_in_the_debug_build(tmp_path):
    out = tmp_path / "k.ptx"
    p = subprocess.run([NVCC, *FLAGS, "-DDETCOMM_W=2", "-DDETCOMM_TRAP_ON_FAILURE=1", "-ptx", str(CSRC / "one_shot.cu"),
                        "-o", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "trap;" in out.read_text()
    assert "-DDETCOMM_TRAP_ON_FAILURE=1" in kernels.nvrtc_options(2, "sm_90", trap=True)
    assert not any("TRAP" in o for o in kernels.nvrtc_options(2, "sm_90"))


def _nvcc_cubin(builds):
    def compile_fn(source, options):
        p = builds.get(source, [o.replace("--std=", "-std=") for o in options], "cubin")
        if p.returncode:
            raise RuntimeError(p.errors())
        return p.output
    return compile_fn


@needs_nvcc
def test_each_dtype_is_its_own_module_and_is_refused_alone(builds):
    """sm_75 has no cvt.rn.bf16.f32: only the bf16 module is refused; fp32, fp16 and the all-gather build. On
    sm_90 every module builds. (Without per-dtype modules the one unit fails as a whole on sm_75.)"""
    compile_fn = _nvcc_cubin(builds)
    source = kernels.flatten_source()
    for arch in ("sm_75", "sm_90"):  # the nine builds below, side by side
        for module in kernels.MODULE_DTYPE_CODES:
            builds.submit(source, _module_options(2, arch, module=module), "cubin")
    builds.submit(source, _module_options(2, "sm_75"), "cubin")
    old = kernels.compile_modules(2, "sm_75", compile_fn=compile_fn)
    assert set(old) == set(kernels.MODULE_DTYPE_CODES)
    assert isinstance(old["bfloat16"], str) and "sm_80" in old["bfloat16"], old["bfloat16"]
    assert all(isinstance(old[m], bytes) for m in ("float32", "float16", "bytes")), old
    new = kernels.compile_modules(2, "sm_90", compile_fn=compile_fn)
    assert all(isinstance(v, bytes) and v[:4] == b"\x7fELF" for v in new.values()), new
    with pytest.raises(RuntimeError):  # the negative control: all dtypes in one unit fail together on sm_75
        compile_fn(kernels.flatten_source(), kernels.nvrtc_options(2, "sm_75"))


@needs_nvcc
def test_dtype_module_holds_only_its_kernels(tmp_path):
    for module, code in kernels.MODULE_DTYPE_CODES.items():
        out = tmp_path / f"{module}.ptx"
        p = subprocess.run([NVCC, *FLAGS, "-DDETCOMM_W=2", f"-DDETCOMM_DTYPE={code}", "-ptx", str(CSRC / "one_shot.cu"),
                            "-o", str(out)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        entries = set(re.findall(r"\.entry (\w+)", out.read_text()))
        want = {n for n in kernels.module_functions(module) if n.startswith("detcomm_one_shot")}
        assert entries == want, (module, entries)


@needs_nvcc
@pytest.mark.parametrize("cu", ["one_shot.cu", "virtual_fold.cu", "tree_fold.cu"])
def test_rotated_negative_control_compiles_differently(cu, tmp_path):
    ptx = {}
    for build, extra in (("canonical", []), ("rotated", [f"-D{kernels.ROTATE_MACRO}=1"])):
        out = tmp_path / f"{build}.ptx"
        p = subprocess.run([NVCC, *FLAGS, "-DDETCOMM_W=3", *extra, "-ptx", str(CSRC / cu), "-o", str(out)],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        ptx[build] = out.read_text()
    assert ptx["canonical"] != ptx["rotated"]


def _ptx(tmp_path, cu, world, *extra):
    out = tmp_path / f"{cu}.{world}.{len(extra)}.ptx"
    p = subprocess.run([NVCC, *FLAGS, f"-DDETCOMM_W={world}", *extra, "-ptx", str(CSRC / cu), "-o", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return out.read_text()


@needs_nvcc
@pytest.mark.parametrize("cu", ["one_shot.cu", "two_shot.cu", "reduce_scatter.cu"])
def test_one_rank_folds_without_slot_or_barrier(cu, tmp_path):
    """W = 1: the fold goes straight from x to out: no flag store, no acquire, no busy word (atomic), no deadline
    clock. The control: the same kernel at W = 2 has all of them."""
    one, two = _ptx(tmp_path, cu, 1), _ptx(tmp_path, cu, 2)
    for marker in ("st.release.sys", "ld.acquire.sys", "%globaltimer", "atom."):
        assert marker not in one and marker in two, marker
    assert "add.rn.f32" in one and "cvt.rn.bf16.f32" in one


@needs_nvcc
def test_single_copy_negative_control_compiles_differently(tmp_path):
    assert _ptx(tmp_path, "two_shot.cu", 3) != _ptx(tmp_path, "two_shot.cu", 3, "-DDETCOMM_TEST_SINGLE_COPY=1")


@needs_nvcc
def test_uncounted_skip_negative_control_compiles_differently(tmp_path):
    """The control build's skipping blocks store no flag (relaxed remote stores) and count nothing."""
    canonical = _ptx(tmp_path, "one_shot.cu", 3)
    control = _ptx(tmp_path, "one_shot.cu", 3, "-DDETCOMM_TEST_UNCOUNTED_SKIP=1")
    assert canonical.count("st.relaxed.sys") > control.count("st.relaxed.sys"), "skip_use stores no flag"


@needs_nvcc
def test_virtual_fold_entry_points_per_dtype_module(tmp_path):
    """Each dtype module of csrc/virtual_fold.cu defines exactly the two virtual kernels module_functions lists."""
    for module, code in kernels.MODULE_DTYPE_CODES.items():
        out = tmp_path / f"{module}.ptx"
        p = subprocess.run([NVCC, *FLAGS, "-DDETCOMM_W=4", f"-DDETCOMM_DTYPE={code}", "-ptx",
                            str(CSRC / "virtual_fold.cu"), "-o", str(out)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        entries = set(re.findall(r"\.entry (\w+)", out.read_text()))
        want = {n for n in kernels.module_functions(module) if n.startswith("detcomm_virtual_")}
        assert entries == want and (module == "bytes" or len(want) == 2), (module, entries)


def test_nvrtc_options_are_exact():
    opts = kernels.nvrtc_options(4, "sm_90")
    assert "--fmad=false" in opts and "-ftz=false" in opts and "-prec-div=true" in opts and "-prec-sqrt=true" in opts
    assert "-arch=sm_90" in opts and "--std=c++17" in opts and "-DDETCOMM_W=4" in opts
    assert not any("fast" in o or "ftz=true" in o for o in opts)
    assert kernels.ROTATE_MACRO not in " ".join(opts) and "DETCOMM_DTYPE" not in " ".join(opts)
    assert f"-D{kernels.ROTATE_MACRO}=1" in kernels.nvrtc_options(4, "sm_90", build="rotated")
    assert "-DDETCOMM_TEST_STALE_FLAGS=1" in kernels.nvrtc_options(4, "sm_90", build="stale_flags")
    assert "-DDETCOMM_TEST_SINGLE_COPY=1" in kernels.nvrtc_options(4, "sm_90", build="single_copy")
    assert "-DDETCOMM_TEST_UNCOUNTED_SKIP=1" in kernels.nvrtc_options(4, "sm_90", build="uncounted_skip")
    assert "-DDETCOMM_DTYPE=1" in kernels.nvrtc_options(4, "sm_90", module="bfloat16")
    with pytest.raises(ValueError):
        kernels.nvrtc_options(4, "sm_90", build="fast")
    with pytest.raises(ValueError):
        kernels.nvrtc_options(4, "sm_90", module="int8")
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
    cubin = kernels.compile_cubin(src, kernels.nvrtc_options(3, "sm_90", module="float32"))
    assert cubin[:4] == b"\x7fELF"
    assert len(list(tmp_path.glob("*.cubin"))) == 1
    assert kernels.compile_cubin(src, kernels.nvrtc_options(3, "sm_90", module="float32")) == cubin  # from the cache


def _spill_stores(builds: Builds, world: int, module: str, build: str = "canonical", *, submit_only: bool = False
                  ) -> dict[str, int]:
    """ptxas's spill-store bytes of every kernel of one run-time module (the flattened source NVRTC builds, its
    options; ptxas -v). `submit_only`: start the build and return at once."""
    fut = builds.submit(kernels.flatten_source(), _module_options(world, module=module, build=build), "cubin")
    if submit_only:
        return {}
    p = fut.result()
    assert p.returncode == 0, p.stderr
    found = re.findall(r"Function properties for (\w+)\s*\n\s*\d+ bytes stack frame, (\d+) bytes spill stores", p.stderr)
    return {name: int(b) for name, b in found}


@needs_nvcc
def test_fused_kernels_keep_their_registers_at_decode_widths(builds):
    """W = 2, bf16 rows and weight: no fused kernel spills, row or wide. A load batch of 4 chunks per lane made the
    one-store variant spill 380 bytes per thread, which cost it 2.1 us per call at 1 row of 4096
    (csrc/fused_norm_row.cuh, docs/performance.md); the three row layouts in one kernel spilled too, which is
    why the wide layout has kernels of its own. The control: the bench's fused_batch4 build spills again."""
    _spill_stores(builds, 2, "bfloat16", "fused_batch4", submit_only=True)
    canonical = _spill_stores(builds, 2, "bfloat16")
    fused = {n: b for n, b in canonical.items() if n.startswith("detcomm_fused_rmsnorm_") and n.endswith("_wbf16")
             and "_tree_" not in n}
    assert len(fused) == 6 and all(b == 0 for b in fused.values()), fused
    batch4 = _spill_stores(builds, 2, "bfloat16", "fused_batch4")
    assert batch4["detcomm_fused_rmsnorm_one_store_bf16_wbf16"] > 0, batch4


def _layout_asserts(builds: Builds, world: int, want: dict[str, int], build: str = "canonical"
                    ) -> Future[Build]:
    """Compiles csrc/fused_norm_row.cuh with one static_assert per dtype: the header's C (kBatch * 256 * 8, the
    elements one half holds in registers) equals `want[dtype]`."""
    codes = {"float32": "DT_F32", "bfloat16": "DT_BF16", "float16": "DT_F16"}
    body = "".join(f"static_assert((long long)FnChunk<{codes[d]}>::kBatch * NORM_THREADS * NORM_CHUNK == {c}LL, "
                   f"\"C of {d}\");\n" for d, c in want.items())
    return builds.submit(kernels.flatten_source(["fused_norm_row.cuh"]) + body,
                         [*BASE, *kernels.constant_options(build), f"-DDETCOMM_W={world}"], "obj")


@needs_nvcc
def test_the_host_layout_rule_mirrors_the_header(builds):
    """plan.fused_norm_register_elems (which picks the row or the wide kernel on the host) equals the header's C
    for every W and dtype, in the canonical build and the bench's batch-4 build; a wrong value fails to compile
    (the control), so the check can fail."""
    from detcomm.workspace import plan

    cases = {}
    for world in range(1, plan.MAX_WORLD + 1):
        for batch, build in ((plan.FUSED_NORM_BATCH, "canonical"), (kernels.FUSED_LAYOUT["fused_batch4"]["batch"],
                                                                    "fused_batch4")):
            want = {d: plan.fused_norm_register_elems(d, world, batch=batch) for d in ("float32", "bfloat16", "float16")}
            cases[world, batch] = _layout_asserts(builds, world, want, build)
    control = _layout_asserts(builds, 2, {"bfloat16": 2 * plan.fused_norm_register_elems("bfloat16", 2)})
    for (world, batch), fut in cases.items():
        p = fut.result()
        assert p.returncode == 0, (world, batch, p.stderr[-2000:])
    p = control.result()
    assert p.returncode != 0 and "C of bfloat16" in p.stderr


@needs_nvcc
def test_tree_fold_entry_points_per_dtype_module(tmp_path):
    """Each dtype module of csrc/tree_fold.cu defines exactly the three tree kernels module_functions lists (the
    names plan.tree_kernel gives the host)."""
    for module, code in kernels.MODULE_DTYPE_CODES.items():
        out = tmp_path / f"{module}.ptx"
        p = subprocess.run([NVCC, *FLAGS, "-DDETCOMM_W=4", f"-DDETCOMM_DTYPE={code}", "-ptx",
                            str(CSRC / "tree_fold.cu"), "-o", str(out)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        entries = set(re.findall(r"\.entry (\w+)", out.read_text()))
        want = {n for n in kernels.module_functions(module) if n.startswith("detcomm_tree_")}
        assert entries == want and (module == "bytes" or len(want) == 3), (module, entries)


@needs_nvcc
@pytest.mark.parametrize("world", [2, 4, 8])
def test_tree_kernels_keep_their_registers(world, builds):
    """No tree kernel spills at W = 2 / 4 in any dtype, nor the barrier ones at W = 8; the one-store kernel of
    16-bit dtypes at W = 8 spills at most 16 bytes per thread (csrc/tree_fold.cu: the wide-subtree counter is out
    of line for it). The control: that counter inlined spills more there."""
    alt_src = kernels.flatten_source(["tree_fold.cu"])
    assert "__device__ __noinline__ void tree_local_blocks" in alt_src
    alt_src = alt_src.replace("__device__ __noinline__ void tree_local_blocks",
                              "__device__ __forceinline__ void tree_local_blocks")
    alt = builds.submit(alt_src, _module_options(8, module="bfloat16"), "cubin") if world == 8 else None
    for module in ("float32", "bfloat16", "float16"):  # side by side (W = 2: the dtype-module test's builds)
        _spill_stores(builds, world, module, submit_only=True)
    for module in ("float32", "bfloat16", "float16"):
        spills = _spill_stores(builds, world, module)
        tree = {n: b for n, b in spills.items() if n.startswith("detcomm_tree_")}
        assert len(tree) == 3, tree
        for name, b in tree.items():
            bound = 16 if world == 8 and "one_store" in name and module != "float32" else 0
            assert b <= bound, (module, tree)
    if alt is None:
        return
    p = alt.result()
    assert p.returncode == 0, p.stderr
    found = dict(re.findall(r"Function properties for (detcomm_tree_\w+)\s*\n\s*\d+ bytes stack frame, (\d+) bytes "
                            r"spill", p.stderr))
    assert int(found["detcomm_tree_one_store_bf16"]) > 16, found


@needs_nvcc
def test_every_listed_kernel_is_an_entry_of_its_module(builds):
    """KernelSet loads exactly kernels.module_functions(module) from each module: a name missing from the module's
    code would refuse the whole module at run time. Each module's flattened source (what NVRTC builds) defines
    every listed name and nothing else. (The PTX is the one the module's cubin build generates on the way: the
    dtype-module test's W = 2 builds.)"""
    src = kernels.flatten_source()
    futs = {m: builds.submit(src, _module_options(2, module=m), "cubin") for m in kernels.MODULE_DTYPE_CODES}
    for module, fut in futs.items():
        p = fut.result()
        assert p.returncode == 0 and p.ptx, p.stderr[-2000:]
        entries = set(re.findall(r"\.entry (\w+)", p.ptx))
        assert entries == set(kernels.module_functions(module)), (module, entries ^ set(kernels.module_functions(module)))
