"""The native route: torch.distributed collectives (NCCL on GPU, gloo on CPU).

It carries all data movement, every exact reduction (integer SUM, float MAX/MIN and argmax on
order-preserving keys, see detcomm.numerics.keys) and, under ``auto``, floating-point SUM with the library's own
arithmetic, which is run-stable at a fixed size but NOT batch-invariant: a ring chunks the buffer by message
size, so an element's association order follows its offset in the buffer.

Every method is collective over the group and returns a new tensor; inputs are never written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..numerics import keys, tree
from ..numerics.fold import reference_fold
from ..route import BoundRoute, Collective, ReduceOp, Route, Site
from .base import bind_from

# torch 2.13 renamed the flat-tensor collectives (*_single) and deprecated the old names; torch 2.4-2.12
# only have the old ones. Same signatures.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_TORCH_OP = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN}


class NativeBackend:
    route = Route.NATIVE

    def __init__(self, group: dist.ProcessGroup, *, stage_through_host: bool = False) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # A gloo group whose ranks keep their tensors on CUDA (W processes sharing one GPU, where NCCL refuses
        # to run): the library sees host copies, the caller gets results back on its device. Data movement and
        # exact integer reductions only; the bits are the same either way.
        self.stage = stage_through_host

    def bind(self, site: Site) -> BoundRoute:
        op = site.op
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
                Collective.ALL_REDUCE: lambda x, a: self.all_reduce(presum(x), ReduceOp.SUM).to(dtype),
                Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(presum(x), ReduceOp.SUM).to(dtype),
            })
        # A SUM (or an integer MIN/MAX) reduces the library's buffer in place; AVG and float MIN/MAX reduce keys.
        in_place = op is ReduceOp.SUM or (op is not ReduceOp.AVG and not site.is_float)
        return bind_from(self.route, site, {
            Collective.ALL_REDUCE: lambda x, a: self.all_reduce(x, op, out=a.out),
            Collective.REDUCE_SCATTER: lambda x, a: self.reduce_scatter(x, op),
            Collective.ALL_GATHER: lambda x, a: self.all_gather(x),
            Collective.TOKEN_ALL_GATHER: lambda x, a: self.token_all_gather(x, _given(a.rows_per_rank)),
            Collective.ALL_TO_ALL: lambda x, a: self.all_to_all(x, _given(a.in_splits), _given(a.out_splits)),
            Collective.ARGMAX: lambda x, a: self.argmax(x, a.vocab_start),
        }, in_place=in_place)

    def _lib(self, x: torch.Tensor) -> torch.Tensor:
        return x.cpu() if self.stage else x

    def _back(self, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return out.to(like.device) if self.stage else out

    # -- reductions ---------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: ReduceOp, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out=x`` reduces x itself where the library sees x (not staged through the host); any other ``out``
        is left to the communicator."""
        if op is ReduceOp.AVG:
            # gloo has no AVG: the library's SUM (not batch-invariant: this route makes no claim), one division.
            return (self.all_reduce(x, ReduceOp.SUM).to(torch.float32) / self.world_size).to(x.dtype)
        if op is ReduceOp.SUM or not x.is_floating_point():
            in_place = out is x and not self.stage
            buf = x if in_place else self._lib(x).clone()
            dist.all_reduce(buf, op=_TORCH_OP[op], group=self.group)
            return x if in_place else self._back(buf, x)
        k = self._lib(keys.to_key(x, op=op.value))
        dist.all_reduce(k, op=_TORCH_OP[op], group=self.group)
        return keys.from_key(self._back(k, x), x.dtype, op=op.value)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if op is ReduceOp.AVG:
            return (self.reduce_scatter(x, ReduceOp.SUM).to(torch.float32) / self.world_size).to(x.dtype)
        keyed = op is not ReduceOp.SUM and x.is_floating_point()
        src = self._lib(keys.to_key(x, op=op.value) if keyed else x)
        out = torch.empty((src.shape[0] // self.world_size, *src.shape[1:]), dtype=src.dtype, device=src.device)
        reduce_scatter_flat(out, src, op=_TORCH_OP[op], group=self.group)
        out = self._back(out, x)
        return keys.from_key(out, x.dtype, op=op.value) if keyed else out

    def argmax(self, logits: torch.Tensor, vocab_start: int) -> torch.Tensor:
        k = self._lib(keys.argmax_keys(logits, vocab_start))
        dist.all_reduce(k, op=dist.ReduceOp.MAX, group=self.group)
        return keys.argmax_index(self._back(k, logits))

    # -- data movement ------------------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        src = self._lib(x)
        out = torch.empty((x.shape[0] * self.world_size, *x.shape[1:]), dtype=x.dtype, device=src.device)
        all_gather_flat(out, src, group=self.group)
        return self._back(out, x)

    def token_all_gather(self, x: torch.Tensor, rows_per_rank: Sequence[int]) -> torch.Tensor:
        # Pad every rank's rows to the largest count so one fixed-size gather serves uneven inputs on every
        # library, then drop the padding.
        pad = max(rows_per_rank)
        if all(r == pad for r in rows_per_rank):
            return self.all_gather(x)
        padded = torch.zeros((pad, *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        gathered = self.all_gather(padded)
        parts = [gathered[r * pad : r * pad + n] for r, n in enumerate(rows_per_rank)]
        return torch.cat(parts, dim=0)

    def all_to_all(self, x: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int]) -> torch.Tensor:
        src = self._lib(x)
        out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=src.device)
        dist.all_to_all_single(
            out, src, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits), group=self.group
        )
        return self._back(out, x)

    def exchange_splits(self, in_splits: Sequence[int], device: torch.device) -> list[int]:
        """Each rank's row count destined for this rank (one small all-to-all of the split vectors)."""
        send = torch.tensor(list(in_splits), dtype=torch.int64, device="cpu" if self.stage else device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return [int(v) for v in recv.tolist()]


def _given(v: Sequence[int] | None) -> Sequence[int]:
    assert v is not None, "the communicator fills this argument before the call"
    return v
