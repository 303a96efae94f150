"""Tensor-parallel replacements for the Linear and Embedding modules of a Hugging Face decoder.

Each module holds this rank's shard and is a drop-in ``nn.Module``: the transformers modeling code keeps
calling ``self.o_proj(x)``, ``self.mlp.down_proj(x)``, ``self.embed_tokens(ids)``, ``self.lm_head(h)``.
Every cross-rank sum goes through ``detcomm.all_reduce`` at a site named after the module's qualified name;
the vocabulary-parallel head's gather and argmax go through ``detcomm.all_gather`` / ``detcomm.argmax``.
Every ``forward`` is collective over the group.

``StepRows`` is the one piece of state the fixed-width engine shares with these modules: when its ``rows`` is
set, activations are padded buffers whose first ``rows`` rows are real, and only those are reduced (the
filler rows keep this rank's partial sums: they are never read). When it is None (transformers' own forward)
every row is reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import detcomm

from ..numerics import shard_gemm
from ..rl import regions

__all__ = ["StepRows", "column_shard", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
           "vocab_shard_width", "VOCAB_ALIGN", "BlockColumnLinear", "InvariantRowLinear", "BlockVocabHead"]

# The vocabulary shard width is padded to a multiple of this, so that a [T_pad, shard] fp32 or bf16 buffer
# never has a scalar remainder in torch's vectorized CPU loops (2 x 32 lanes covers AVX-512 bf16): every
# element then goes through the same exp/max code path whatever row it sits in.
VOCAB_ALIGN = 64


@dataclass
class StepRows:
    """How many leading rows of the current step's buffers are real (None: all of them)."""

    rows: int | None = None


