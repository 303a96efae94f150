"""The call guard: before a collective's result is returned, every rank proves it made the same call.

Two ranks that call different sites, the same site a different number of times, with different rows or a
different ``rows_per_rank``, or one rank that calls ``shutdown()`` while the others still call, would otherwise
exchange and reduce each other's data without a word (messages of the same size pair up), or abort the
process inside the library (messages of different sizes). So every call of a site carries one header

    [magic, site-name hash, site-signature hash (collective, op, dtype, trailing shape), call number, rows, extra]

(``HEADER_INTS`` int64, zero-padded): ``call number`` counts the site's user calls on this communicator
(self-check calls carry 0), ``rows`` is -1 where ranks legitimately differ (token_all_gather, an uneven
all_to_all) and ``extra`` the hash of ``rows_per_rank``. Every rank receives all W headers and compares them;
on a mismatch (every rank holds the same W headers, so every rank takes this path) the ranks exchange the
readable form of their calls once and all raise ``CollectiveMismatch`` naming what each rank called, before
any rank returns the call's data.

Exactly one guard runs per call, chosen once per communicator from static facts (``mode``):

- ``HEADER`` where a call's messages live in host memory (a CPU group, or CUDA tensors that a gloo group stages
  through the host): the communicator (``calls.SiteCall``) all-gathers the header *before* the call's data
  moves (``CallHeader.exchange``). The header has a fixed size, so ranks that would send messages of different
  sizes (other rows) compare first and raise instead of aborting in the library. Cost: one all-gather of
  ``HEADER_BYTES`` per call.
- ``IN_MESSAGE`` where the messages live in device memory (an NCCL group): a separate header would be a second
  collective plus a device-to-host read before the data may move. Instead the header travels inside the call's
  own message and is compared after it (``MessageGuard``: how, what it costs, what it cannot see).
- ``FINGERPRINT`` with checking on (``init(check=True)``): the call checker's full per-call comparison
  (detcomm/verify.py) replaces the header.
- ``NONE`` for one rank. (On host-memory groups the routes' messages carry no header: the separate one ran.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..errors import CollectiveMismatch
from ..sites import Site

__all__ = ["HEADER", "IN_MESSAGE", "FINGERPRINT", "NONE", "MODES", "HEADER_INTS", "HEADER_BYTES", "SHUTDOWN",
           "CallHeader", "MessageGuard", "mode", "exchange", "hash_text", "shutdown_header", "site_hash", "gather",
           "exchange_blocks"]

HEADER, IN_MESSAGE, FINGERPRINT, NONE = "header", "in_message", "fingerprint", "none"
MODES = (HEADER, IN_MESSAGE, FINGERPRINT, NONE)
_MAGIC = 0x0DE7C0_4EAD
# Every header has this many int64 (the call checker's fingerprint too, detcomm/verify.py): two ranks exchanging
# different kinds of header still exchange messages of one size, so they compare instead of aborting.
HEADER_INTS = 9
HEADER_BYTES = HEADER_INTS * 8
SHUTDOWN = "<shutdown>"  # the pseudo-site close() exchanges: a rank that shuts down early is named as such


def mode(*, world_size: int, messages_on_device: bool, checking: bool, forced: str | None = None) -> str:
    """The one guard a communicator's calls carry (see the module docstring). ``forced`` replaces the choice
    between ``HEADER`` and ``IN_MESSAGE`` (tests exercise the device groups' in-message guard on gloo), or asks
    for ``NONE`` (the torch.distributed backend's CUDA communicator: its callers overlap collectives with compute,
    which a host read per call would serialize)."""
    if world_size == 1:
        return NONE
    if checking:
        return FINGERPRINT
    if forced is not None:
        if forced not in (HEADER, IN_MESSAGE, NONE):
            raise ValueError(f"call guard {forced!r}: expected {HEADER!r}, {IN_MESSAGE!r} or {NONE!r}")
        return forced
    return IN_MESSAGE if messages_on_device else HEADER


def hash_text(text: str) -> int:
    # Python's hash() of a str differs between processes; this must be equal on every rank.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def site_hash(site: Site) -> int:
    """The site's signature: what a call must match besides the name (collective, op, dtype, trailing shape)."""
    tree = "" if site.shard_fold == "order" else f"|{site.shard_fold}"
    return hash_text(f"{site.collective.value}|{site.op.value}|{site.dtype}|{site.shape}|{site.virtual_shards}{tree}")


def _padded(header: Sequence[int]) -> list[int]:
    return [*header, *[0] * (HEADER_INTS - len(header))]


def _mismatch(native, seen_rows: list[list[int]], mine: list[int], readable: str) -> None:  # type: ignore[no-untyped-def]
    """Unless every rank's header equals ``mine``, exchange each rank's ``readable`` and raise on every rank."""
    if all(row == mine for row in seen_rows):
        return
    calls: list[object] = [None] * native.world_size
    dist.all_gather_object(calls, readable, group=native.group)
    seen = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
    raise CollectiveMismatch(
        f"rank {native.rank}: the ranks are not making the same collective call ({seen}). Every rank must make "
        "the group's collective calls (and shutdown()) in the same order with the same sites, rows and "
        "rows_per_rank"
    )


def exchange(native, header: list[int], readable: str, *, device: torch.device) -> None:  # type: ignore[no-untyped-def]
    """All-gather ``header`` (zero-padded to ``HEADER_INTS``) over ``native``; unless every rank wrote the same, exchange each
    rank's ``readable`` and raise ``CollectiveMismatch`` on every rank. Collective."""
    mine = _padded(header)
    w = native.world_size
    got = native.all_gather(torch.tensor(mine, dtype=torch.int64, device=device)).view(w, HEADER_INTS).tolist()
    _mismatch(native, got, mine, readable)


def _ints(name: int, sig: int, call: int, rows: int, rows_per_rank: Sequence[int] | None) -> list[int]:
    extra = hash_text(repr(list(rows_per_rank))) if rows_per_rank is not None else 0
    return _padded([_MAGIC, name, sig, call, rows, extra])


def _readable(site: Site, call: int, rows: int, rows_per_rank: Sequence[int] | None) -> str:
    rpr = "" if rows_per_rank is None else f", rows_per_rank={list(rows_per_rank)}"
    what = f"call #{call}" if call else "self-check call"
    return f"site {site.name!r} {what} ({site.describe()}, rows {rows}{rpr})"


class CallHeader:
    """One site's separate per-call header (mode ``HEADER``): built once at declaration."""

    __slots__ = ("site", "native", "device", "_name", "_sig")

    def __init__(self, site: Site, *, native, device: torch.device) -> None:  # type: ignore[no-untyped-def]
        self.site = site
        self.native = native
        self.device = device
        self._name = hash_text(site.name)
        self._sig = site_hash(site)

    def exchange(self, call: int, rows: int, rows_per_rank: Sequence[int] | None) -> None:
        """Collective: raise ``CollectiveMismatch`` on every rank unless every rank makes this same call."""
        exchange(self.native, _ints(self._name, self._sig, call, rows, rows_per_rank),
                 _readable(self.site, call, rows, rows_per_rank), device=self.device)


def shutdown_header(native, *, device: torch.device, calls: int) -> None:  # type: ignore[no-untyped-def]
    """The header ``Communicator.close`` exchanges: peers still calling a site see "shutdown()" named."""
    exchange(native, [_MAGIC, hash_text(SHUTDOWN), 0, 0, -1, 0], f"shutdown() after {calls} collective calls",
             device=device)


class MessageGuard:
    """One site's header inside its calls' own messages (mode ``IN_MESSAGE``), bound by the route's backend.

    Per call: the communicator ``arm``s it with the call's number, rows and ``rows_per_rank`` (an unarmed call,
    a self-check's, carries call number 0); the transport the routes call (native.py, gather, exchange_blocks) takes the
    header's bytes with ``begin`` (None: no guard on this call, inside a CUDA-graph capture), puts them into the
    message, and hands the W headers it received to ``end``, which raises ``CollectiveMismatch`` on every rank
    unless they all equal this rank's. No route body touches the header. Where it rides:

    * data movement (all_gather, token_all_gather, all_to_all, and the fold routes' gathers and all-to-alls):
      the ``HEADER_BYTES`` header bytes are appended to each rank's contribution (to each destination block of an
      all-to-all, so every rank receives all W headers). Data movement copies bytes, so the header arrives bit for
      bit and the payload's bits are untouched.
    * a native reduction (all_reduce, reduce_scatter: SUM, and MAX/MIN on integers or on the order-preserving
      keys; argmax's int64 keys): the reduced buffer is extended by a region of W slots; rank r writes its header
      into slot r and the reduction's identity into every other slot (0 for SUM, the integer minimum for MAX,
      the maximum for MIN). Slot r of the result is then h_r + 0 + ... + 0 (or max(h_r, min, ..., min)), which
      is h_r exactly in any association order: integer arithmetic is exact (wrapping cannot occur when every
      other term is the identity), and in a float SUM each header byte is stored as the float of an integer in
      [0, 255] (exact in bf16, fp16 and fp32), never -0.0 or NaN, so adding +0.0 leaves it unchanged. A
      reduce-scatter extends each destination block by the W slots. The payload region is reduced exactly as
      without the slots (an element's result depends only on that element's W inputs).
    The region costs W * 72 elements (float SUM: one header byte per element) or W * 72 bytes (integers and
    keys) per call, plus building the message (the concatenation replaces the copy the native route makes of
    its input anyway; an all_gather or all_to_all also copies its payload out of the received messages). The
    comparison reads the W headers back to the host: one device-to-host copy, which waits for the collective
    (a host synchronization per call). A call made while its stream is being captured into a CUDA graph can do
    neither (no host read, no host-built header inside a capture), so captured calls carry no guard; graph
    replays repeat the captured call sequence on every rank. ``ipc_fold`` carries its own guard on device: the
    workspace kernels compare a per-call descriptor (kernel, dtype, count, call number) at their start barrier.
    What a header inside the message cannot see: ranks whose messages differ in size (another row count, another
    collective); the library then fails or waits for the deadline. ``init(check=True)`` compares a fixed-size
    fingerprint before every call's data moves and covers those too.
    """

    __slots__ = ("site", "native", "_name", "_sig", "_armed", "_open")

    def __init__(self, site: Site, *, native) -> None:  # type: ignore[no-untyped-def]
        self.site = site
        self.native = native
        self._name = hash_text(site.name)
        self._sig = site_hash(site)
        self._armed: tuple[int, int, Sequence[int] | None] | None = None
        self._open: tuple[list[int], str] | None = None

    def arm(self, call: int, rows: int, rows_per_rank: Sequence[int] | None) -> None:
        self._armed = (call, rows, rows_per_rank)

    def begin(self, x: torch.Tensor) -> torch.Tensor | None:
        """This call's header as ``HEADER_BYTES`` uint8 on ``x``'s device, or None where no guard can run."""
        armed, self._armed = self._armed, None
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        call, rows, rpr = armed if armed is not None else (0, -1, None)
        ints = _ints(self._name, self._sig, call, rows, rpr)
        self._open = (ints, _readable(self.site, call, rows, rpr))
        return torch.tensor(ints, dtype=torch.int64, device=x.device).view(torch.uint8)

    def end(self, headers: torch.Tensor) -> None:
        """``headers``: [W, HEADER_BYTES] uint8, rank r's header in row r (every rank holds the same W rows).
        Collective on a mismatch only."""
        opened, self._open = self._open, None
        assert opened is not None, "end() without begin()"
        ints, readable = opened
        # A copy: a header that follows an odd count of 4-byte elements starts off an 8-byte boundary.
        got = headers.to("cpu", torch.uint8).clone(memory_format=torch.contiguous_format).view(torch.int64).view(-1, HEADER_INTS).tolist()
        _mismatch(self.native, got, ints, readable)


# -- carrying the header in a message ------------------------------------------------------------------------------
def append(x: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
    """One flat uint8 message: ``x``'s bytes, then the header."""
    return torch.cat([x.reshape(-1).view(torch.uint8), header])


def append_each(blocks: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
    """[W, n] uint8 rows (a destination block each), each followed by the header: [W, n + HEADER_BYTES]."""
    return torch.cat([blocks, header.expand(blocks.shape[0], -1)], dim=1)


def split(messages: torch.Tensor, like: torch.Tensor, *, contiguous: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, nbytes + HEADER_BYTES] uint8 -> ([W, *like.shape] of like's dtype, [W, HEADER_BYTES] headers). A strided
    view of the payloads unless ``contiguous`` (a copy, for consumers that need one)."""
    w = messages.shape[0]
    payload = messages[:, : messages.shape[1] - HEADER_BYTES]
    if contiguous:
        payload = payload.contiguous()
    return payload.view(like.dtype).view(w, *like.shape), messages[:, -HEADER_BYTES:]


def gather(native, x: torch.Tensor, guard: MessageGuard | None, *,  # type: ignore[no-untyped-def]
           contiguous: bool = False) -> torch.Tensor:
    """Every rank's ``x`` as [W, *x.shape], in rank order, through ``native.all_gather``; with ``guard`` each
    rank's contribution is its bytes and its header, compared before this returns, and the payloads are a strided
    view of the received messages unless ``contiguous`` (a copy). Collective."""
    w = native.world_size
    header = guard.begin(x) if guard is not None else None
    if header is None:
        return native.all_gather(x).view(w, *x.shape)  # type: ignore[no-any-return]
    assert guard is not None
    stacked, headers = split(native.all_gather(append(x, header).view(1, -1)), x, contiguous=contiguous)
    guard.end(headers)
    return stacked


def exchange_blocks(native, blocks: torch.Tensor, guard: MessageGuard | None, *,  # type: ignore[no-untyped-def]
                    contiguous: bool = False) -> torch.Tensor:
    """``blocks`` [W, ...]: block q goes to rank q, through ``native.all_to_all``. Returns [W, ...]: block ``rank``
    of every rank, in rank order. With ``guard`` every destination block carries the same header, so each rank
    receives all W headers, compared before this returns; the payloads are a strided view unless
    ``contiguous``. Collective."""
    w = native.world_size
    # contiguous: a reshape of permuted blocks can be a strided view, which neither the library nor the byte view
    # of the guarded message takes.
    flat = blocks.reshape(w, blocks[0].numel()).contiguous()
    header = guard.begin(blocks) if guard is not None else None
    if header is None:
        return native.all_to_all(flat, [1] * w, [1] * w).view(w, *blocks.shape[1:])  # type: ignore[no-any-return]
    assert guard is not None
    recv = native.all_to_all(append_each(flat.view(torch.uint8), header), [1] * w, [1] * w)
    stacked, headers = split(recv, blocks[0], contiguous=contiguous)
    guard.end(headers)
    return stacked


def _identity(dtype: torch.dtype, op: str) -> int:
    if op == "sum":
        return 0
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def slot_elements(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` one rank's slot takes: a header byte per element for floats, raw bytes otherwise."""
    return HEADER_BYTES if dtype.is_floating_point else HEADER_BYTES // dtype.itemsize


def slots(header: torch.Tensor, *, rank: int, world_size: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The W-slot region a reduction carries (see the module docstring): rank ``rank``'s header in its slot, the
    identity of ``op`` ("sum", "max", "min") elsewhere. Float dtypes: SUM only."""
    n = slot_elements(dtype)
    if dtype.is_floating_point:
        assert op == "sum", "float MAX/MIN reduce integer keys"
        mine = header.to(dtype)  # integers 0..255: exact in every float dtype
    else:
        mine = header.view(dtype)
    region = torch.full((world_size * n,), _identity(dtype, op), dtype=dtype, device=header.device)
    region[rank * n : (rank + 1) * n] = mine
    return region


def read_slots(region: torch.Tensor, *, world_size: int) -> torch.Tensor:
    """A reduced W-slot region -> [W, HEADER_BYTES] uint8 headers."""
    if region.dtype.is_floating_point:
        return region.view(world_size, HEADER_BYTES).to(torch.uint8)
    return region.contiguous().view(torch.uint8).view(world_size, HEADER_BYTES)
