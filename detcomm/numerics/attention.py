"""Batch-invariant attention over a paged KV cache (issue 42 item 1; the serving step's attention contract).

One call serves every real row of a step: prefill chunks and decode rows of any number of requests, packed. Row
r (query position p_r of request q_r) attends to its own request's cached keys at positions 0 .. p_r (and, with a
sliding ``window``, only those > p_r - window), read through the request's block table from a cache of
fixed-size blocks of ``block_size`` positions. Its arithmetic is fixed by its position alone:

* the keys are visited block by block in position order, from the first block holding a visible key to the
  block holding p_r: never the cache's capacity (max_context), never a split of the keys chosen from the batch;
* within a block: fp32 scores from one batched GEMM of a fixed shape, the block's maximum, exp in fp32, the
  block's probabilities times V in one batched GEMM of a fixed shape; across blocks the online softmax in fp32
  (running max m, sum l and accumulator rescaled by exp(m_old - m_new)); out = acc / l, rounded once to q's dtype;
* rows are computed in tiles of ``ROW_TILE`` rows whatever the step's row count, one kv head at a time, so every
  GEMM of every call has the same shape (batch ROW_TILE, whatever the step and however many kv heads a rank
  holds): the kernel a library picks follows the shape, and the shape never follows the batch or W. A row of a tile whose range does not cover a block is left untouched by that block (a
  select, not arithmetic), and keys outside a row's range enter as exact zeros (a select on K's scores and on V),
  so neither the tile's other rows nor stale slots of a reused block can reach a row's bits.

So a row's bits do not depend on the other rows of the step, on chunking, on the cache's capacity or the block
ids it was given, or on whether it is computed in a prefill (teacher forcing) or a decode step. This torch code
runs on any device; on CUDA the default is attention_triton.py's one-launch kernel of the same contract.
``PagedKV`` is what a serving engine owns: the cache, its allocator, the requests' block tables and the impl.

Rejected: split-KV (flash-decoding) chosen from the batch size (a row's sum order would follow the batch: the
tests' negative control); a dense [rows, max_context] score matrix (its cost and, on some libraries, its kernel
follow max_context); one GEMM per step over a variable row count (the kernel may change with the count).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

__all__ = ["ROW_TILE", "IMPLS", "PagedKVCache", "BlockAllocator", "StepKV", "KVStore", "PagedKV", "check_paged_geometry",
           "default_impl", "paged_attention", "step_rows"]

ROW_TILE = 16  # rows per tile: part of the arithmetic's definition (every GEMM's batch is ROW_TILE)


@dataclass
class PagedKVCache:
    """K and V of every layer in blocks: ``k``, ``v`` [layers, num_blocks, block_size, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, *, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device | str = "cpu") -> PagedKVCache:
        for name, n in (("layers", layers), ("num_blocks", num_blocks), ("block_size", block_size),
                        ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if n < 1:
                raise ValueError(f"PagedKVCache.empty: {name} must be >= 1, got {n}")
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, block_tables: torch.Tensor,
              row_request: torch.Tensor, positions: torch.Tensor) -> None:
        """Store the step's new keys and values ([rows, kv_heads, head_dim]) at their requests' positions."""
        b = self.block_size
        blocks = block_tables[row_request, positions // b]
        self.k[layer, blocks, positions % b] = k
        self.v[layer, blocks, positions % b] = v


class BlockAllocator:
    """Hands out block ids of a cache; which ids a request gets never changes its bits (the tests vary it)."""

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"BlockAllocator: {n} blocks asked, {len(self._free)} free: a larger cache "
                             "(num_blocks) or fewer concurrent requests")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    @property
    def available(self) -> int:
        """Blocks not handed out."""
        return len(self._free)


IMPLS = ("torch", "triton")


