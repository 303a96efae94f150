"""The call guard: before a collective's data moves, every rank proves it is making the same call.

Two ranks that call different sites, the same site a different number of times, with different rows or a
different ``rows_per_rank``, or one rank that calls ``shutdown()`` while the others still call, would otherwise
exchange and reduce each other's data without a word (messages of the same size pair up), or abort the
process inside the library (messages of different sizes). So the communicator (``comm.SiteCall.run``) exchanges
a fixed-size header before every collective call, on every route:

    [magic, site-name hash, site-signature hash (collective, op, dtype, trailing shape), call number, rows, extra]

``call number`` counts the site's user calls on this communicator (self-check calls are not counted), ``rows``
is -1 where ranks legitimately differ (token_all_gather, an uneven all_to_all) and ``extra`` the hash of
``rows_per_rank``. Every rank receives all W headers; the fixed size means a mismatch can never become a
message-size mismatch. On a mismatch (every rank sees the same W headers, so every rank takes this path) the
ranks exchange the readable form of their calls once and all raise ``CollectiveMismatch`` naming what each
rank called. Cost: one all-gather of 72 bytes per call (docs/performance.md; ``init(check=True)`` is the full
per-call comparison, which replaces it).

The header applies where it lives in host memory (a CPU group, or a CUDA group that a gloo group stages through
the host): on a GPU with an NCCL group reading it back would synchronize the device on every call and forbid
CUDA-graph capture. There the workspace's device-side header guards ipc_fold, and ``init(check=True)`` every
other route (docs/spec.md §2).

``CallGuard`` is the older in-message form (16 bytes appended to a fold route's own message); the header above
now runs first on every host-memory call, so it only double-checks that the route's message itself paired.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import CollectiveMismatch
from ..route import Site

__all__ = ["HEADER_BYTES", "CallGuard", "CallHeader", "SHUTDOWN", "exchange", "hash_text", "shutdown_header", "site_hash"]

HEADER_BYTES = 16  # CallGuard's in-message header
_MAGIC = 0x0DE7C0_4EAD
# Every header has this many int64 (the call checker's fingerprint too, detcomm/verify.py): two ranks exchanging
# different kinds of header still exchange messages of one size, so they compare instead of aborting.
HEADER_INTS = 9
SHUTDOWN = "<shutdown>"  # the pseudo-site close() exchanges: a rank that shuts down early is named as such


def hash_text(text: str) -> int:
    # Python's hash() of a str differs between processes; this must be equal on every rank.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def site_hash(site: Site) -> int:
    """The site's signature: what a call must match besides the name (collective, op, dtype, trailing shape)."""
    tree = "" if site.shard_fold == "order" else f"|{site.shard_fold}"
    return hash_text(f"{site.collective.value}|{site.op.value}|{site.dtype}|{site.shape}|{site.virtual_shards}{tree}")


def exchange(native, header: list[int], readable: str, *, device: torch.device) -> None:  # type: ignore[no-untyped-def]
    """All-gather ``header`` (zero-padded to ``HEADER_INTS``) over ``native``; unless every rank wrote the same, exchange each
    rank's ``readable`` and raise ``CollectiveMismatch`` on every rank. Collective."""
    header = [*header, *[0] * (HEADER_INTS - len(header))]
    w = native.world_size
    got = native.all_gather(torch.tensor(header, dtype=torch.int64, device=device)).view(w, len(header)).tolist()
    if all(row == header for row in got):
        return
    calls: list[object] = [None] * w
    dist.all_gather_object(calls, readable, group=native.group)
    seen = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
    raise CollectiveMismatch(
        f"rank {native.rank}: the ranks are not making the same collective call ({seen}). Every rank must make "
        "the group's collective calls (and shutdown()) in the same order with the same sites, rows and "
        "rows_per_rank"
    )


class CallHeader:
    """One site's per-call header (see the module docstring): built once at declaration."""

    __slots__ = ("site", "native", "device", "_name", "_sig")

    def __init__(self, site: Site, *, native, device: torch.device) -> None:  # type: ignore[no-untyped-def]
        self.site = site
        self.native = native
        self.device = device
        self._name = hash_text(site.name)
        self._sig = site_hash(site)

    def exchange(self, call: int, rows: int, rows_per_rank: Sequence[int] | None) -> None:
        """Collective: raise ``CollectiveMismatch`` on every rank unless every rank makes this same call."""
        extra = hash_text(repr(list(rows_per_rank))) if rows_per_rank is not None else 0
        mine = [_MAGIC, self._name, self._sig, call, rows, extra]
        s = self.site
        rpr = "" if rows_per_rank is None else f", rows_per_rank={list(rows_per_rank)}"
        exchange(self.native, mine, f"site {s.name!r} call #{call} ({s.describe()}, rows {rows}{rpr})",
                 device=self.device)


def shutdown_header(native, *, device: torch.device, calls: int) -> None:  # type: ignore[no-untyped-def]
    """The header ``Communicator.close`` exchanges: peers still calling a site see "shutdown()" named."""
    exchange(native, [_MAGIC, hash_text(SHUTDOWN), 0, 0, -1, 0], f"shutdown() after {calls} collective calls",
             device=device)


class CallGuard:
    """One site's in-message header: its id and how many calls of it this rank has made (``names``: site id ->
    name for the error message, the communicator's own sites; unknown ids are shown as numbers)."""

    def __init__(self, site: Site, *, names: Mapping[int, str] | None = None) -> None:
        self.site = site
        self.site_id = hash_text(f"{site.name}|{site.collective.value}|{site.op.value}|{site.dtype}|{site.shape}")
        self.calls = 0
        self.names = names if names is not None else {self.site_id: site.name}

    @staticmethod
    def applies(x: torch.Tensor, *, staged: bool) -> bool:
        """Whether a call's message lives in host memory (a CPU tensor, or a CUDA tensor a gloo group stages
        through the host), where reading the headers back costs no device synchronization."""
        return not x.is_cuda or staged

    def next_header(self) -> torch.Tensor:
        self.calls += 1
        return torch.tensor([self.site_id, self.calls], dtype=torch.int64).view(torch.uint8)

    def check(self, headers: torch.Tensor) -> None:
        """``headers``: [W, 16] uint8, one row per rank (every rank holds the same W rows)."""
        # A copy: a header that follows an odd count of 4-byte elements starts off an 8-byte boundary.
        got = headers.cpu().clone(memory_format=torch.contiguous_format).view(torch.int64).view(-1, 2).tolist()
        mine = [self.site_id, self.calls]
        if all(h == mine for h in got):
            return
        seen = "; ".join(f"rank {r}: site {self.names.get(sid, f'<id {sid:#x}>')!r} message #{n}"
                         for r, (sid, n) in enumerate(got))
        raise CollectiveMismatch(
            f"site {self.site.name!r}: the ranks' messages do not pair ({seen}). Every rank must call the "
            "group's collectives in the same order"
        )


def append_header(x: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
    """One flat uint8 message: ``x``'s bytes, then the header."""
    return torch.cat([x.reshape(-1).view(torch.uint8), header.to(x.device)])


def split(messages: torch.Tensor, like: torch.Tensor, *, contiguous: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, nbytes + 16] uint8 -> ([W, *like.shape] of like's dtype, [W, 16] headers). A strided view of the
    payloads unless ``contiguous`` (a copy, for consumers that need one)."""
    w = messages.shape[0]
    payload = messages[:, : messages.shape[1] - HEADER_BYTES]
    if contiguous:
        payload = payload.contiguous()
    return payload.view(like.dtype).view(w, *like.shape), messages[:, -HEADER_BYTES:]
