"""The CUDA fold leaf: the canonical fold of W local buffers by csrc/fold_local.cu (the same fold_pack every
workspace kernel runs), registered above the portable torch leaf for CUDA tensors.

The torch leaf makes W + 2 passes with an fp32 temporary (measured on an H200 at about 12% of a
device-to-device copy's bandwidth); this kernel reads each input once and writes the output once (92-101% of
the copy). gather_fold and a2a_fold on GPUs select it through the leaf registry; the startup self-checks
compare it with the reference fold on the group before any site uses it.

Capturable: the kernel takes the stacked tensor's base pointer and row stride as scalars (no pointer table to
upload), so a fold inside a CUDA graph replays with whatever the stacked buffer holds then. The kernels must be
loaded before capture; the self-checks' first fold does that.

Registered only where cupy is importable (a static fact of the installation). Where the kernels cannot be built
(no NVRTC, or an architecture that lacks a dtype's conversions, such as bf16 before sm_80) the fold of that dtype
falls back to the portable torch leaf, the same canonical fold (same bits, slower), with one warning: an
optional leaf never makes init fail.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging

import torch

from ..dtypes import FLOAT_DTYPES, info
from ..errors import CaptureUnprepared
from ..workspace import plan
from .fold import BATCH_INVARIANT, Leaf, Priority, portable_fold, register_leaf

__all__ = ["cuda_fold", "LEAF"]

_LOG = logging.getLogger("detcomm.numerics.cuda_leaf")
_BROKEN: dict[tuple[int, int], str] = {}  # (device, W) -> why the kernel set could not load: warned once


def _kernels(device_index: int, w: int):  # type: ignore[no-untyped-def]
    """The loaded kernel set, or None (with one warning) where it cannot be built. Under CUDA graph capture only
    an already-loaded set is used: loading there is a usage error, raised."""
    from ..workspace.kernels import kernel_set, loaded_kernel_set

    if (device_index, w) in _BROKEN:
        return None
    if torch.cuda.is_current_stream_capturing():
        ks = loaded_kernel_set(device_index, w)
        if ks is None:
            raise CaptureUnprepared.before_capture("the CUDA fold leaf",
                                                   "run one fold (the startup self-checks do)")
        return ks
    try:
        return kernel_set(device_index, w)
    except Exception as e:  # noqa: BLE001 - an optional leaf that cannot build falls back to the portable fold
        _BROKEN[(device_index, w)] = f"{type(e).__name__}: {e}"
        _LOG.warning("CUDA fold leaf unavailable on cuda:%d (W=%d), using the portable fold (same bits): %s",
                     device_index, w, _BROKEN[(device_index, w)])
        return None


def cuda_fold(stacked: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``stacked`` [W, *rest] on a CUDA device -> [*rest] in the same dtype (the kernel rounds to its input
    dtype), or in fp32 (the unrounded fold ``op="avg"`` divides). Capturable in a CUDA graph once the kernels are
    loaded."""
    if stacked.dtype not in FLOAT_DTYPES or out_dtype not in (stacked.dtype, torch.float32):
        raise ValueError(f"the CUDA fold leaf folds {FLOAT_DTYPES} into the same dtype or float32, got "
                         f"{stacked.dtype} -> {out_dtype}")
    if not stacked.is_cuda or not stacked.is_contiguous():
        raise ValueError("the CUDA fold leaf takes a contiguous CUDA tensor [W, *rest]")
    if out_dtype != stacked.dtype:
        # A bf16/fp16 stack kept in fp32: the kernels round to their input dtype, so the portable fold (the same
        # arithmetic, bit for bit, in torch ops: capturable too) serves it.
        return portable_fold(stacked, out_dtype)
    w = stacked.shape[0]
    if not 1 <= w <= plan.MAX_WORLD:
        raise ValueError(f"the CUDA fold leaf folds 1..{plan.MAX_WORLD} inputs, got {w}")
    ks = _kernels(stacked.device.index, w)
    module = info(stacked.dtype).name
    if ks is None or not ks.available(module):
        if ks is not None and (stacked.device.index, w, module) not in _WARNED:
            _WARNED.add((stacked.device.index, w, module))
            _LOG.warning("CUDA fold leaf: %s kernels refused (%s), using the portable fold (same bits)", module,
                         ks.refused[module])
        return portable_fold(stacked, out_dtype)
    out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    n = out.numel()
    if n == 0:
        return out
    packs = -(-n * stacked.element_size() // plan.PACK_BYTES)
    sms = _sm_count(stacked.device.index)
    # Elementwise, no barriers: the grid changes only the schedule, never an element's arithmetic.
    grid = max(1, min(4 * sms, -(-packs // plan.BLOCK_THREADS)))
    args = [ctypes.c_uint64(stacked.data_ptr()), ctypes.c_int64(n), ctypes.c_uint64(out.data_ptr()), ctypes.c_int64(n)]
    ks.launch(f"detcomm_fold_local_{info(stacked.dtype).suffix}", grid, args,
              stream_ptr=torch.cuda.current_stream(stacked.device).cuda_stream)
    return out


_WARNED: set[tuple[int, int, str]] = set()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


LEAF = Leaf(name="cuda_nvrtc", fold=cuda_fold, priority=Priority.VENDOR, features=frozenset({BATCH_INVARIANT}),
            device_types=frozenset({"cuda"}))

if importlib.util.find_spec("cupy") is not None:
    register_leaf(LEAF)