def check_paged_geometry(*, block_size: int, num_blocks: int, max_context: int, impl: str | None) -> None:
    """ValueError unless a paged cache of ``num_blocks`` blocks of ``block_size`` (a power of two: the triton
    kernel's tile) holds one request of ``max_context`` tokens, and ``impl`` is one of IMPLS or None."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two (the triton kernel's tile), got {block_size}")
    if num_blocks < -(-max_context // block_size):
        raise ValueError(f"num_blocks={num_blocks} cannot hold one request of max_context={max_context} "
                         f"({-(-max_context // block_size)} blocks of {block_size}): raise num_blocks")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"the attention impl must be one of {IMPLS} or None (the device's default), got {impl!r}")


def default_impl(device: torch.device) -> str:
    """The impl a step on ``device`` uses unless told: "triton" on CUDA, "torch" elsewhere."""
    return "triton" if device.type == "cuda" else "torch"


@dataclass(frozen=True)
class StepKV:
    """One step's attention rows: ``block_tables`` [segments, max_blocks] (the segments' tables, zero-padded),
    ``row_request`` and ``positions`` [rows] (each real row's segment and query position, rows packed in
    segment order)."""

    block_tables: torch.Tensor
    row_request: torch.Tensor
    positions: torch.Tensor


def step_rows(spans: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's (row_request, positions) [rows] on the host, for segments of ``spans`` (start, n) packed in order."""
    req = torch.cat([torch.full((n,), i, dtype=torch.long) for i, (_, n) in enumerate(spans)])
    pos = torch.cat([torch.arange(start, start + n) for start, n in spans])
    return req, pos


class KVStore(Protocol):
    """What a step asks of the KV cache its segments' tables belong to: ``step`` lays out the step's rows (growing
    the tables), ``attend`` writes a layer's new keys and values and runs the one attention call. ``PagedKV`` is the
    serving engine's; detcomm.rl's trainer has one whose writes autograd can follow."""

    def step(self, tables: Sequence[list[int]], spans: Sequence[tuple[int, int]]) -> StepKV: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepKV, *, scale: float,
               window: int | None) -> torch.Tensor: ...


