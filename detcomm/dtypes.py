"""The dtypes detcomm handles, in one table: names, torch dtypes, element sizes, bit views, kernel suffixes.

Every other module asks here: the CLIs parse ``--dtype`` names with ``from_name``, the fold and the
invariance measurements view floats as same-width integers with ``bits_view``, the workspace sizes buffers
with ``info(...).size`` and picks kernels by ``info(...).suffix``. Names, sizes and float-ness are answered
without importing torch (``is_supported``, ``name_of``, ``is_float``, ``size_of`` take a torch dtype or its
name), so the static route view (``detcomm routes``) never loads torch; the torch-valued constants
(``TABLE``, ``FLOAT_DTYPES``, ...) are built on first access.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    # Built on first use (module ``__getattr__`` below): they hold torch dtypes, and the static route view
    # (``detcomm routes``) must not import torch.
    TABLE: tuple[DtypeInfo, ...]
    FLOAT_DTYPES: tuple[torch.dtype, ...]
    INT_DTYPES: tuple[torch.dtype, ...]
    SUPPORTED_DTYPES: tuple[torch.dtype, ...]

__all__ = ["DtypeInfo", "TABLE", "FLOAT_DTYPES", "INT_DTYPES", "SUPPORTED_DTYPES", "NAMES", "FLOAT_NAMES", "ALIASES", "info",
           "from_name", "name_of", "bits_view", "is_supported", "is_float", "size_of", "suffix_of"]


@dataclass(frozen=True)
class DtypeInfo:
    """One dtype: ``name`` as the CLIs and JSON write it, ``size`` in bytes, ``bits`` the same-width signed
    integer dtype its bit patterns are viewed as, ``suffix`` the CUDA kernels' name suffix and ``nan_bits`` the
    canonical NaN's bit pattern (docs/spec.md §1: the positive quiet NaN with a zero payload; floats only)."""

    name: str
    dtype: torch.dtype
    size: int
    bits: torch.dtype
    suffix: str | None = None
    nan_bits: int | None = None

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point


# The table by name, torch-free: name (torch's attribute name), size in bytes, the bit view's name, the CUDA
# kernels' suffix and the canonical NaN's bits (floats only, so a suffix marks a float).
_ROWS: tuple[tuple[str, int, str, str | None, int | None], ...] = (
    ("float32", 4, "int32", "f32", 0x7FC00000),
    ("bfloat16", 2, "int16", "bf16", 0x7FC0),
    ("float16", 2, "int16", "f16", 0x7E00),
    ("int8", 1, "int8", None, None),
    ("uint8", 1, "uint8", None, None),
    ("int32", 4, "int32", None, None),
    ("int64", 8, "int64", None, None),
)
_SIZE = {row[0]: row[1] for row in _ROWS}
_SUFFIX = {row[0]: row[3] for row in _ROWS if row[3] is not None}
NAMES: tuple[str, ...] = tuple(_SIZE)
FLOAT_NAMES: tuple[str, ...] = tuple(_SUFFIX)
# The spellings the command lines accept, by the table's name (each name spells itself too).
ALIASES: dict[str, str] = {
    **{name: name for name in NAMES},
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
    "int": "int32", "long": "int64",
}


@functools.cache
def _table() -> tuple[DtypeInfo, ...]:
    import torch

    return tuple(DtypeInfo(name, getattr(torch, name), size, getattr(torch, bits), suffix, nan_bits)
                 for name, size, bits, suffix, nan_bits in _ROWS)


@functools.cache
def _by_dtype() -> dict[torch.dtype, DtypeInfo]:
    return {d.dtype: d for d in _table()}


def __getattr__(name: str) -> Any:
    """PEP 562: the torch-valued constants, built (importing torch) on first access."""
    if name == "TABLE":
        return _table()
    if name in ("FLOAT_DTYPES", "INT_DTYPES", "SUPPORTED_DTYPES"):
        floats = tuple(d.dtype for d in _table() if d.name in FLOAT_NAMES)
        ints = tuple(d.dtype for d in _table() if d.name not in FLOAT_NAMES)
        return {"FLOAT_DTYPES": floats, "INT_DTYPES": ints, "SUPPORTED_DTYPES": floats + ints}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def info(dtype: torch.dtype) -> DtypeInfo:
    """The table's row for ``dtype``; ValueError naming the supported dtypes otherwise."""
    try:
        return _by_dtype()[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported; use one of {list(NAMES)}") from None


def from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (the names ``name_of`` writes); ValueError for an unknown name."""
    if name not in _SIZE:
        raise ValueError(f"unknown dtype {name!r}; use one of {list(NAMES)}")
    return next(d.dtype for d in _table() if d.name == name)


def _name(dtype: torch.dtype | str) -> str:
    # torch prints its dtypes as "torch.<name>"; the static view passes the bare name. Neither needs torch.
    return str(dtype).removeprefix("torch.")


def is_supported(dtype: torch.dtype | str) -> bool:
    """Whether detcomm handles ``dtype`` (a torch dtype, or its name as ``name_of`` writes it). Torch-free."""
    return _name(dtype) in _SIZE


def name_of(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a name passes through); ValueError for an unsupported dtype."""
    name = _name(dtype)
    if name not in _SIZE:
        raise ValueError(f"dtype {dtype} is not supported; use one of {list(NAMES)}")
    return name


def is_float(dtype: torch.dtype | str) -> bool:
    """Whether ``dtype`` (supported; a torch dtype or its name) is a floating-point dtype. Torch-free."""
    return name_of(dtype) in FLOAT_NAMES


def size_of(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype`` (supported; a torch dtype or its name). Torch-free."""
    return _SIZE[name_of(dtype)]


def suffix_of(dtype: torch.dtype | str) -> str:
    """The CUDA kernels' name suffix of float ``dtype`` (a torch dtype or its name). Torch-free."""
    name = name_of(dtype)
    if name not in _SUFFIX:
        raise ValueError(f"dtype {dtype} has no CUDA kernels; the kernels fold {list(FLOAT_NAMES)}")
    return _SUFFIX[name]


def bits_view(dtype: torch.dtype) -> torch.dtype:
    """The same-width integer dtype whose values are ``dtype``'s bit patterns (integers view as themselves)."""
    return info(dtype).bits
