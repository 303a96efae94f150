"""The native route: torch.distributed collectives (NCCL on GPU, gloo on CPU).

It carries all data movement, every exact reduction (integer SUM, float MAX/MIN and argmax on
order-preserving keys, see detcomm.numerics.keys) and, under ``auto``, floating-point SUM with the library's own
arithmetic, which is run-stable at a fixed size but NOT batch-invariant: a ring chunks the buffer by message
size, so an element's association order follows its offset in the buffer.

Every method is collective over the group and returns a new tensor; inputs are never written.

On a group whose messages live in device memory (``in_message``) each bound call carries the call guard's header
inside its own message (guard.py: appended to each rank's contribution for data movement, in a region of W slots
for a reduction); elsewhere the communicator's separate header guards the call and the messages are the data alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..errors import CaptureThroughHost
from ..numerics import keys, tree
from ..numerics.fold import reference_fold
from ..sites import BoundRoute, Collective, ReduceOp, Route, Site
from . import guard as _guard
from .base import bind_from
from .guard import MessageGuard

# torch 2.13 renamed the flat-tensor collectives (*_single) and deprecated the old names; torch 2.4-2.12
# only have the old ones. Same signatures.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_TORCH_OP = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN}


class NativeRoute:
    route = Route.NATIVE

    def __init__(self, group: dist.ProcessGroup, *, stage_through_host: bool = False, in_message: bool = False) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # A gloo group whose ranks keep their tensors on CUDA (W processes sharing one GPU, where NCCL refuses
        # to run): the library sees host copies, the caller gets results back on its device. Data movement and
        # exact integer reductions only; the bits are the same either way.
        self.stage = stage_through_host
        # The call guard travels inside every bound call's message (guard.IN_MESSAGE); the fold routes read it too.
        self.in_message = in_message
        # One rank: every collective of the transport below is the identity on this rank's rows (a gather or an
        # all-to-all of one block, a reduction over one contribution), so it runs as a local copy and never calls
        # the library. The bits are the library's (a copy), and a CUDA graph holds no NCCL communicator and no
        # host staging (Communicator.capture_refusal reads this). Every route moves its data through this transport.
        self.local = self.world_size == 1

    @property
    def calls_library(self) -> bool:
        """Whether this group's collectives call the library (False at W = 1: local copies)."""
        return not self.local

    def bind(self, site: Site) -> BoundRoute:
        op = site.op
        g = MessageGuard(site, native=self) if self.in_message else None
        if site.virtual_shards is not None:
            # Forced only, outside bitwise envelopes (route.py): each rank folds its own V/W partials, the
            # library sums the W pre-folded results in fp32 and the sum is rounded once. W-dependent bits: the
            # negative control of the canonical fold over the V shards.
            # A tree-order site pre-folds its own subtree instead (equal to the tree at W = 1 and W = 2 only).
            tree_order = site.shard_fold == "tree"

            def presum(x: torch.Tensor) -> torch.Tensor:
                return tree.subtree(x) if tree_order else reference_fold(x, torch.float32)

            dtype = site.dtype
            return bind_from(self.route, site, {
                Collective.ALL_REDUCE: lambda x, a: self.all_reduce(presum(x), ReduceOp.SUM, guard=g).to(dtype),
                Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(presum(x), ReduceOp.SUM, guard=g).to(dtype),
            }, guard=g)
        # A SUM (or an integer MIN/MAX) reduces the library's buffer in place; AVG and float MIN/MAX reduce keys.
        in_place = op is ReduceOp.SUM or (op is not ReduceOp.AVG and not site.is_float)
        return bind_from(self.route, site, {
            Collective.ALL_REDUCE: lambda x, a: self.all_reduce(x, op, out=a.out, guard=g),
            Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, op, guard=g),
            Collective.ALL_GATHER: lambda x, a: self.all_gather(x, guard=g),
            Collective.TOKEN_ALL_GATHER: lambda x, a: self.token_all_gather(x, _given(a.rows_per_rank), guard=g),
            Collective.ALL_TO_ALL: lambda x, a: self.all_to_all(x, _given(a.in_splits), _given(a.out_splits), guard=g),
            Collective.ARGMAX: lambda x, a: self.argmax(x, a.vocab_start, guard=g),
        }, in_place=in_place, guard=g)

    def _lib(self, x: torch.Tensor) -> torch.Tensor:
        if not self.stage:
            return x
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # Every route's first host copy comes before its first collective, so every capturing rank refuses here
            # alike, with nothing exchanged (torch's own error would come from inside the copy, unexplained).
            raise CaptureThroughHost(
                "this call's route moves its CUDA tensors through host memory (a gloo group staging them: ranks "
                "sharing a GPU, where NCCL refuses to run), and a CUDA graph capture cannot hold a host copy. Run "
                "it outside the capture; inside one, only the calls the CUDA-IPC workspace serves capture on such "
                "a group (detcomm.routes() shows them as ipc_fold)")
        return x.cpu()

    def _back(self, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return out.to(like.device) if self.stage else out

    # -- the collectives a bound call runs ----------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: ReduceOp, *, out: torch.Tensor | None = None,
                   guard: MessageGuard | None = None) -> torch.Tensor:
        """``out=x`` reduces x itself where the library sees x (not staged through the host); any other ``out``
        is left to the communicator. ``guard``: the call guard's header rides in a slot region (guard.py)."""
        if op is ReduceOp.AVG:
            # gloo has no AVG: the library's SUM (not batch-invariant: this route makes no claim), one division.
            return (self.all_reduce(x, ReduceOp.SUM, guard=guard).to(torch.float32) / self.world_size).to(x.dtype)
        if op is ReduceOp.SUM or not x.is_floating_point():
            return self.reduce(x, op, guard, out=out)
        return keys.from_key(self.reduce(keys.to_key(x, op=op.value), op, guard, owned=True), x.dtype, op=op.value)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp, *, guard: MessageGuard | None = None) -> torch.Tensor:
        if op is ReduceOp.AVG:
            return (self.reduce_scatter(x, ReduceOp.SUM, guard=guard).to(torch.float32) / self.world_size).to(x.dtype)
        keyed = op is not ReduceOp.SUM and x.is_floating_point()
        out = self.scatter(keys.to_key(x, op=op.value) if keyed else x, op, guard)
        return keys.from_key(out, x.dtype, op=op.value) if keyed else out

    def argmax(self, logits: torch.Tensor, vocab_start: int, *, guard: MessageGuard | None = None) -> torch.Tensor:
        return keys.argmax_index(self.reduce(keys.argmax_keys(logits, vocab_start), ReduceOp.MAX, guard, owned=True))

    def all_gather(self, x: torch.Tensor, *, guard: MessageGuard | None = None) -> torch.Tensor:
        if self.local:  # no host staging either: nothing reaches the library
            return x.clone()
        if guard is None:
            return self._back(self._gather_flat(self._lib(x)), x)
        return _guard.gather(self, x, guard, contiguous=True).view(x.shape[0] * self.world_size, *x.shape[1:])

    def token_all_gather(self, x: torch.Tensor, rows_per_rank: Sequence[int], *,
                         guard: MessageGuard | None = None) -> torch.Tensor:
        # Pad every rank's rows to the largest count so one fixed-size gather serves uneven inputs on every
        # library, then drop the padding.
        pad = max(rows_per_rank)
        if all(r == pad for r in rows_per_rank):
            return self.all_gather(x, guard=guard)
        padded = torch.zeros((pad, *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        gathered = self.all_gather(padded, guard=guard)
        parts = [gathered[r * pad : r * pad + n] for r, n in enumerate(rows_per_rank)]
        return torch.cat(parts, dim=0)

    # -- the transport: the library's collectives, the call guard's header inside their messages -----------------
    # Each takes the site's MessageGuard (None: the message is the data alone), embeds this call's header in the
    # layout its collective needs (guard.py: slots for a reduction, appended bytes for data movement), and
    # compares the W headers it received before it returns; guard.gather and guard.exchange do the same over
    # all_gather and all_to_all for the fold routes. No route body builds or reads a header.
    def reduce(self, x: torch.Tensor, op: ReduceOp, guard: MessageGuard | None, *, out: torch.Tensor | None = None,
               owned: bool = False) -> torch.Tensor:
        """All-reduce ``x`` (SUM, or an integer MIN/MAX) with the library. ``out=x``: x itself is reduced where the
        library sees it; ``owned``: x is the caller's temporary (keys), reduced without a copy. Guarded: the W-slot
        region follows the payload in one buffer, which replaces the copy of ``x`` the unguarded call makes."""
        if self.local:  # the sum / max / min of one contribution (module docstring; guards are off at W = 1)
            return x if out is x or owned else x.clone()
        header = guard.begin(x) if guard is not None else None
        if header is None:
            in_place = out is x and not self.stage
            buf = x if in_place else self._lib(x) if owned else self._lib(x).clone()
            dist.all_reduce(buf, op=_TORCH_OP[op], group=self.group)
            return x if in_place else self._back(buf, x)
        assert guard is not None
        region = _guard.slots(header, rank=self.rank, world_size=self.world_size, dtype=x.dtype, op=op.value)
        buf = self._lib(torch.cat([x.reshape(-1), region]))
        dist.all_reduce(buf, op=_TORCH_OP[op], group=self.group)
        buf = self._back(buf, x)
        n = x.numel()
        guard.end(_guard.read_slots(buf[n:], world_size=self.world_size))
        result = buf[:n].view(x.shape)
        if out is x:
            return x.copy_(result)
        return result

    def scatter(self, src: torch.Tensor, op: ReduceOp, guard: MessageGuard | None) -> torch.Tensor:
        """Reduce-scatter ``src`` (SUM, or an integer MIN/MAX): row block ``rank`` of the reduction. Guarded: every
        destination block carries the W slots, so every rank receives every rank's header."""
        w = self.world_size
        if self.local:  # one rank receives the whole reduction of its one contribution
            return src.clone()
        header = guard.begin(src) if guard is not None else None
        if header is None:
            lib = self._lib(src)
            out = torch.empty((lib.shape[0] // w, *lib.shape[1:]), dtype=lib.dtype, device=lib.device)
            reduce_scatter_flat(out, lib, op=_TORCH_OP[op], group=self.group)
            return self._back(out, src)
        assert guard is not None
        region = _guard.slots(header, rank=self.rank, world_size=w, dtype=src.dtype, op=op.value)
        blocks = src.reshape(w, -1)
        buf = self._lib(torch.cat([blocks, region.expand(w, -1)], dim=1))
        mine = torch.empty(buf.shape[1], dtype=buf.dtype, device=buf.device)
        reduce_scatter_flat(mine, buf.reshape(-1), op=_TORCH_OP[op], group=self.group)
        mine = self._back(mine, src)
        n = blocks.shape[1]
        guard.end(_guard.read_slots(mine[n:], world_size=w))
        return mine[:n].view(src.shape[0] // w, *src.shape[1:])

    def _gather_flat(self, src: torch.Tensor) -> torch.Tensor:
        if self.local:
            return src.clone()
        out = torch.empty((src.shape[0] * self.world_size, *src.shape[1:]), dtype=src.dtype, device=src.device)
        all_gather_flat(out, src, group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int], *,
                   guard: MessageGuard | None = None) -> torch.Tensor:
        """Rows ``in_splits[q]`` of x to rank q; ``out_splits[q]`` rows from rank q, in rank order. Guarded: each
        destination block followed by the header, as bytes, so every rank receives every rank's header."""
        if self.local:  # its one block to itself
            assert list(in_splits) == list(out_splits), (in_splits, out_splits)
            return x.clone()
        header = guard.begin(x) if guard is not None else None
        if header is None:
            src = self._lib(x)
            out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=src.device)
            dist.all_to_all_single(
                out, src, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits), group=self.group
            )
            return self._back(out, x)
        assert guard is not None
        row = x.element_size() * math.prod(x.shape[1:])
        flat = x.reshape(-1).view(torch.uint8)
        parts, at = [], 0
        for n in in_splits:
            parts += [flat[at : at + n * row], header]
            at += n * row
        src = self._lib(torch.cat(parts))
        sizes = [n * row + _guard.HEADER_BYTES for n in out_splits]
        recv = torch.empty(sum(sizes), dtype=torch.uint8, device=src.device)
        dist.all_to_all_single(recv, src, output_split_sizes=sizes,
                               input_split_sizes=[n * row + _guard.HEADER_BYTES for n in in_splits], group=self.group)
        recv = self._back(recv, x)
        pieces = recv.split(sizes)
        guard.end(torch.stack([p[-_guard.HEADER_BYTES:] for p in pieces]))
        payload = torch.cat([p[: -_guard.HEADER_BYTES] for p in pieces])
        return payload.view(x.dtype).view(sum(out_splits), *x.shape[1:])

    def exchange_splits(self, in_splits: Sequence[int], device: torch.device) -> list[int]:
        """Each rank's row count destined for this rank (one small all-to-all of the split vectors)."""
        if self.local:
            return [int(v) for v in in_splits]
        send = torch.tensor(list(in_splits), dtype=torch.int64, device="cpu" if self.stage else device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return [int(v) for v in recv.tolist()]


def _given(v: Sequence[int] | None) -> Sequence[int]:
    assert v is not None, "the communicator fills this argument before the call"
    return v
