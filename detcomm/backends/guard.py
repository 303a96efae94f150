"""The always-on call guard of the fold routes: 16 bytes that travel inside the route's own message.

Two ranks that call different sites of the same shape, or the same site a different number of times, would
otherwise exchange and fold each other's data without a word (the messages have the same size, so the library
pairs them). gather_fold and a2a_fold append to every rank's message a header (the site's id and the site's
call number on that rank); every rank receives all W headers with the data and compares them before folding,
so a mismatch raises CollectiveMismatch on every rank. It costs 16 bytes per message and one copy of the
input into the message buffer, and no extra collective (measured in docs/performance.md). The full
per-call comparison (rows, shapes, every field; one extra collective per call) stays behind init(check=True).
The native route carries no header (its message is the library's own); ipc_fold compares its own per-call
header in the workspace. Nor do messages that live on a GPU with an NCCL group: reading the headers back would
synchronize the device on every call and forbid CUDA-graph capture, on the routes a GPU group uses only as its
fallback; there the workspace's device-side header, or init(check=True), is the guard.
"""

from __future__ import annotations

import hashlib

import torch

from ..errors import CollectiveMismatch
from ..route import Site

__all__ = ["HEADER_BYTES", "CallGuard"]

HEADER_BYTES = 16
_NAMES: dict[int, str] = {}  # site id -> name, for the error message (sites declared in this process)


def _site_id(site: Site) -> int:
    text = f"{site.name}|{site.collective.value}|{site.op.value}|{site.dtype}|{site.shape}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


class CallGuard:
    """One site's header: its id and how many calls of it this rank has made."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self.site_id = _site_id(site)
        self.calls = 0
        _NAMES[self.site_id] = site.name

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
        got = headers.cpu().contiguous().view(torch.int64).view(-1, 2).tolist()
        mine = [self.site_id, self.calls]
        if all(h == mine for h in got):
            return
        seen = "; ".join(f"rank {r}: site {_NAMES.get(sid, f'<id {sid:#x}>')!r} call #{n}"
                         for r, (sid, n) in enumerate(got))
        raise CollectiveMismatch(
            f"site {self.site.name!r}, call #{self.calls}: the ranks are not making the same call ({seen}). "
            "Every rank must call the group's collectives in the same order; init(check=True) compares every "
            "field of every call (site, op, dtype, shape, rows) at the cost of one extra collective per call"
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
