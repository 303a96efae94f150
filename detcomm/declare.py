"""A site's declaration from the caller's arguments: the dtype, the trailing shape and the enumerations as
``Site`` takes them (each refusal names the site), what one call at max_rows carries against the device's
memory, and where an implicit declaration (an undeclared site's first call) came from. Local: no group."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch

from .dtypes import SUPPORTED_DTYPES, from_name
from .sites import Site

__all__ = ["dtype_of", "shape_of", "member", "site_bytes", "allocatable", "caller"]


def dtype_of(dtype: object, name: str) -> torch.dtype:
    """A site's dtype: a torch dtype, or its name ("bfloat16")."""
    if isinstance(dtype, str):
        return from_name(dtype.removeprefix("torch."))
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"site {name!r}: dtype must be a torch.dtype or its name (\"bfloat16\"), got {dtype!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"site {name!r}: dtype {dtype} is not supported; use one of "
                         f"{[str(d) for d in SUPPORTED_DTYPES]}")
    return dtype


def shape_of(shape: object, name: str) -> tuple[int, ...]:
    """A site's ``shape=`` argument as a tuple: one row's trailing shape, an int (one dimension, as torch accepts
    an int for a 1-D size) or a sequence of ints. The ints themselves are checked by ``Site``."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        return (shape,)
    if isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)):
        return tuple(shape)
    raise TypeError(
        f"site {name!r}: shape= is one row's trailing shape: an int (the row width, e.g. 4096) or a sequence of "
        f"ints (e.g. (8, 128); () for scalar rows), got {shape!r} ({type(shape).__name__})"
    )


def site_bytes(s: Site, world_size: int) -> int:
    """What one call at max_rows passes on this rank: max_rows rows of the site's trailing shape (the fp32
    partials of V/W shards per row on a virtual-shard site)."""
    if s.virtual_shards is not None:
        return s.max_rows * s.row_numel * 4 * max(1, s.virtual_shards // world_size)
    return s.max_rows * s.row_numel * s.dtype.itemsize


def allocatable(device: torch.device) -> int:
    """The device's total memory in bytes (total, not free: the same on every rank of one host and at any time,
    so every rank reaches the same verdict; what is free is the allocator's to report). Unknown: no limit."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # no sysconf on this platform
        return sys.maxsize


def caller() -> str:
    """file:line of the first frame outside detcomm (where an implicit declaration came from)."""
    here = os.path.dirname(os.path.abspath(__file__))
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(here + os.sep):
        f = f.f_back  # type: ignore[assignment]
    return "unknown caller" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


def member(cls, value, what: str, site: object = None):  # type: ignore[no-untyped-def]
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        where = f"site {site.name if isinstance(site, Site) else site!r}: " if site is not None else ""
        raise ValueError(f"{where}unknown {what} {value!r}; expected one of {[m.value for m in cls]}") from None
