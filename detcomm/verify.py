"""Cross-rank call checking: before each collective, the ranks prove they are making the same call.

A collective whose ranks disagree (another site, op, dtype or row shape, or a rank that skipped or added a
call) does not fail cleanly on its own: the library pairs the wrong messages, which either hangs, mixes
bytes of different calls into a result, or fails with an error that names neither the site nor the call.
With checking on (``detcomm.init(check=True)`` or ``DETCOMM_CHECK=1``) every collective call first
all-gathers a small fixed-size int64 fingerprint of the call

    [version, sequence number, site-name hash, collective, op, dtype, trailing-shape hash, rows, extra]

over the native collective, and every rank compares all W fingerprints. All ranks see the same gathered
tensor, so they reach the same verdict; on a mismatch they exchange the readable form of their calls (one
``all_gather_object``, on this failure path only) and every rank raises ``CollectiveMismatch`` naming the
site, the sequence number and each rank's value of every field that differs.

``rows`` is compared where every rank must pass the same row count (all_reduce, reduce_scatter, all_gather,
argmax, an even all_to_all); it is -1 where ranks legitimately differ (token_all_gather, whose ``extra`` is
the hash of ``rows_per_rank`` instead, and an all_to_all with ``splits``). The sequence number counts the
calls this communicator has checked, so a rank whose communicator was re-created (a restarted worker) shows
as a sequence mismatch. A rank that never arrives cannot be compared with anything: the other ranks wait in
the fingerprint exchange until the process group's timeout (``detcomm.init(timeout_s=...)`` when init creates
the group, the group's own timeout otherwise) and raise ``PeerTimeout`` naming the site and sequence number.

Off by default: it adds one small collective (and on CUDA one device-to-host copy) to every call;
``bench/check_cost.py`` measures it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.distributed as dist

from .deadline import is_timeout
from .errors import CollectiveMismatch, PeerTimeout
from .sites import Collective, ReduceOp

__all__ = ["CallChecker", "CollectiveMismatch", "PeerTimeout", "check_from_env"]

_VERSION = 0x0DE7C0_0001
# The fields of the error message, in this order (the hashed ones are shown as each rank wrote them).
_SHOWN = ("site", "seq", "collective", "op", "dtype", "shape", "rows", "extra")
_COLLECTIVES = {c: i for i, c in enumerate(Collective)}
_OPS = {o: i for i, o in enumerate(ReduceOp)}


def check_from_env(check: bool | None) -> bool:
    """``check`` if given, else ``DETCOMM_CHECK`` (1/true/yes on; unset, 0/false/no off)."""
    if check is not None:
        if not isinstance(check, bool):
            raise ValueError(f"check must be True, False or None, got {check!r}")
        return check
    raw = os.environ.get("DETCOMM_CHECK", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"DETCOMM_CHECK={raw!r}: use 1 (check every collective call across ranks) or 0")


@lru_cache(maxsize=4096)
def _hash(text: str) -> int:
    # Python's hash() of a str differs between processes; this must be equal on every rank.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class CallChecker:
    """Fingerprints and compares one communicator's collective calls (see the module docstring)."""

    def __init__(self, *, native, device: torch.device, rank: int, world_size: int,  # type: ignore[no-untyped-def]
                 timeout_s: float | None) -> None:
        self.native = native
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.seq = 0
        # The native collective needs the fingerprint where the group's library works (CUDA for NCCL; the
        # native backend stages a CUDA tensor through host memory on gloo itself).
        self.device = device

    def agree(self, name: str, collective: Collective, op: ReduceOp, x: torch.Tensor, *,
              rows_per_rank: Sequence[int] | None = None, uneven: bool = False) -> None:
        """Collective: raise ``CollectiveMismatch`` on every rank unless every rank makes this same call."""
        seq = self.seq
        self.seq += 1
        rows = -1 if uneven or rows_per_rank is not None else int(x.shape[0])
        extra = _hash(repr(list(rows_per_rank))) if rows_per_rank is not None else 0
        shape = tuple(int(d) for d in x.shape[1:])
        mine = [_VERSION, seq, _hash(name), _COLLECTIVES[collective], _OPS[op], _hash(_dtype_name(x.dtype)),
                _hash(repr(shape)), rows, extra]
        fp = torch.tensor(mine, dtype=torch.int64, device=self.device)
        try:
            everyone = self.native.all_gather(fp).view(self.world_size, len(mine)).cpu()
        except RuntimeError as e:
            if not is_timeout(e):
                raise  # a peer's death or a closed group: the communicator names the site, call, rank and cause
            limit = f"{self.timeout_s:g} s" if self.timeout_s is not None else "the process group's timeout"
            raise PeerTimeout(
                f"detcomm check: site {name!r}, call #{seq} on rank {self.rank}: not every rank reached this call "
                f"within {limit} (a rank skipped the call, is stuck elsewhere, or died): {e}"
            ) from e
        if bool((everyone == everyone[self.rank]).all()):
            return
        readable = {
            "site": name, "seq": seq, "collective": collective.value, "op": op.value,
            "dtype": _dtype_name(x.dtype), "shape": shape, "rows": rows,
            "extra": "-" if rows_per_rank is None else f"rows_per_rank={list(rows_per_rank)}",
        }
        calls: list[object] = [None] * self.world_size
        dist.all_gather_object(calls, readable, group=self.native.group)
        if not all(isinstance(c, dict) for c in calls):  # a rank in another header's exchange (route_impls/guard.py)
            seen = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
            raise CollectiveMismatch(f"detcomm check: the ranks made different collective calls at site {name!r}, "
                                     f"call #{seq} ({seen})")
        raise CollectiveMismatch(_describe(calls, self.rank, readable))  # type: ignore[arg-type]


def _describe(calls: list[dict[str, object]], rank: int, mine: dict[str, object]) -> str:
    differ = [f for f in _SHOWN if len({repr(c[f]) for c in calls}) > 1]
    parts = []
    for f in differ:
        label = "rows_per_rank" if f == "extra" else f
        parts.append(f"{label}: " + ", ".join(f"rank {r}={c[f]!r}" for r, c in enumerate(calls)))
    same = [f"{f}={mine[f]!r}" for f in _SHOWN if f not in differ and f != "extra"]
    return (
        f"detcomm check: the ranks made different collective calls at site {mine['site']!r}, call #{mine['seq']} "
        f"(seen on rank {rank}). Differing: " + "; ".join(parts)
        + (f". Same on every rank: {', '.join(same)}" if same else "")
        + ". Every rank must make the same collective calls in the same order."
    )
