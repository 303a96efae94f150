"""The small interface every route implements.

The communicator validates inputs and decides the route before a backend sees a tensor; a backend only moves
and reduces. Every method is collective over the backend's group: all ranks call it in the same order with
tensors of the same dtype and trailing shape. A backend that cannot carry a collective simply lacks the
method; routing never sends it one (route.py's table of what each route carries).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..route import ReduceOp, Route


@runtime_checkable
class Backend(Protocol):
    route: Route

    def all_reduce(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """A new tensor holding the reduction of every rank's ``x`` (same shape and dtype)."""
        ...

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """Rank r's row block r (``x.shape[0] // W`` rows) of the reduction of every rank's ``x``."""
        ...
