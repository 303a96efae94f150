"""Run-time compilation, disk cache and launch of the workspace kernels in csrc/*.cu.

How: csrc/*.cu (with their local #include "..." headers inlined, so the cache key covers every line) are compiled
by NVRTC through cupy's thin binding (cupy.cuda.nvrtc) into one cubin per dtype (-DDETCOMM_DTYPE; plus one for the
byte-moving all-gather) for the device's own architecture, so a dtype an architecture cannot convert (bf16 needs
sm_80) is refused alone and the others still load (`KernelSet.refused`). Cubins are cached
under ~/.cache/detcomm/kernels (or $DETCOMM_CACHE_DIR) keyed by sha256(source, options, arch, NVRTC version),
loaded with cupy.cuda.function.Module and launched on the caller's current torch stream. A GPU user has no build
step; `import detcomm` works without cupy or a GPU because cupy is imported only here, lazily.

Options, all spelled out (docs/spec.md §1 forbids contraction and flush-to-zero): --std=c++17, -arch=sm_XY of the device,
--fmad=false, -ftz=false, -prec-div=true, -prec-sqrt=true, -DDETCOMM_W=<W>, -DDETCOMM_DTYPE=<code>, and the device
constants of plan.DEVICE_CONSTANTS as -D<name>=<value> (their one source; the headers define none); never
--use_fast_math. DETCOMM_WORKSPACE_TRAP=1 in the environment adds -DDETCOMM_TRAP_ON_FAILURE: a failing barrier
then traps after writing its record (debugging only: a trap destroys the CUDA context of that rank).

Alternatives rejected:
- cupy.RawModule / RawKernel: its compile-with-cache path appends '-ftz=true' to the options
  (cupy/cuda/compiler.py, _compile_with_cache_cuda), which would flush fp32 subnormals to zero, exactly what
  docs/spec.md §1 rules out. The raw NVRTC binding compiles with our options and nothing else.
- torch.utils.cpp_extension (load / load_inline): needs a host compiler, nvcc and a build at first import on every
  machine, and adds a C++ ABI dependency on the torch build.
- Triton: no control of system-scope release/acquire flags or %globaltimer spins across processes, and its
  compiler may reassociate or contract floating-point operations.
- cuda-python / cuda.core: would work as well, but cupy also provides the IPC and pinned-memory calls the
  symmetric memory needs, so one dependency covers both.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import os
import re
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CaptureUnprepared, KernelBuildFailed
from . import plan


def _kernel_source_dir() -> Path:
    """Where the .cu sources are: the wheel ships csrc/ as the package ``detcomm.csrc`` (setup.py); a source tree
    run with PYTHONPATH=. has no such package and reads the checkout's csrc/ beside the detcomm folder."""
    try:
        root = importlib.resources.files("detcomm.csrc")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "csrc"
    return Path(str(root))


CSRC = _kernel_source_dir()
KERNEL_FILES = ("one_shot.cu", "two_shot.cu", "reduce_scatter.cu", "all_gather.cu", "fold_local.cu", "fused_rmsnorm.cu",
                "virtual_fold.cu", "one_store.cu", "fused_rmsnorm_one_store.cu", "tree_fold.cu")