def column_shard(linear: nn.Linear, start: int, stop: int) -> None:
    """Keep output features [start, stop) of ``linear`` (weight rows and bias entries), in place."""
    linear.weight = nn.Parameter(linear.weight.data[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ W_shard^T) + b``: input features [start, stop) of a Linear, the partial
    products summed over the ranks at detcomm site ``site``. The bias (unsharded) is added once, after the
    sum. Collective."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, *, site: str, step: StepRows) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.data[:, start:stop].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        self.in_features, self.out_features = stop - start, linear.out_features
        self.site = site
        self._step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = F.linear(x, self.weight)
        flat = part.reshape(-1, self.out_features)
        rows = flat.shape[0] if self._step.rows is None else self._step.rows
        summed = detcomm.all_reduce(flat[:rows].contiguous(), site=self.site)
        if rows == flat.shape[0]:
            out = summed
        else:
            out = flat.clone()
            out[:rows] = summed
        if self.bias is not None:
            out = out + self.bias
        return out.view(part.shape)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (shard), out_features={self.out_features}, site={self.site!r}"


def vocab_shard_width(vocab: int, world: int) -> int:
    """Rows of the embedding / LM head each rank holds: ceil(vocab / W) rounded up to ``VOCAB_ALIGN``.
    Raises ValueError when the last rank would hold no real entry."""
    width = _padded_width(vocab, world)
    if (world - 1) * width >= vocab:
        # Not "at most N ranks": the padding makes the bound non-monotonic (vocab 200: W = 4 works, W = 3 does
        # not), so name the sizes that work.
        works = [w for w in range(1, -(-vocab // VOCAB_ALIGN) + 1) if (w - 1) * _padded_width(vocab, w) < vocab]
        raise ValueError(
            f"vocabulary of {vocab} entries is too small for {world} ranks at shard width {width} (shards are "
            f"padded to multiples of {VOCAB_ALIGN}): the last rank would hold no real entry; run at a world size "
            f"that works for this vocabulary: W in {_ranges(works)}"
        )
    return width


def _padded_width(vocab: int, world: int) -> int:
    """ceil(vocab / world), rounded up to a multiple of ``VOCAB_ALIGN``."""
    width = -(-vocab // world)
    return -(-width // VOCAB_ALIGN) * VOCAB_ALIGN


def _ranges(ws: list[int]) -> str:
    """[1, 2, 3, 5, 7, 8] -> "{1-3, 5, 7-8}"."""
    parts: list[str] = []
    i = 0
    while i < len(ws):
        j = i
        while j + 1 < len(ws) and ws[j + 1] == ws[j] + 1:
            j += 1
        parts.append(str(ws[i]) if i == j else f"{ws[i]}-{ws[j]}")
        i = j + 1
    return "{" + ", ".join(parts) + "}"


def _vocab_rows(weight: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Rows [start, start + width) of a [vocab, hidden] table, zero rows past the vocabulary."""
    out = torch.zeros(width, weight.shape[1], dtype=weight.dtype, device=weight.device)
    real = max(0, min(width, weight.shape[0] - start))
    out[:real] = weight[start : start + real]
    return out


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, start + width) of the vocabulary: ids outside the shard look up +0.0, and the
    W partial rows are summed at site ``site`` (one nonzero addend per element: exact on every route).
    Collective."""

    def __init__(self, emb: nn.Embedding, start: int, width: int, *, site: str, step: StepRows) -> None:
        super().__init__()
        self.weight = nn.Parameter(_vocab_rows(emb.weight.data, start, width), requires_grad=False)
        self.start, self.width, self.embedding_dim = start, width, emb.embedding_dim
        self.site = site
        self._step = step

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.width)
        part = F.embedding(local.clamp(0, self.width - 1), self.weight).masked_fill(~inside[..., None], 0.0)
        flat = part.reshape(-1, self.embedding_dim)
        rows = flat.shape[0] if self._step.rows is None else self._step.rows
        out = flat.clone()
        out[:rows] = regions.reduce_from(flat[:rows], site=self.site)  # differentiable (detcomm.rl)
        return out.view(part.shape)

    def extra_repr(self) -> str:
        return f"vocab [{self.start}, {self.start + self.width}) of this rank, dim={self.embedding_dim}, site={self.site!r}"


class VocabParallelHead(nn.Module):
    """LM head rows [start, start + width) of the vocabulary (``vocab`` real entries in all).

    ``shard_logits`` gives this rank's fp32 logits, entries past the vocabulary at -inf (local, no
    communication). ``forward`` (what transformers' own forward calls) gathers the shards at site
    ``gather_site`` and returns the full [..., vocab] logits in the model dtype. Collective."""

    def __init__(self, head: nn.Linear, start: int, width: int, vocab: int, *, gather_site: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(_vocab_rows(head.weight.data, start, width), requires_grad=False)
        self.start, self.width, self.vocab = start, width, vocab
        self.real = max(0, min(width, vocab - start))
        self.gather_site = gather_site

    def shard_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.weight).to(torch.float32)
        if self.real < self.width:
            logits[..., self.real :] = float("-inf")
        return logits

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        part = F.linear(h, self.weight)
        flat = part.reshape(-1, self.width).contiguous()
        n = flat.shape[0]
        full = detcomm.all_gather(flat, site=self.gather_site)  # [W * n, width], rank order
        world = full.shape[0] // n
        full = full.view(world, n, self.width).transpose(0, 1).reshape(n, world * self.width)[:, : self.vocab]
        return full.reshape(*part.shape[:-1], self.vocab)

    def extra_repr(self) -> str:
        return f"vocab [{self.start}, {self.start + self.width}) of {self.vocab}, gather site={self.gather_site!r}"


# -- TP-size-invariant layouts (docs/spec.md §9.1 "TP-size invariance: layouts") ---------------------------


class BlockColumnLinear(nn.Module):
    """Output features [start, stop) of a Linear in fixed blocks of ``block`` features, one GEMM per block, so
    a feature's GEMM has the same shape at every W (detcomm.tp.ColumnParallelLinear for transformers' modules).
    On CUDA all blocks (and their biases) run in one fixed-config Triton launch whose tiles never straddle a block
    (detcomm.numerics.shard_gemm.block_gemm, autograd through BlockGemm); on CPU one F.linear per block.
    Local (no communication)."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, *, block: int) -> None:
        super().__init__()
        w = linear.weight.data
        b = linear.bias.data if linear.bias is not None else None
        self.blocks = nn.ParameterList(nn.Parameter(w[j : j + block].clone(), requires_grad=False)
                                       for j in range(start, stop, block))
        self.biases = (None if b is None else
                       nn.ParameterList(nn.Parameter(b[j : j + block].clone(), requires_grad=False)
                                        for j in range(start, stop, block)))
        self.in_features, self.out_features = linear.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            flat = x.reshape(-1, self.in_features)
            params = [*self.blocks, *(self.biases if self.biases is not None else ())]
            y = shard_gemm.BlockGemm.apply(flat, True, len(self.blocks), *params)
            return y.view(*x.shape[:-1], self.out_features)
        biases = [None] * len(self.blocks) if self.biases is None else list(self.biases)
        return torch.cat([F.linear(x, w, b) for w, b in zip(self.blocks, biases)], dim=-1)


class InvariantRowLinear(nn.Module):
    """o_proj / down_proj in a TP-size-invariant layout: ``detcomm.tp.RowParallelLinear`` ("virtual" with
    ``virtual_shards``, or "full_k" with ``blocks``) over input features [start, stop) of a Linear, the bias
    added once after. Only the step's real rows travel; filler rows come back as zeros. On CUDA the virtual
    layout's partials are detcomm.tp's one-launch kernel (detcomm.numerics.shard_gemm). Collective."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, *, site: str, step: StepRows, layout: str,
                 virtual_shards: int | None, blocks: int | None, max_rows: int, rank: int, world: int,
                 shard_fold: str = "order") -> None:
        super().__init__()
        from detcomm.tp import RowParallelLinear as TPRow

        self.layer = TPRow(linear.weight.data.t(), site=site, layout=layout, max_rows=max_rows,  # type: ignore[arg-type]
                           virtual_shards=virtual_shards, blocks=blocks, rank=rank, world=world,
                           device=linear.weight.device, shard_fold=shard_fold)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        self.in_features, self.out_features = stop - start, linear.out_features
        self.weight = nn.Parameter(linear.weight.data[:, start:stop].clone(), requires_grad=False)  # local_ops' GEMM
        self.site = site
        self._step = step

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        # .to(device/dtype) of the module also moves the detcomm.tp layer's plain tensors.
        self.layer.weights = [fn(w) for w in self.layer.weights]
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0] if self._step.rows is None else self._step.rows
        if self.layer.layout == "virtual":  # the layer's own call (its partials' all-reduce), with autograd (detcomm.rl)
            summed = regions.reduce_partials(self.layer.partials(flat, rows), site=self.layer.site)
        else:
            summed = self.layer(flat, rows)
        out = summed if rows == flat.shape[0] else torch.zeros(flat.shape[0], self.out_features, dtype=summed.dtype,
                                                              device=summed.device)
        if rows != flat.shape[0]:
            out[:rows] = summed
        if self.bias is not None:
            out = regions.add_bias(out, self.bias)  # out + bias; its gradient's row sum in a fixed order
        return out.view(*x.shape[:-1], self.out_features)


class BlockVocabHead(nn.Module):
    """The LM head in fixed vocabulary blocks (``detcomm.tp.VocabParallelHead``): ``shard_logits`` gives this
    rank's fp32 logits [..., vocab/W] (local); ``head`` computes logprobs, greedy and sampling over the blocks;
    ``forward`` (transformers' own forward) gathers the full logits at ``gather_site``. Collective."""

    def __init__(self, linear: nn.Linear, *, blocks: int, t_pad: int, site: str, gather_site: str, rank: int,
                 world: int) -> None:
        super().__init__()
        from detcomm.tp import VocabParallelHead as TPHead

        self.head = TPHead(linear.weight.data.t(), blocks=blocks, t_pad=t_pad, site=site, rank=rank, world=world,
                           device=linear.weight.device)
        self.vocab, self.gather_site = linear.out_features, gather_site
        self.width = self.vocab // world
        self.weight = nn.Parameter(torch.cat(self.head.weights, dim=1).t().contiguous(), requires_grad=False)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        self.head.weights = [fn(w) for w in self.head.weights]
        return super()._apply(fn, recurse)

    def shard_logits(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        return self.head.logits(flat).view(*h.shape[:-1], self.width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = self.shard_logits(h).reshape(-1, self.width).contiguous()
        n = flat.shape[0]
        full = detcomm.all_gather(flat, site=self.gather_site)
        world = full.shape[0] // n
        return full.view(world, n, self.width).transpose(0, 1).reshape(*h.shape[:-1], self.vocab)