class PagedKV:
    """A serving engine's KV cache: a ``PagedKVCache`` of ``num_blocks`` blocks per layer, its allocator, and the
    attention ``impl`` of every step (None: ``default_impl(device)``). The impl is named once because the two
    impls' bits differ: a trainer that must reproduce the engine's bits uses the engine's ``impl``.

    A request's cache is its block table (``new_table``: a list of block ids in position order), grown by ``step``
    to cover the rows it is given and handed back by ``free``. ``block_size`` is part of the arithmetic (the
    online softmax runs block by block); ``num_blocks`` and which ids a request holds are not."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 max_context: int, dtype: torch.dtype, device: torch.device, impl: str | None = None) -> None:
        check_paged_geometry(block_size=block_size, num_blocks=num_blocks, max_context=max_context, impl=impl)
        self.max_blocks = -(-max_context // block_size)
        self.impl = impl or default_impl(device)
        self.block_size, self.device = block_size, device
        self.cache = PagedKVCache.empty(layers=layers, num_blocks=num_blocks, block_size=block_size,
                                        kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)

    def blocks_for(self, length: int) -> int:
        """Blocks a request of ``length`` cached positions holds."""
        return -(-length // self.block_size)

    def new_table(self) -> list[int]:
        """An empty request's block table."""
        return []

    def free(self, table: list[int]) -> None:
        """Hand a request's blocks back (the table is emptied: it may start a new request)."""
        self.allocator.free(table)
        table.clear()

    def step_shapes(self, *, segments: int, rows: int) -> dict[str, tuple[int, ...]]:
        """The shapes of a step's ``StepKV`` fields for up to ``segments`` segments and ``rows`` rows: what a
        static buffer of them holds (``stage`` writes them, ``static_step`` reads them)."""
        return {"block_tables": (segments, self.max_blocks), "row_request": (rows,), "positions": (rows,)}

    def stage(self, host: Mapping[str, np.ndarray], tables: Sequence[list[int]],
              spans: Sequence[tuple[int, int]]) -> None:
        """Grow each segment's table to cover its rows (``spans``: (start, n) per segment; positions must fit
        max_context, which pack_segments checks) and write the step's ``StepKV`` fields into the host arrays
        ``host`` (of ``step_shapes``; at least len(tables) segments and the step's rows): the tables zero-padded,
        each real row's segment and position. Entries past the step's segments and rows are left as they are: no
        step reads them (a row reads its own segment's table, up to the block holding its position)."""
        for table, (start, n) in zip(tables, spans):
            need = self.blocks_for(start + n) - len(table)
            if need > 0:
                table.extend(self.allocator.allocate(need))
        bt, req, pos = host["block_tables"], host["row_request"], host["positions"]
        if len(tables) > bt.shape[0] or sum(n for _, n in spans) > req.shape[0]:
            raise ValueError(f"PagedKV.stage: {len(tables)} segments of {sum(n for _, n in spans)} rows do not fit "
                             f"buffers of {bt.shape[0]} segments and {req.shape[0]} rows")
        bt[: len(tables)] = 0
        at = 0
        for i, (table, (start, n)) in enumerate(zip(tables, spans)):
            bt[i, : len(table)] = table
            req[at : at + n] = i
            pos[at : at + n] = np.arange(start, start + n)
            at += n

    def static_step(self, dev: Mapping[str, torch.Tensor], rows: int) -> StepKV:
        """The ``StepKV`` of a step of ``rows`` rows on device buffers of ``step_shapes`` (``stage``'s values,
        copied): views, the same tensors every step of that row count (what a CUDA graph captures)."""
        return StepKV(dev["block_tables"], dev["row_request"][:rows], dev["positions"][:rows])

    def step(self, tables: Sequence[list[int]], spans: Sequence[tuple[int, int]]) -> StepKV:
        """``stage`` into fresh host arrays of this step's exact sizes, moved to the device in one copy."""
        rows = sum(n for _, n in spans)
        shapes = self.step_shapes(segments=len(tables), rows=rows)
        flat = np.zeros(sum(int(np.prod(s)) for s in shapes.values()), dtype=np.int64)
        host, at = {}, 0
        for name, shape in shapes.items():
            size = int(np.prod(shape))
            host[name] = flat[at : at + size].reshape(shape)
            at += size
        self.stage(host, tables, spans)
        dev = torch.from_numpy(flat).to(self.device)
        bt_size = len(tables) * self.max_blocks
        return StepKV(dev[:bt_size].view(len(tables), self.max_blocks), dev[bt_size : bt_size + rows],
                      dev[bt_size + rows :])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepKV, *, scale: float,
               window: int | None) -> torch.Tensor:
        """Write the step's keys and values ([rows, kv_heads, head_dim]) into ``layer``'s cache, then one
        ``paged_attention`` call over every row of q ([rows, heads, head_dim]): [rows, heads, head_dim]."""
        self.cache.write(layer, k, v, block_tables=step.block_tables, row_request=step.row_request,
                         positions=step.positions)
        return paged_attention(q, self.cache, layer, block_tables=step.block_tables, row_request=step.row_request,
                               positions=step.positions, scale=scale, window=window, impl=self.impl)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, *, block_tables: torch.Tensor,
                    row_request: torch.Tensor, positions: torch.Tensor, scale: float,
                    window: int | None = None, impl: str | None = None) -> torch.Tensor:
    """Attention of every row of a step (module docstring): ``q`` [rows, heads, head_dim], heads a multiple of the
    cache's kv_heads (grouped queries); ``block_tables`` [requests, max_blocks] int (a request's block ids in
    position order; entries past its length are ignored); ``row_request`` [rows] the request of each row;
    ``positions`` [rows] each row's query position (its keys, this step's included, must be written first).
    Returns [rows, heads, head_dim] in q's dtype.

    ``impl``: "torch" (this module, any device) or "triton" (attention_triton.py: one launch, CUDA); default
    "triton" on CUDA, "torch" elsewhere. Both keep the contract; their bits differ from each other, so a serving
    step and the trainer that must reproduce it name the same one."""
    rows, heads, hd = q.shape
    _, _, bs, kvh, hd_c = cache.k.shape
    if hd != hd_c or heads % kvh:
        raise ValueError(f"paged_attention: q has {heads} heads of {hd}, the cache {kvh} kv heads of {hd_c}: heads "
                         "must be a multiple of kv_heads and head_dim equal")
    if row_request.shape != (rows,) or positions.shape != (rows,):
        raise ValueError(f"paged_attention: row_request and positions must be [{rows}] (one per row of q), got "
                         f"{tuple(row_request.shape)} and {tuple(positions.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window must be >= 1 or None, got {window}")
    impl = impl or default_impl(q.device)
    if impl not in IMPLS:
        raise ValueError(f"paged_attention: impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "triton":
        if bs & (bs - 1):
            raise ValueError(f"paged_attention: the triton kernel takes a power-of-two block_size, got {bs}")
        from .attention_triton import paged_attention_triton  # triton comes with torch's CUDA builds

        return paged_attention_triton(q.contiguous(), cache.k[layer], cache.v[layer], block_tables=block_tables,
                                      row_request=row_request, positions=positions, scale=scale, window=window)
    group = heads // kvh
    dev = q.device
    out = torch.empty(rows, heads, hd, dtype=q.dtype, device=dev)
    for t0 in range(0, rows, ROW_TILE):
        n = min(ROW_TILE, rows - t0)
        qt = torch.zeros(ROW_TILE, heads, hd, dtype=torch.float32, device=dev)
        qt[:n] = q[t0 : t0 + n]
        req = torch.zeros(ROW_TILE, dtype=torch.long, device=dev)
        req[:n] = row_request[t0 : t0 + n]
        pos = torch.full((ROW_TILE,), -1, dtype=torch.long, device=dev)  # filler rows cover no block
        pos[:n] = positions[t0 : t0 + n]
        lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)
        tables = block_tables[req]
        # One kv head at a time: every GEMM's batch is ROW_TILE whatever the number of kv heads this rank holds,
        # so a head's bits do not follow the tensor-parallel W either.
        heads_q = [qt[:, g * group : (g + 1) * group].contiguous() for g in range(kvh)]
        for g, o in enumerate(_tile(heads_q, cache.k[layer], cache.v[layer], tables=tables, pos=pos, lo=lo, n=n,
                                    scale=scale)):
            out[t0 : t0 + n, g * group : (g + 1) * group] = o[:n].to(q.dtype)
    return out