ROTATE_MACRO = "DETCOMM_ROTATE_RANK_ORDER"
TRAP_ENV = "DETCOMM_WORKSPACE_TRAP"
# Kernel builds: the -D options a build adds to (or changes in) plan.DEVICE_CONSTANTS. "canonical" is the only
# build a workspace serves with; the others are reached only through detcomm.workspace.debug.
# Negative controls, each a build a test must catch: "rotated" folds in the wrong rank order, "stale_flags" lets a
# barrier pass on an earlier use's flag, "one_buffer" gives the one-store kernel a single buffer, "unmarked" pushes
# +0.0 unchanged (indistinguishable from an empty word), "single_copy" keeps one copy of the slots, flags and
# descriptors (no parity), "uncounted_skip" lets a block that owns no pack skip a launch without counting it (its
# parity then follows its own uses: csrc/detcomm_common.cuh skip_use).
# Bench builds, the same bits, timed against the canonical build (bench/fused_streams.py --build;
# csrc/fused_norm_row.cuh): "fused_batch4" gives the fused kernels a load batch of 4 chunks per lane instead of
# plan.FUSED_NORM_BATCH, "fused_no_wide" (the canonical cubins) never launches the wide kernels, so the rows they
# serve (hidden 4097-8192 in bf16 at W <= 4) stream. FUSED_LAYOUT says how each build's host picks the fused layout
# (plan.fused_norm_layout's batch and wide).
FUSED_LAYOUT: dict[str, dict[str, Any]] = {"fused_batch4": {"batch": 4}, "fused_no_wide": {"wide": False}}
BUILD_DEFINES: dict[str, dict[str, str]] = {
    "canonical": {},
    "fused_batch4": {"DETCOMM_FUSED_BATCH": str(FUSED_LAYOUT["fused_batch4"]["batch"])},
    "fused_no_wide": {},
    "rotated": {ROTATE_MACRO: "1"},
    "stale_flags": {"DETCOMM_TEST_STALE_FLAGS": "1"},
    "single_copy": {"DETCOMM_TEST_SINGLE_COPY": "1"},
    "uncounted_skip": {"DETCOMM_TEST_UNCOUNTED_SKIP": "1"},
    "one_buffer": {"DETCOMM_TEST_ONE_BUFFER": "1"},
    "unmarked": {"DETCOMM_TEST_UNMARKED": "1"},
}
# One module per dtype (csrc: DETCOMM_DTYPE, plan.DTYPE_CODES) and one for the byte-moving all-gather.
MODULE_DTYPE_CODES = {name: code for code, name in plan.DTYPE_CODES.items()}


def check_build(build: str) -> None:
    if build not in BUILD_DEFINES:
        raise ValueError(f"kernel build must be one of {sorted(BUILD_DEFINES)}, got {build!r}")


def constant_options(build: str = "canonical") -> tuple[str, ...]:
    """The -D options of the device constants (plan.DEVICE_CONSTANTS) with `build`'s additions: what every compile
    of csrc/ passes (NVRTC here, nvcc in the CPU checks); the headers refuse to compile without them."""
    check_build(build)
    return tuple(f"-D{name}={value}" for name, value in {**plan.DEVICE_CONSTANTS, **BUILD_DEFINES[build]}.items())


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


def _cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415  (lazy: detcomm imports without cupy or a GPU)
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("the CUDA-IPC workspace needs cupy (pip install cupy-cuda12x or cupy-cuda13x)") from e
    return cupy


def flatten_source(files: Sequence[str] = KERNEL_FILES, *, root: Path = CSRC) -> str:
    """One translation unit: the given .cu files with local headers inlined once each (#pragma once honoured)."""
    seen: set[Path] = set()
    out: list[str] = []

    def emit(path: Path) -> None:
        path = path.resolve()
        text = path.read_text()
        if any(_PRAGMA_ONCE.match(line) for line in text.splitlines()):
            if path in seen:
                return
            seen.add(path)
        out.append(f"// ---- {path.name}")
        for line in text.splitlines():
            m = _INCLUDE.match(line)
            if m:
                emit(path.parent / m.group(1))
            elif not _PRAGMA_ONCE.match(line):
                out.append(line)

    for f in files:
        emit(root / f)
    return "\n".join(out) + "\n"


def nvrtc_options(world_size: int, arch: str, *, module: str | None = None, build: str = "canonical",
                  trap: bool = False) -> tuple[str, ...]:
    """The exact NVRTC options of a module (no option is added behind our back: see the header), the device
    constants included (constant_options). `module` is a key of MODULE_DTYPE_CODES (None: every dtype in one unit,
    as the CPU compile check builds it)."""
    if not 1 <= world_size <= plan.MAX_WORLD:
        raise ValueError(f"world_size must be in 1..{plan.MAX_WORLD}, got {world_size}")
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    check_build(build)
    if module is not None and module not in MODULE_DTYPE_CODES:
        raise ValueError(f"module must be one of {sorted(MODULE_DTYPE_CODES)}, got {module!r}")
    opts: tuple[str, ...] = (
        "--std=c++17",
        f"-arch={arch}",
        "--fmad=false",
        "-ftz=false",
        "-prec-div=true",
        "-prec-sqrt=true",
        f"-DDETCOMM_W={world_size}",
    )
    if module is not None:
        opts += (f"-DDETCOMM_DTYPE={MODULE_DTYPE_CODES[module]}",)
    opts += constant_options(build)
    if trap:
        opts += ("-DDETCOMM_TRAP_ON_FAILURE=1",)
    return opts


