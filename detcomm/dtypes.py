"""The dtypes detcomm handles, in one table: names, torch dtypes, element sizes, bit views, kernel suffixes.

Every other module asks here: the CLIs parse ``--dtype`` names with ``from_name``, the fold and the
invariance measurements view floats as same-width integers with ``bits_view``, the workspace sizes buffers
with ``info(...).size`` and picks kernels by ``info(...).suffix``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DtypeInfo", "TABLE", "FLOAT_DTYPES", "INT_DTYPES", "SUPPORTED_DTYPES", "FLOAT_NAMES", "info",
           "from_name", "name_of", "bits_view"]


@dataclass(frozen=True)
class DtypeInfo:
    """One dtype: ``name`` as the CLIs and JSON write it, ``size`` in bytes, ``bits`` the same-width signed
    integer dtype its bit patterns are viewed as, ``suffix`` the CUDA kernels' name suffix (floats only)."""

    name: str
    dtype: torch.dtype
    size: int
    bits: torch.dtype
    suffix: str | None = None

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point


TABLE: tuple[DtypeInfo, ...] = (
    DtypeInfo("float32", torch.float32, 4, torch.int32, "f32"),
    DtypeInfo("bfloat16", torch.bfloat16, 2, torch.int16, "bf16"),
    DtypeInfo("float16", torch.float16, 2, torch.int16, "f16"),
    DtypeInfo("int8", torch.int8, 1, torch.int8),
    DtypeInfo("uint8", torch.uint8, 1, torch.uint8),
    DtypeInfo("int32", torch.int32, 4, torch.int32),
    DtypeInfo("int64", torch.int64, 8, torch.int64),
)

_BY_DTYPE = {d.dtype: d for d in TABLE}
_BY_NAME = {d.name: d for d in TABLE}

FLOAT_DTYPES: tuple[torch.dtype, ...] = tuple(d.dtype for d in TABLE if d.is_float)
INT_DTYPES: tuple[torch.dtype, ...] = tuple(d.dtype for d in TABLE if not d.is_float)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = FLOAT_DTYPES + INT_DTYPES
FLOAT_NAMES: tuple[str, ...] = tuple(d.name for d in TABLE if d.is_float)


def info(dtype: torch.dtype) -> DtypeInfo:
    """The table's row for ``dtype``; ValueError naming the supported dtypes otherwise."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported; use one of {[d.name for d in TABLE]}") from None


def from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (the names ``name_of`` writes); ValueError for an unknown name."""
    try:
        return _BY_NAME[name].dtype
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {[d.name for d in TABLE]}") from None


def name_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return info(dtype).name


def bits_view(dtype: torch.dtype) -> torch.dtype:
    """The same-width integer dtype whose values are ``dtype``'s bit patterns (integers view as themselves)."""
    return info(dtype).bits
