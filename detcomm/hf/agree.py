"""One verdict for the group on the local steps of loading a model.

Loading is local until the first collective (the sites' declarations): each rank reads its own files, its own
slices. A failure only some ranks meet (a slice past a short tensor's end, a file missing or cut short on one
host) would raise on those ranks while their peers went on into the first collective and waited there until the
deadline. ``agreed`` runs the local steps, then exchanges each rank's outcome (one object all-gather, on the
success path too: a load is rare and the exchange is microseconds) and, when any rank failed, raises the same
error on every rank, naming each rank that failed and what it found.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

import detcomm

__all__ = ["agreed"]

T = TypeVar("T")

# The failures a checkpoint or a config causes (what the user fixes): raised as ValueError on every rank. Any other
# exception (a bug, memory) is raised as RuntimeError on every rank, with the same message.
_CALLER = (ValueError, OSError)


def _is_caller(e: BaseException) -> bool:
    return isinstance(e, _CALLER) or type(e).__name__ == "SafetensorError"


def agreed(what: str, step: Callable[[], T]) -> T:
    """``step()`` (local) on every rank, then one verdict for the group: its value when it returned on every rank,
    else the same error on every rank (ValueError when every failure was the checkpoint's or the caller's, else
    RuntimeError), naming ``what`` was done, each failing rank and its error; on a failing rank chained to its
    own exception. Collective: call on every rank of the detcomm group."""
    comm = detcomm.get_communicator()
    error: Exception | None = None
    value: T | None = None
    try:
        value = step()
    except Exception as e:  # noqa: BLE001 - every failure must reach the exchange, or the peers would wait
        error = e
    mine = None if error is None else (_is_caller(error), f"{type(error).__name__}: {error}")
    everyone: list[tuple[bool, str] | None] = [None] * comm.world_size
    dist.all_gather_object(everyone, mine, group=comm.group)  # type: ignore[arg-type]
    failed = {r: v for r, v in enumerate(everyone) if v is not None}
    if not failed:
        return value  # type: ignore[return-value]
    by_text: dict[str, list[int]] = {}
    for r, (_, text) in failed.items():
        by_text.setdefault(text, []).append(r)
    parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} found: {text}"
                      for text, rs in by_text.items())
    ok = [r for r in range(comm.world_size) if r not in failed]
    msg = (f"{what} was refused on every rank, because {parts}"
           + (f" (ranks {', '.join(map(str, ok))} found nothing wrong)" if ok else ""))
    cls = ValueError if all(caller for caller, _ in failed.values()) else RuntimeError
    raise cls(msg) from error
