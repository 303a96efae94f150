"""Run-time compilation and launch of csrc/rms_norm.cu, the GPU side of detcomm.numerics.norm.

The kernels compile exactly like the workspace's (detcomm.workspace.kernels: NVRTC through cupy's raw binding, the
options spelled out by ``nvrtc_options`` -- --fmad=false, -ftz=false, -prec-div=true, -prec-sqrt=true, never fast
math --, and the same on-disk cubin cache). cupy.RawModule is not used for the reason given there: its cached
compile path appends -ftz=true, which would flush the subnormals docs/spec.md §9 keeps. The norm needs no group,
so the module is built with DETCOMM_W=1 (the shared header insists on a value; the norm never reads it).

Launches go straight to cuLaunchKernel on torch's current stream, which keeps them legal inside CUDA graph
capture once the module is loaded (the first call on a device loads it; do that before capture).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

from ..dtypes import suffix_of
from ..errors import CaptureUnprepared
from ..workspace import kernels

__all__ = ["THREADS", "available", "rms_norm_cuda", "add_rms_norm_cuda"]

SOURCE_FILE = "rms_norm.cu"
THREADS = 256  # one block per row; the block's threads are the definition's 256 lanes (docs/spec.md §9)
_MAX_GRID = 65535  # rows beyond this are walked by a grid-stride loop; the bits do not depend on the grid

_MODULES: dict[int, Any] = {}
_FUNCTIONS: dict[tuple[int, str], Any] = {}
_LOCK = threading.Lock()


def available() -> bool:
    """Whether the NVRTC kernels can be used here (a CUDA device and cupy)."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def _module(device_index: int) -> Any:
    with _LOCK:
        mod = _MODULES.get(device_index)
        if mod is not None:
            return mod
        if torch.cuda.is_current_stream_capturing():
            raise CaptureUnprepared.before_capture("detcomm.rms_norm", "call it on this device")
        import cupy  # noqa: PLC0415

        major, minor = torch.cuda.get_device_capability(device_index)
        source = kernels.flatten_source((SOURCE_FILE,))
        cubin = kernels.compile_cubin(source, kernels.nvrtc_options(1, f"sm_{major}{minor}"))
        with cupy.cuda.Device(device_index):
            cupy.cuda.runtime.deviceSynchronize()  # the primary context must exist before cuModuleLoadData
            module = cupy.cuda.function.Module()
            module.load(cubin)
        _MODULES[device_index] = module
        return module


def _launch(name: str, device: torch.device, rows: int, args: list[Any]) -> None:
    from cupy.cuda import driver  # noqa: PLC0415

    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = _FUNCTIONS.get((index, name))
    if fn is None:
        fn = _FUNCTIONS[(index, name)] = _module(index).get_function(name)
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    stream = torch.cuda.current_stream(device).cuda_stream
    grid = max(1, min(rows, _MAX_GRID))
    driver.launchKernel(fn.ptr, grid, 1, 1, THREADS, 1, 1, 0, stream, ctypes.addressof(params), 0)


def rms_norm_cuda(r: torch.Tensor, weight: torch.Tensor, eps32: float) -> torch.Tensor:
    """y for contiguous r [rows, H] on a CUDA device (arguments already validated by detcomm.numerics.norm)."""
    rows, hidden = r.shape
    y = torch.empty_like(r)
    if rows:
        _launch(f"detcomm_rms_norm_{suffix_of(r.dtype)}_w{suffix_of(weight.dtype)}", r.device, rows,
                [ctypes.c_void_p(r.data_ptr()), ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                 ctypes.c_int64(rows), ctypes.c_int64(hidden), ctypes.c_float(eps32)])
    return y


def add_rms_norm_cuda(s: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps32: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r) for contiguous s, residual [rows, H] on a CUDA device, in one pass (validated by detcomm.numerics.norm)."""
    rows, hidden = s.shape
    y = torch.empty_like(s)
    r = torch.empty_like(s)
    if rows:
        _launch(f"detcomm_add_rms_norm_{suffix_of(s.dtype)}_w{suffix_of(weight.dtype)}", s.device, rows,
                [ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(residual.data_ptr()),
                 ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(r.data_ptr()),
                 ctypes.c_int64(rows), ctypes.c_int64(hidden), ctypes.c_float(eps32)])
    return y, r