def _tile(heads_q: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, *, tables: torch.Tensor, pos: torch.Tensor,
          lo: torch.Tensor, n: int, scale: float) -> list[torch.Tensor]:
    """One tile's rows, each kv head on its own: heads_q[g] [ROW_TILE, group, hd] fp32 (head g's queries);
    k, v [num_blocks, block_size, kv_heads, hd] (one layer); tables [ROW_TILE, max_blocks] the rows' block tables;
    rows n.. are filler. Per kv head [ROW_TILE, group, hd] fp32. What does not depend on the head (the rows'
    block range, the visibility, the block gather) is computed once per block; every head's arithmetic runs on
    its own tensors of the fixed shapes."""
    dev, bs = k.device, k.shape[1]
    first, last = lo // bs, torch.where(pos >= 0, pos // bs, -1)
    shape = heads_q[0].shape
    state = [(torch.full((*shape[:2], 1), float("-inf"), device=dev), torch.zeros((*shape[:2], 1), device=dev),
              torch.zeros(shape, device=dev)) for _ in heads_q]
    offs = torch.arange(bs, device=dev)
    for j in range(int(first[:n].min()), int(last[:n].max()) + 1):
        active = ((first <= j) & (j <= last)).view(-1, 1, 1)
        ids = tables[:, min(j, tables.shape[1] - 1)].clamp(min=0)
        kpos = j * bs + offs  # [B]
        vis = ((kpos[None] <= pos[:, None]) & (kpos[None] >= lo[:, None]))[:, None, :]  # [R, 1, B]
        vis_t = vis.transpose(1, 2)
        kb_all, vb_all = k[ids], v[ids]  # [R, B, kv_heads, hd]
        for g, q in enumerate(heads_q):
            m, l, acc = state[g]
            kb = kb_all[:, :, g].contiguous().to(torch.float32).transpose(1, 2)  # [R, hd, B]
            vb = torch.where(vis_t, vb_all[:, :, g].contiguous().to(torch.float32), 0.0)  # stale/future: exact 0
            s = torch.where(vis, torch.bmm(q, kb) * scale, float("-inf"))  # [R, group, B]
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)
            corr = torch.exp(m - m_new)
            l_new = l * corr + p.sum(dim=-1, keepdim=True)
            acc_new = acc * corr + torch.bmm(p, vb)
            state[g] = (torch.where(active, m_new, m), torch.where(active, l_new, l), torch.where(active, acc_new, acc))
    return [acc / l for _, l, acc in state]
