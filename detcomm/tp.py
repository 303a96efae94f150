"""Tensor-parallel layers whose bits do not depend on the tensor-parallel width W (docs/spec.md §9.1).

A Megatron row-parallel layer sums W partials, so its bits follow W. These fix every shape the arithmetic sees:

* ``ColumnParallelLinear``: each rank computes its output columns in fixed column blocks (the same [rows, K] x
  [K, block] shape at every W), so a column's kernel configuration never changes with N/W. No communication. On
  CUDA one fixed-config Triton launch whose tiles never straddle a block (``shard_gemm.block_gemm``); on CPU one
  torch GEMM per block.
* ``RowParallelLinear`` in three layouts:

  - ``"fold"``: today's Megatron layer: one GEMM over the rank's K/W inputs, the canonical all-reduce of the W
    partials. Batch-invariant at one W; the bits change with W.
  - ``"virtual"``: the reduction dimension is split into V fixed virtual shards; shard v's partial ``x[:, K_v] @
    W[K_v, :]`` is an fp32 GEMM of one fixed shape, and the all-reduce folds the V partials in shard order (a site
    with ``virtual_shards=V``): the same bits for every W dividing V, W = 1 included. On CUDA the V/W partials are
    one fixed-config Triton launch, the shard on the grid (``shard_gemm.shard_partials``: its bits, not cuBLAS's);
    on CPU one torch GEMM per shard. ``shard_fold="tree"`` sums them by the fixed balanced tree instead (V and W
    powers of two, W dividing V): each rank folds its own V/W partials; one fp32 value per element crosses the wire.
  - ``"full_k"``: an all-gather of the K-wide input, then every rank computes its N/W output columns as full-K GEMMs
    in fixed column blocks, then an all-gather of the output columns. No cross-rank sum at all: the value a TP=1
    layer with the same column blocks computes, for every W dividing the block count.
* ``VocabParallelEmbedding``: vocab/W rows a rank; the owner of a token's row supplies it (all-gather, exact).
* ``VocabParallelHead``: the LM head's logits in fixed vocabulary blocks, and from them the log-softmax, the greedy
  argmax and seeded Gumbel-max sampling. The log-softmax takes each block's max and sum of exp in a fixed order (a
  halving tree over a power-of-two padded block) and combines the blocks in block order: it does not follow W.

exp and log run on tensors of one fixed shape whose rows hold a multiple of 64 elements (no CPU scalar tail). Layers
take the FULL weight (the same on every rank) and keep this rank's part; rows are dim 0, in a buffer of a fixed row
count (the step's padded width), and callers say how many rows are real: only those travel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

import detcomm

from .numerics import shard_gemm

__all__ = ["LAYOUTS", "Layout", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "VocabParallelHead", "gumbel_noise", "check_divides", "Segment", "pack_segments", "stage_segments"]

Layout = Literal["fold", "virtual", "full_k"]
LAYOUTS: tuple[str, ...] = ("fold", "virtual", "full_k")

# Rows of every tensor a transcendental op sees hold a multiple of this many elements (see the module doc).
_VEC = 64


def check_divides(what: str, total: int, parts: int, world: int) -> None:
    """ValueError unless ``parts`` divides ``total`` and ``world`` divides ``parts`` (a layout's fixed blocks
    must tile the dimension and every rank must own whole blocks)."""
    if parts < 1 or total % parts:
        raise ValueError(f"{what}: {parts} fixed blocks do not tile {total} (pick a divisor of {total})")
    if parts % world:
        raise ValueError(f"{what}: the world size {world} does not divide the {parts} fixed blocks; "
                         f"TP-size invariance holds for the W that divide {parts}: run at one of those W")


def _matrix_and_group(weight: torch.Tensor, dims: str, rank: int | None, world: int | None) -> tuple[int, int]:
    """TypeError unless ``weight`` is a 2-D tensor (``dims`` names its axes); this rank and the world size
    (default: the default process group's)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"weight must be a 2-D [{dims}] tensor")
    return (dist.get_rank() if rank is None else rank), (dist.get_world_size() if world is None else world)


def _gathered_columns(gathered: torch.Tensor, world: int, rows: int) -> torch.Tensor:
    """An all-gather's [W * rows, C] (rank blocks of rows) as [rows, W * C] (rank blocks of columns)."""
    cols = gathered.shape[1]
    return gathered.view(world, rows, cols).transpose(0, 1).reshape(rows, world * cols)


class ColumnParallelLinear:
    """``y = x @ W[:, cols of this rank]``, local (no communication).

    ``weight``: the full [K, N] matrix. ``blocks``: the number of fixed column blocks N is cut into (every
    GEMM then has the shape [rows, K] x [K, N/blocks] at every W; W must divide ``blocks``), or None for one
    GEMM over the rank's N/W columns (the plain layer, whose shape changes with W)."""

    def __init__(self, weight: torch.Tensor, *, blocks: int | None, rank: int | None = None, world: int | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> None:
        rank, world = _matrix_and_group(weight, "in, out", rank, world)
        k, n = weight.shape
        if n % world:
            raise ValueError(f"ColumnParallelLinear: the world size {world} does not divide the {n} output columns")
        dt = dtype or weight.dtype
        local = weight[:, rank * (n // world) : (rank + 1) * (n // world)]
        if blocks is None:
            self.blocks = [local.contiguous().to(dt).to(device)]
        else:
            check_divides("ColumnParallelLinear", n, blocks, world)
            width = n // blocks
            # Separate contiguous tensors: a strided view could take another GEMM path than a block of its own.
            self.blocks = [local[:, j : j + width].contiguous().to(dt).to(device) for j in range(0, n // world, width)]
            if torch.device(device).type == "cuda":  # the one-launch kernel reads them as slabs of one buffer
                shard_gemm.packed(self.blocks)
        self.fixed_blocks = blocks is not None
        self.in_features, self.out_features, self.local_out = k, n, n // world

    def _blocked(self, x: torch.Tensor) -> torch.Tensor | None:
        """On CUDA with fixed blocks: all blocks in one launch, [rows, N/W] (autograd: shard_gemm.BlockGemm).
        None elsewhere (CPU keeps one torch GEMM per block; the plain layer keeps its one cuBLAS GEMM)."""
        if not (x.is_cuda and self.fixed_blocks):
            return None
        y: torch.Tensor = shard_gemm.BlockGemm.apply(x, False, len(self.blocks), *self.blocks)
        return y

    def forward_blocks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """This rank's output column blocks, in order, each [rows, N/blocks] (or one [rows, N/W] block)."""
        y = self._blocked(x)
        if y is not None:
            return list(y.split(self.blocks[0].shape[1], dim=1))
        return [torch.matmul(x, w) for w in self.blocks]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, K] -> this rank's [rows, N/W] output columns."""
        y = self._blocked(x)
        if y is not None:
            return y
        out = self.forward_blocks(x)
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)


class RowParallelLinear:
    """``y = x @ W`` with x's K columns sharded over the ranks (rank r holds columns r*K/W .. (r+1)*K/W - 1);
    every rank returns the whole [rows, N] output, identical bits on every rank.

    ``layout``: "fold", "virtual" (``virtual_shards`` V; W must divide V; ``shard_fold`` "order" or "tree",
    docs/spec.md §9.1 "The tree order") or "full_k" (``blocks`` fixed output column blocks; W must divide
    ``blocks``). ``shard_weights`` (virtual layout, keyword-only): "fp32" (default) keeps each shard in fp32, the
    tensors a trainer updates; "model" keeps them in the layer's dtype (the same values: the fp32 shards are exact
    widenings of it), halving the bytes the CUDA kernel streams (its 2-byte tensor-core path, other GPU bits than
    "fp32"'s); on CPU both give today's bits (the shard is widened exactly before its fp32 GEMM). ``site``: the call
    site's name (full_k declares
    ``<site>.gather_in`` and ``<site>.gather_out``). ``max_rows``: the most real rows a call carries.
    Call ``declare()`` once after ``detcomm.init`` (collective), then the layer on every rank."""

    def __init__(self, weight: torch.Tensor, *, site: str, layout: Layout, max_rows: int,
                 virtual_shards: int | None = None, blocks: int | None = None, route: str | None = None,
                 rank: int | None = None, world: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", shard_fold: str = "order",
                 shard_weights: Literal["fp32", "model"] = "fp32") -> None:
        rank, world = _matrix_and_group(weight, "in, out", rank, world)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if (virtual_shards is not None) != (layout == "virtual"):
            raise ValueError("virtual_shards is given exactly for layout='virtual'")
        if shard_weights not in ("fp32", "model"):
            raise ValueError(f"shard_weights must be 'fp32' or 'model', got {shard_weights!r}")
        if shard_weights != "fp32" and layout != "virtual":
            raise ValueError(f"shard_weights={shard_weights!r} stores virtual shards: it needs layout='virtual'")
        self.shard_weights = shard_weights
        if shard_fold != "order" and layout != "virtual":
            raise ValueError(f"shard_fold={shard_fold!r} orders the sum of virtual shards: it needs layout='virtual'")
        self.shard_fold = shard_fold
        if (blocks is not None) != (layout == "full_k"):
            raise ValueError("blocks is given exactly for layout='full_k'")
        k, n = weight.shape
        if k % world:
            raise ValueError(f"RowParallelLinear {site!r}: the world size {world} does not divide K={k}")
        self.site, self.layout, self.max_rows, self.route = site, layout, max_rows, route
        self.rank, self.world, self.in_features, self.out_features = rank, world, k, n
        self.dtype = dt = dtype or weight.dtype
        lo, hi = rank * (k // world), (rank + 1) * (k // world)
        if layout == "fold":
            self.weights = [weight[lo:hi].contiguous().to(dt).to(device)]
        elif layout == "virtual":
            assert virtual_shards is not None
            check_divides(f"RowParallelLinear {site!r} virtual_shards", k, virtual_shards, world)
            self.virtual_shards = v = virtual_shards
            kv = k // v
            # fp32 shards: the partial is an fp32 GEMM whatever the model dtype (docs/spec.md §9.1); "model": the
            # same values in the model dtype, widened exactly where they are multiplied.
            store = torch.float32 if shard_weights == "fp32" else dt
            self.weights = [weight[s * kv : (s + 1) * kv].to(dt).to(store).contiguous().to(device)
                            for s in range(rank * (v // world), (rank + 1) * (v // world))]
            if torch.device(device).type == "cuda":  # the one-launch kernel reads them as slabs of one buffer
                shard_gemm.packed(self.weights)
        else:
            assert blocks is not None
            check_divides(f"RowParallelLinear {site!r} blocks", n, blocks, world)
            width = n // blocks
            cols = weight[:, rank * (n // world) : (rank + 1) * (n // world)]
            self.weights = [cols[:, j : j + width].contiguous().to(dt).to(device) for j in range(0, n // world, width)]

    def declare(self) -> None:
        """Declare the layer's call sites (collective: same order on every rank)."""
        if self.layout == "fold":
            detcomm.site(self.site, collective="all_reduce", dtype=self.dtype, shape=(self.out_features,),
                         max_rows=self.max_rows, route=self.route)
        elif self.layout == "virtual":
            detcomm.site(self.site, collective="all_reduce", dtype=self.dtype, shape=(self.out_features,),
                         max_rows=self.max_rows, route=self.route, virtual_shards=self.virtual_shards,
                         shard_fold=self.shard_fold)
        else:
            detcomm.site(f"{self.site}.gather_in", collective="all_gather", dtype=self.dtype,
                         shape=(self.in_features // self.world,), max_rows=self.max_rows)
            detcomm.site(f"{self.site}.gather_out", collective="all_gather", dtype=self.dtype,
                         shape=(self.out_features // self.world,), max_rows=self.max_rows)

    def _check_input(self, x: torch.Tensor, rows: int) -> None:
        if x.dim() != 2 or x.shape[1] != self.in_features // self.world:
            raise ValueError(f"RowParallelLinear {self.site!r}: input must be [T, {self.in_features // self.world}], "
                             f"got {tuple(x.shape)}")
        if not 1 <= rows <= x.shape[0]:
            raise ValueError(f"RowParallelLinear {self.site!r}: rows must be in 1..{x.shape[0]}, got {rows}")

    def partials(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The local part of the fold or virtual layout, what the layer's sum reduces: the fold layout's partial
        product [rows, N] in the layer's dtype, or the virtual layout's V/W fp32 shard partials [V/W, rows, N]
        (slab j is shard r*V/W + j), contiguous. ``x`` and ``rows`` as for ``__call__``; the GEMMs run on all T rows
        (one shape whatever the row count). A layer boundary passes them to ``detcomm.all_reduce_residual_rmsnorm``
        at an all_reduce_rmsnorm site declared with this layer's virtual_shards and shard_fold. Local."""
        self._check_input(x, rows)
        if self.layout == "fold":
            return torch.matmul(x, self.weights[0])[:rows]
        if self.layout != "virtual":
            raise ValueError(f"RowParallelLinear {self.site!r}: layout={self.layout!r} has no partial sums (full-K "
                             "computes whole output columns)")
        if x.is_cuda:
            # All V/W shards in one fixed-config launch (shard on the grid): bits independent of V/W and T.
            parts: torch.Tensor = shard_gemm.ShardPartials.apply(x, *self.weights)
            return parts[:, :rows].contiguous()
        kv = self.in_features // self.virtual_shards
        xf = x.to(torch.float32)
        # One [T, K/V] x [K/V, N] fp32 GEMM per shard: the same shape at every W and every row count.
        parts = torch.stack([torch.matmul(xf[:, j * kv : (j + 1) * kv].contiguous(), w.to(torch.float32))
                             for j, w in enumerate(self.weights)])
        return parts[:, :rows].contiguous()

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """``x``: this rank's [T, K/W] input columns in a fixed T-row buffer, the first ``rows`` real.
        Returns the [rows, N] output in the layer's dtype. Collective."""
        self._check_input(x, rows)
        if self.layout in ("fold", "virtual"):
            return detcomm.all_reduce(self.partials(x, rows), site=self.site)
        # full_k: the K-wide input (data movement), full-K GEMMs on fixed column blocks, the output columns.
        t = x.shape[0]
        full = torch.zeros(t, self.in_features, dtype=x.dtype, device=x.device)
        gathered = detcomm.all_gather(x[:rows].contiguous(), site=f"{self.site}.gather_in")
        full[:rows] = _gathered_columns(gathered, self.world, rows)
        local = torch.cat([torch.matmul(full, w) for w in self.weights], dim=1)
        out = detcomm.all_gather(local[:rows].contiguous(), site=f"{self.site}.gather_out")
        return _gathered_columns(out, self.world, rows)


class VocabParallelEmbedding:
    """Embedding rows sharded over the vocabulary: rank r holds rows r*vocab/W .. (r+1)*vocab/W - 1.

    ``__call__(ids)`` returns [T, H] on every rank: each rank looks up the ids it owns (zeros elsewhere), an
    all-gather moves the W lookups and every rank picks each row from its owner. Data movement only, so the
    bits are the table's at every W (no sum, not even of zeros: -0.0 stays -0.0). Collective."""

    def __init__(self, weight: torch.Tensor, *, site: str, max_rows: int, rank: int | None = None,
                 world: int | None = None, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> None:
        rank, world = _matrix_and_group(weight, "vocab, hidden", rank, world)
        vocab, hidden = weight.shape
        if vocab % world:
            raise ValueError(f"VocabParallelEmbedding: the world size {world} does not divide vocab={vocab}")
        self.site, self.max_rows, self.rank, self.world = site, max_rows, rank, world
        self.vocab, self.hidden, self.local = vocab, hidden, vocab // world
        self.start = rank * self.local
        self.dtype = dtype or weight.dtype
        self.weight = weight[self.start : self.start + self.local].contiguous().to(self.dtype).to(device)

    def declare(self) -> None:
        """Declare the gather site (collective)."""
        detcomm.site(self.site, collective="all_gather", dtype=self.dtype, shape=(self.hidden,), max_rows=self.max_rows)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 1:
            raise ValueError(f"VocabParallelEmbedding: ids must be 1-D, got shape {tuple(ids.shape)}")
        mine = (ids >= self.start) & (ids < self.start + self.local)
        local = self.weight[torch.where(mine, ids - self.start, 0)]
        gathered = detcomm.all_gather(local, site=self.site).view(self.world, ids.shape[0], self.hidden)
        owner = torch.div(ids, self.local, rounding_mode="floor")
        return gathered[owner, torch.arange(ids.shape[0], device=ids.device)]


def gumbel_noise(key: int, vocab: int) -> torch.Tensor:
    """The fp32 Gumbel noise ``-log(-log(u))`` over the whole vocabulary for one sampling key: u from
    ``torch.rand`` on a CPU generator seeded with ``key`` (clamped at 1e-30), computed on the full [vocab]
    vector so an index's noise does not depend on which rank holds it."""
    g = torch.Generator().manual_seed(key)
    u = torch.rand(vocab, generator=g, dtype=torch.float32).clamp_min(1e-30)
    return -torch.log(-torch.log(u))


class VocabParallelHead:
    """The LM head, vocabulary-parallel over fixed vocabulary blocks (docs/spec.md "TP-size invariance:
    layouts").

    ``weight``: the full [H, vocab] matrix; ``blocks``: the number of fixed vocabulary blocks (W must divide
    it; rank r holds blocks r*blocks/W .. and the vocabulary columns they cover). ``t_pad``: the fixed row
    count of every buffer the head computes on (the serving step's padded width); a call carries up to
    ``t_pad`` rows. ``site``: the prefix of the head's sites. Call ``declare()`` once (collective)."""

    def __init__(self, weight: torch.Tensor, *, blocks: int, t_pad: int, site: str = "lm_head",
                 rank: int | None = None, world: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> None:
        rank, world = _matrix_and_group(weight, "hidden, vocab", rank, world)
        hidden, vocab = weight.shape
        check_divides("VocabParallelHead", vocab, blocks, world)
        self.rank, self.world, self.vocab, self.t_pad, self.site = rank, world, vocab, t_pad, site
        self.blocks, self.block = blocks, vocab // blocks
        self.local_blocks = blocks // world
        self.vocab_local = vocab // world
        self.vocab_start = rank * self.vocab_local
        # The padded block width: a power of two (the halving tree) and a multiple of 64 (no scalar tail).
        self.padded = max(_VEC, 1 << (self.block - 1).bit_length())
        dt = dtype or weight.dtype
        self.device = torch.device(device)
        self.weights = [weight[:, j * self.block : (j + 1) * self.block].contiguous().to(dt).to(device)
                        for j in range(rank * self.local_blocks, (rank + 1) * self.local_blocks)]

    def declare(self) -> None:
        """Declare the head's sites (collective)."""
        f32 = torch.float32
        detcomm.site(f"{self.site}.stats", collective="all_gather", dtype=f32, shape=(2 * self.local_blocks,),
                     max_rows=self.t_pad)
        detcomm.site(f"{self.site}.logprobs", collective="all_gather", dtype=f32, shape=(self.vocab_local,),
                     max_rows=self.t_pad)
        detcomm.site(f"{self.site}.argmax", collective="argmax", dtype=f32, shape=(self.vocab_local,),
                     max_rows=self.t_pad)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> this rank's fp32 logits [T, vocab/W]: one [T, H] x [H, block] GEMM per fixed block. Local."""
        return torch.cat([torch.matmul(x, w).to(torch.float32) for w in self.weights], dim=1)

    def _pad_rows(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        n = x.shape[0]
        if not 1 <= n <= self.t_pad:
            raise ValueError(f"VocabParallelHead: a call carries 1..t_pad={self.t_pad} rows, got {n}")
        buf = torch.full((self.t_pad, *x.shape[1:]), fill, dtype=torch.float32, device=x.device)
        buf[:n] = x
        return buf

    def _block_stats(self, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per local block b, on the fixed [t_pad, padded] buffer: m_b = the block's max, s_b = the halving
        tree sum of exp(x - m_b) (padding is -inf, whose exp is +0.0)."""
        x = self._pad_rows(shard, 0.0)
        ms, ss = [], []
        for j in range(self.local_blocks):
            blk = torch.full((self.t_pad, self.padded), float("-inf"), dtype=torch.float32, device=x.device)
            blk[:, : self.block] = x[:, j * self.block : (j + 1) * self.block]
            m = blk.amax(dim=1, keepdim=True)
            v = torch.exp(blk - m)
            h = self.padded // 2
            while h >= 1:  # v_i = v_i + v_{i+h}, i < h: one fixed tree for every W and row count
                v = v[:, :h] + v[:, h : 2 * h]
                h //= 2
            ms.append(m)
            ss.append(v)
        return torch.cat(ms, dim=1), torch.cat(ss, dim=1)

    def log_normalizer(self, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, L) per row, [n] each, identical on every rank: M = the max logit, L = log(sum over blocks in block
        order of s_b * exp(m_b - M)), so logprob = (x - M) - L. Collective (one all-gather of 2 floats per
        block and row)."""
        n = shard.shape[0]
        m, s = self._block_stats(shard)
        stats = torch.cat([m[:n], s[:n]], dim=1).contiguous()  # [n, 2 * local blocks]
        g = detcomm.all_gather(stats, site=f"{self.site}.stats").view(self.world, n, 2, self.local_blocks)
        g = g.permute(1, 2, 0, 3).reshape(n, 2, self.blocks)  # rank order is block order
        mb = self._pad_rows(g[:, 0], float("-inf"))
        sb = self._pad_rows(g[:, 1], 0.0)
        big = mb.amax(dim=1, keepdim=True)  # exact in any order
        scale_in = torch.full((self.t_pad, _VEC * ((self.blocks + _VEC - 1) // _VEC)), float("-inf"),
                              dtype=torch.float32, device=shard.device)
        scale_in[:, : self.blocks] = mb - big
        c = sb * torch.exp(scale_in)[:, : self.blocks]
        acc = torch.zeros(self.t_pad, dtype=torch.float32, device=shard.device)
        for b in range(self.blocks):  # the canonical fold over blocks: +0.0, block order, fp32
            acc = acc + c[:, b]
        log_in = torch.ones(self.t_pad, _VEC, dtype=torch.float32, device=shard.device)
        log_in[:, 0] = acc
        return big[:n, 0], torch.log(log_in)[:n, 0]

    def logprobs_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """This rank's fp32 logprobs [n, vocab/W] (``shard``: this rank's logits). Collective."""
        big, lse = self.log_normalizer(shard)
        return (shard - big[:, None]) - lse[:, None]

    def logprobs(self, shard: torch.Tensor) -> torch.Tensor:
        """fp32 log-softmax over the whole vocabulary, [n, vocab], identical bits on every rank and at every W
        dividing ``blocks``. Collective."""
        n = shard.shape[0]
        lp = self.logprobs_shard(shard).contiguous()
        full = detcomm.all_gather(lp, site=f"{self.site}.logprobs")
        return _gathered_columns(full, self.world, n)

    def greedy(self, shard: torch.Tensor) -> torch.Tensor:
        """Global argmax of the logits per row (lowest index on exact ties), int64 [n]. Collective."""
        return detcomm.argmax(shard, site=f"{self.site}.argmax", vocab_start=self.vocab_start)

    def sample(self, logprobs_shard: torch.Tensor, *, temperatures: Sequence[float], keys: Sequence[int]) -> torch.Tensor:
        """Seeded Gumbel-max sampling, vocabulary-parallel: row i's token is the global argmax of
        ``logprobs / temperatures[i] + gumbel_noise(keys[i])`` (temperature 0: the argmax of the logprobs).
        The noise of an index does not depend on W, and the argmax is exact. int64 [n]. Collective."""
        n = logprobs_shard.shape[0]
        if len(temperatures) != n or len(keys) != n:
            raise ValueError(f"sample: {n} rows need {n} temperatures and keys")
        lo, hi = self.vocab_start, self.vocab_start + self.vocab_local
        rows = []
        for i in range(n):
            if temperatures[i] == 0.0:
                rows.append(logprobs_shard[i])
            else:
                noise = gumbel_noise(keys[i], self.vocab)[lo:hi].to(logprobs_shard.device)
                rows.append(logprobs_shard[i] / temperatures[i] + noise)
        return self.greedy(torch.stack(rows))


@dataclass
class Segment:
    """One request's rows in one forward step: ``tokens`` at positions start.. of the request's KV cache.

    ``blocks``: the request's block table in its engine's paged KV cache (``new_cache()`` of the engine: a list of
    block ids in position order, which the engine's step grows to cover the rows; ``free_cache`` hands it back).
    ``sample``: the last row's logits produce the request's next token (a decode row, or the last chunk of
    its prompt)."""

    blocks: list[int]
    tokens: Sequence[int]
    start: int
    sample: bool = field(default=True)


def stage_segments(segments: Sequence[Segment], ids: np.ndarray, pos: np.ndarray, *,
                   max_context: int) -> tuple[list[int], int]:
    """Write one step's token ids and positions into the host arrays ``ids`` and ``pos`` (a fixed ``t_pad``-row
    buffer each), segments in order, filler rows token 0 at position 0. Returns each segment's first row and the
    real row count. What ``pack_segments`` and the engines' static step buffers (detcomm.numerics.step_graph) both
    lay out."""
    t_pad = ids.shape[0]
    rows = sum(len(s.tokens) for s in segments)
    if not 1 <= rows <= t_pad:
        raise ValueError(f"a step carries 1..T_pad={t_pad} rows, got {rows}")
    ids[:] = 0
    pos[:] = 0
    offsets, at = [], 0
    for s in segments:
        n = len(s.tokens)
        if s.start + n > max_context:
            raise ValueError(f"a request outgrew max_context={max_context}")
        ids[at : at + n] = list(s.tokens)
        pos[at : at + n] = np.arange(s.start, s.start + n)
        offsets.append(at)
        at += n
    return offsets, rows


def pack_segments(segments: Sequence[Segment], *, t_pad: int, max_context: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """Lay one step's segments out in a fixed ``t_pad``-row buffer, in order: the token ids and positions of
    every row (filler rows: token 0 at position 0), each segment's first row, and the real row count."""
    host = np.zeros((2, t_pad), dtype=np.int64)  # built on the host, moved in one copy
    offsets, rows = stage_segments(segments, host[0], host[1], max_context=max_context)
    dev = torch.from_numpy(host).to(device)
    return dev[0], dev[1], offsets, rows
