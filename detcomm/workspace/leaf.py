"""The CUDA fold leaf: the canonical fold of W local buffers by csrc/fold_local.cu (the same fold_pack every
workspace kernel runs), registered above the portable torch leaf for CUDA tensors.

The torch leaf makes W + 2 passes with an fp32 temporary (measured on an H200 at about 12% of a
device-to-device copy's bandwidth); this kernel reads each input once and writes the output once (92-101% of
the copy). gather_fold and a2a_fold on GPUs select it through the leaf registry; the startup self-checks
compare it with the reference fold on the group before any site uses it.

Registered only where cupy is importable (a static fact of the installation): without cupy the portable leaf
serves, instead of a leaf that would fail at its first call.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import torch

from ..dtypes import FLOAT_DTYPES, info
from ..fold import BATCH_INVARIANT, Leaf, Priority, register_leaf
from . import plan

__all__ = ["cuda_fold", "LEAF"]



def cuda_fold(stacked: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``stacked`` [W, *rest] on a CUDA device -> [*rest] in the same dtype (the kernel rounds to its input
    dtype). Not capturable in a CUDA graph (it uploads a W-entry pointer table per call)."""
    if out_dtype != stacked.dtype or stacked.dtype not in FLOAT_DTYPES:
        raise ValueError(f"the CUDA fold leaf folds {FLOAT_DTYPES} into the same dtype, got {stacked.dtype} -> {out_dtype}")
    if not stacked.is_cuda or not stacked.is_contiguous():
        raise ValueError("the CUDA fold leaf takes a contiguous CUDA tensor [W, *rest]")
    w = stacked.shape[0]
    if not 1 <= w <= plan.MAX_WORLD:
        raise ValueError(f"the CUDA fold leaf folds 1..{plan.MAX_WORLD} inputs, got {w}")
    from .kernels import kernel_set

    out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    n = out.numel()
    if n == 0:
        return out
    step = n * stacked.element_size()
    # Pinned and non-blocking: a pageable upload would make the host wait for the stream to drain before every
    # call, so back-to-back folds could never overlap their launch cost with the previous fold's work. torch's
    # pinned-memory cache keeps the host block alive until the copy has run.
    ptrs = torch.tensor([stacked.data_ptr() + r * step for r in range(w)], dtype=torch.int64, pin_memory=True)
    table = ptrs.to(stacked.device, non_blocking=True)
    ks = kernel_set(stacked.device.index, w)
    packs = -(-n * stacked.element_size() // plan.PACK_BYTES)
    sms = _sm_count(stacked.device.index)
    # Elementwise, no barriers: the grid changes only the schedule, never an element's arithmetic.
    grid = max(1, min(4 * sms, -(-packs // plan.BLOCK_THREADS)))
    args = [ctypes.c_uint64(table.data_ptr()), ctypes.c_uint64(out.data_ptr()), ctypes.c_int64(n)]
    ks.launch(f"detcomm_fold_local_{info(stacked.dtype).suffix}", grid, args,
              stream_ptr=torch.cuda.current_stream(stacked.device).cuda_stream)
    return out


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


LEAF = Leaf(name="cuda_nvrtc", fold=cuda_fold, priority=Priority.VENDOR, features=frozenset({BATCH_INVARIANT}),
            device_types=frozenset({"cuda"}))

if importlib.util.find_spec("cupy") is not None:
    register_leaf(LEAF)