def cache_dir() -> Path:
    return Path(os.environ.get("DETCOMM_CACHE_DIR") or Path.home() / ".cache" / "detcomm" / "kernels")


def compile_cubin(source: str, options: Sequence[str]) -> bytes:
    """Compile with NVRTC (no GPU needed) and return the cubin, from the disk cache when present."""
    from cupy.cuda import nvrtc  # noqa: PLC0415

    version = nvrtc.getVersion()
    key = hashlib.sha256(repr((source, tuple(options), version)).encode()).hexdigest()
    path = cache_dir() / f"{key}.cubin"
    if path.exists():
        return path.read_bytes()
    prog = nvrtc.createProgram(source, "detcomm_workspace.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise KernelBuildFailed(f"NVRTC failed to compile the workspace kernels ({e}):\n{log}") from None
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic publish: several ranks may compile the same module at once.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    os.replace(tmp, path)
    return cubin


@dataclass(frozen=True)
class ModuleKey:
    device_index: int
    world_size: int
    arch: str
    build: str
    trap: bool


def module_functions(module: str) -> list[str]:
    """The kernels one module defines."""
    if module == "bytes":
        return ["detcomm_all_gather"]
    sfx = plan.DTYPE_SUFFIX[module]
    return ([f"detcomm_{kind}_{sfx}" for kind in ("one_shot", "two_shot", "reduce_scatter", "fold_local",
                                                  "virtual_one_shot", "virtual_two_shot", "one_store")]
            + [plan.tree_kernel(algo, module) for algo in plan.TREE_ALGOS]
            + [plan.fused_norm_kernel(algo, module, w, wide=wide) for algo in plan.FUSED_NORM_ALGOS
               for w in plan.DTYPE_SUFFIX for wide in (False, True)]
            + [plan.fused_norm_kernel(algo, module, w, wide=wide, tree=True) for algo in plan.FUSED_NORM_TREE_ALGOS
               for w in plan.DTYPE_SUFFIX for wide in (False, True)])


def compile_modules(world_size: int, arch: str, *, build: str = "canonical", trap: bool = False,
                    compile_fn: Callable[[str, Sequence[str]], bytes] = compile_cubin) -> dict[str, bytes | str]:
    """Every module's cubin, or the reason it could not be built (a str): one failing dtype refuses only itself.
    No GPU needed; `compile_fn(source, options)` is NVRTC by default (the CPU test passes an nvcc-backed one)."""
    source = flatten_source()
    out: dict[str, bytes | str] = {}
    for module in MODULE_DTYPE_CODES:
        try:
            out[module] = compile_fn(source, nvrtc_options(world_size, arch, module=module, build=build, trap=trap))
        except Exception as e:  # noqa: BLE001 - reported as this module's refusal, never as the whole set's
            text = str(e).strip().splitlines()
            out[module] = f"{type(e).__name__}: " + " | ".join(text[:4])[:600]
    return out


class KernelSet:
    """The loaded workspace kernels of one (device, W, kernel build), one module per dtype. Get one with
    `kernel_set(...)`; loading is the only step that needs the GPU, and it must happen outside CUDA graph capture
    (Workspace.create does it). `refused` maps each module that could not be built or loaded to the reason."""

    def __init__(self, key: ModuleKey) -> None:
        cupy = _cupy()
        self.key = key
        self.refused: dict[str, str] = {}
        self._modules: list[Any] = []
        self._functions: dict[str, Any] = {}
        built = compile_modules(key.world_size, key.arch, build=key.build, trap=key.trap)
        with cupy.cuda.Device(key.device_index):
            cupy.cuda.runtime.deviceSynchronize()  # makes sure the primary context exists before cuModuleLoadData
            for module, cubin in built.items():
                if isinstance(cubin, str):
                    self.refused[module] = cubin
                    continue
                try:
                    m = cupy.cuda.function.Module()
                    m.load(cubin)
                    funcs = {name: m.get_function(name) for name in module_functions(module)}
                except Exception as e:  # noqa: BLE001 - a module the driver rejects is refused alone
                    self.refused[module] = f"load: {type(e).__name__}: {e}"
                    continue
                self._modules.append(m)
                self._functions.update(funcs)

    def available(self, module: str) -> bool:
        return module not in self.refused

    def fused_norm_layout(self, hidden: int, dtype: str) -> str:
        """plan.fused_norm_layout for this set's W and build: which fused kernel (row or wide) serves `hidden`."""
        return plan.fused_norm_layout(hidden, dtype, self.key.world_size, **FUSED_LAYOUT.get(self.key.build, {}))

    @staticmethod
    def names() -> list[str]:
        return [name for module in MODULE_DTYPE_CODES for name in module_functions(module)]

    def prepare(self, name: str, grid: int, args: Sequence[Any]) -> PreparedLaunch:
        """`name`'s launch with its parameter block built once from `args` (ctypes values in the kernel's
        parameter order): set the changing values in place (``args[i].value = ...``), then call it with the stream."""
        return PreparedLaunch(self._functions[name].ptr, grid, args)

    def launch(self, name: str, grid: int, args: Sequence[Any], *, stream_ptr: int) -> None:
        """Launch `name` with `grid` blocks of plan.BLOCK_THREADS on the raw CUDA stream `stream_ptr`.

        `args` are ctypes values in the kernel's parameter order. cuLaunchKernel is called directly (cupy's
        driver binding) so that no cupy stream object or argument conversion sits on the path, which also keeps
        the call legal during CUDA graph capture."""
        from cupy.cuda import driver  # noqa: PLC0415

        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        driver.launchKernel(self._functions[name].ptr, grid, 1, 1, plan.BLOCK_THREADS, 1, 1, 0, stream_ptr,
                            ctypes.addressof(params), 0)


class PreparedLaunch:
    """One kernel launch whose parameter block is allocated once (the per-call host cost of building ctypes values
    and a pointer array is most of a small launch's Python time). The caller owns the ctypes values and sets them
    before each call. Reusing the block is safe: cuLaunchKernel copies the parameters before it returns, also
    while a CUDA graph is being captured."""

    __slots__ = ("args", "_function", "_grid", "_params", "_params_ptr", "_launch")

    def __init__(self, function_ptr: int, grid: int, args: Sequence[Any]) -> None:
        from cupy.cuda import driver  # noqa: PLC0415

        self.args = list(args)  # kept alive: the block holds their addresses
        self._function = function_ptr
        self._grid = grid
        self._params = (ctypes.c_void_p * len(self.args))(*[ctypes.addressof(a) for a in self.args])
        self._params_ptr = ctypes.addressof(self._params)
        self._launch = driver.launchKernel

    def __call__(self, stream_ptr: int) -> None:
        self._launch(self._function, self._grid, 1, 1, plan.BLOCK_THREADS, 1, 1, 0, stream_ptr, self._params_ptr, 0)


_SETS: dict[ModuleKey, KernelSet] = {}
_LOCK = threading.Lock()


def _key(device_index: int, world_size: int, build: str) -> ModuleKey:
    import torch  # noqa: PLC0415

    major, minor = torch.cuda.get_device_capability(device_index)
    return ModuleKey(device_index, world_size, f"sm_{major}{minor}", build, os.environ.get(TRAP_ENV) == "1")


def loaded_kernel_set(device_index: int, world_size: int, *, build: str = "canonical") -> KernelSet | None:
    """The kernel set if already loaded in this process, else None (legal during CUDA graph capture)."""
    return _SETS.get(_key(device_index, world_size, build))


def kernel_set(device_index: int, world_size: int, *, build: str = "canonical") -> KernelSet:
    """Compile (or fetch from the disk cache) and load the kernels for this device and W. Not collective. A set
    already loaded is returned even under CUDA graph capture; loading a new one there raises."""
    import torch  # noqa: PLC0415

    key = _key(device_index, world_size, build)
    with _LOCK:
        ks = _SETS.get(key)
        if ks is None:
            if torch.cuda.is_current_stream_capturing():
                raise CaptureUnprepared.before_capture("the detcomm workspace",
                                                       "create the workspace (Workspace.create loads them)")
            ks = _SETS[key] = KernelSet(key)
        return ks
