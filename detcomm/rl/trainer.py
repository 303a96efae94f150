"""The trainer side: the serving engine's own forward with autograd, teacher-forced over whole sequences.

``Trainer(lm)`` takes a ``TPCausalLM`` in the tree-order virtual layout (``layout="virtual", shard_fold="tree"``:
the same bits at every W that is a power of two dividing V) and makes the tensors its forward computes with
trainable (``detcomm.rl.reshard.pieces``). ``token_logprobs`` packs every sequence's rows into the engine's
T_pad-row steps (pieces of a long sequence in successive steps, their keys and values in the trainer's own KV
store, which autograd follows) and runs ``lm.forward(segments, grad=True, kv=...)``: the engine's step, its collectives ``detcomm.rl.regions``' autograd functions.
A token's logprob is the head's vocabulary-parallel log-softmax of the row before it: the engine's sampling-time
value, bit for bit, at another W. ``step(loss)`` is the backward (gradient sums at detcomm sites) and an AdamW step
on this rank's shards; ``full_weights`` gathers them for the weight sync (``detcomm.rl.reshard``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import detcomm

from ..hf.engine import StepLogits
from ..numerics.attention import PagedKVCache, StepKV, paged_attention, step_rows
from ..tp import Segment
from . import regions
from .reshard import gather_full, pieces

__all__ = ["Trainer", "teacher_forced"]

_HEAD_NORM_SITE = "rl.grad.head_norms"
_MOE_SITE = "rl.grad.moe"


class _ServedAttention(torch.autograd.Function):
    """The paged attention of a non-differentiable impl (the Triton kernel CUDA serves with) with a gradient:
    forward is that impl, so the trainer's logprobs are the rollout's bits; backward is the gradient of the torch
    impl (the same contract, other roundings) recomputed at the same inputs, which autograd can follow. The
    gradient is that of a function a few ulp from the one forward evaluated: within the trainer's gradient bound,
    and deterministic (the torch impl's reduction order is fixed per row)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepKV, scale: float,  # type: ignore[override]
                window: int | None, impl: str) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.step, ctx.scale, ctx.window = step, scale, window
        return paged_attention(q, PagedKVCache(k, v), 0, block_tables=step.block_tables, row_request=step.row_request,
                               positions=step.positions, scale=scale, window=window, impl=impl)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        step = ctx.step
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
            out = paged_attention(q, PagedKVCache(k, v), 0, block_tables=step.block_tables,
                                  row_request=step.row_request, positions=step.positions, scale=ctx.scale,
                                  window=ctx.window, impl="torch")
            gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
        return gq, gk, gv, None, None, None, None


def _reaches(node: Any, cls: type) -> bool:
    """Whether the autograd graph from ``node`` has a node of class ``cls``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, cls):
            return True
        todo.extend(f for f, _ in n.next_functions)
    return False


def _check_local_boundaries(lm: Any) -> None:
    """A boundary after a biased o_proj/down_proj or an MoE block is the engine's local add + norm
    (``TPCausalLM._add_norm`` with no site): its normed output feeds column-parallel compute, so its gradient must be all-reduced in backward
    (``regions.add_norm`` with ``site=None``). An engine whose local boundary bypasses it would give each rank only
    its own heads' part of the gradient: refused, with the fix. Local (the check is one row's local add + norm)."""
    def local(layer: Any) -> bool:  # a boundary of the local add + norm: after a biased projection, an MoE block
        down = getattr(layer.mlp, "down_proj", None)
        return (layer.self_attn.o_proj.bias is not None or layer.mlp in lm.shards.moe_blocks
                or getattr(down, "bias", None) is not None)

    if not any(local(layer) for layer in lm.layers):
        return
    hidden = lm.config.hidden_size
    with torch.enable_grad():
        x = torch.zeros(1, hidden, dtype=lm.dtype, device=lm.device, requires_grad=True)
        _, normed = lm._add_norm(x, torch.zeros(1, hidden, dtype=lm.dtype, device=lm.device),
                                 lm.layers[0].post_attention_layernorm, 1, site=None)
    if not _reaches(normed.grad_fn, regions._AddNorm._backward_cls):  # type: ignore[attr-defined]
        raise ValueError("detcomm.rl: this engine's boundary after a biased o_proj/down_proj or an MoE block runs the "
                         "local add + norm "
                         "outside detcomm.rl.regions, so its gradient would miss the other ranks' part: "
                         "TPCausalLM._add_norm must call regions.add_norm(..., site=None) for the local case "
                         "(detcomm/hf/engine.py); until then train a dense checkpoint with bias-free o_proj/down_proj")


@dataclass(frozen=True)
class _TrainStep(StepKV):
    """A step of the trainer's store: the engine's StepKV fields, and per segment its history, span and blocks."""

    history: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


class _Table(list):  # type: ignore[type-arg]  # a list[int]: Segment.blocks, the KVStore protocol's table
    """A sequence's table in the trainer's KV store: an (always empty) block table, and the sequence's history,
    per layer the (keys, values) of its pieces in position order. The history hangs on the table object itself
    (not in a map keyed by ``id(table)``, which a new table may reuse once an old one is freed), so two
    sequences' histories never mix; ``store``: the store that made it."""

    __slots__ = ("store", "history")

    def __init__(self, store: _TrainKV, layers: int) -> None:
        super().__init__()
        self.store = store
        self.history: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]


class _TrainKV:
    """The trainer's KV store (``detcomm.numerics.attention.KVStore``): each sequence's keys and values kept as
    the tensors its steps computed (autograd follows them into later pieces of a long sequence), laid out per step
    and layer into fresh blocks holding only the step's sequences. The engine's paged cache is written in place,
    which autograd refuses once an earlier step's attention saved it; and a row's attention bits follow neither the
    block ids nor the cache's size nor what unused slots hold (docs/spec.md §9.1), so the engine's bits stay.

    A table (``new_table``, a ``_Table``) names a sequence here and holds its history itself; the trainer feeds
    each one's pieces in position order."""

    def __init__(self, lm: Any, *, grad: bool) -> None:
        kv = lm.kv
        self.impl, self.block_size, self.max_blocks, self.blocks_for = kv.impl, kv.block_size, kv.max_blocks, kv.blocks_for
        self.device = lm.device
        self._layers = len(lm.layers)

    def new_table(self) -> _Table:
        return _Table(self, self._layers)

    def step(self, tables: Sequence[list[int]], spans: Sequence[tuple[int, int]]) -> _TrainStep:
        bt = torch.zeros(len(tables), self.max_blocks, dtype=torch.long)
        first = 0
        blocks = []
        for i, (start, n) in enumerate(spans):
            nb = self.blocks_for(start + n)
            bt[i, :nb] = torch.arange(first, first + nb)
            blocks.append(nb)
            first += nb
        req, pos = step_rows(spans)
        histories = []
        for t in tables:
            assert isinstance(t, _Table) and t.store is self, "a table of this store (new_table())"
            histories.append(t.history)
        return _TrainStep(bt.to(self.device), req.to(self.device), pos.to(self.device), histories, list(spans),
                          blocks)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepKV, *,
               scale: float, window: int | None) -> torch.Tensor:
        assert isinstance(step, _TrainStep), "a step of this store (step())"
        bs = self.block_size
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        at = 0
        for hist, (start, n), nb in zip(step.history, step.spans, step.blocks):
            mine = hist[layer]
            assert sum(c[0].shape[0] for c in mine) == start, "a sequence's pieces arrive in position order"
            mine.append((k[at : at + n], v[at : at + n]))
            at += n
            pad = nb * bs - (start + n)
            for out, j in ((ks, 0), (vs, 1)):
                rows = [c[j] for c in mine]
                if pad:
                    rows.append(rows[0].new_zeros(pad, *rows[0].shape[1:]))
                out.append(torch.cat(rows).view(nb, bs, *rows[0].shape[1:]))
        kc, vc = torch.cat(ks)[None], torch.cat(vs)[None]
        if self.impl != "torch" and torch.is_grad_enabled():  # an impl without autograd: the torch impl's gradient
            served: torch.Tensor = _ServedAttention.apply(q, kc, vc, step, scale, window, self.impl)
            return served
        return paged_attention(q, PagedKVCache(kc, vc), 0, block_tables=step.block_tables,
                               row_request=step.row_request, positions=step.positions, scale=scale, window=window,
                               impl=self.impl)


def teacher_forced(lm: Any, sequences: Sequence[Sequence[int]], starts: Sequence[int], *,
                   grad: bool) -> list[torch.Tensor]:
    """For each sequence, the fp32 logprobs of its tokens ``starts[i]``.. (each given the tokens before it),
    [len - starts[i]] per sequence, from ``lm``'s own steps (``grad``: with autograd, the tree layout; without,
    any layout: what the gate's negative control recomputes). Collective (same arguments on every rank)."""
    t_pad = lm.cfg.t_pad
    if len(sequences) != len(starts):
        raise ValueError(f"{len(sequences)} sequences need as many starts, got {len(starts)}")
    for seq, st in zip(sequences, starts):
        if not 1 <= st < len(seq) or len(seq) > lm.cfg.max_context:
            raise ValueError(f"a sequence of {len(seq)} tokens scored from {st} needs 1 <= start < length <= "
                             f"max_context={lm.cfg.max_context}")
    kv = _TrainKV(lm, grad=grad)
    caches = [kv.new_table() for _ in sequences]
    fed = [0] * len(sequences)  # rows fed: positions 0 .. len - 2 (the last token predicts nothing)
    got: list[list[torch.Tensor]] = [[] for _ in sequences]
    i = 0
    while i < len(sequences):
        segs: list[tuple[int, Segment]] = []
        budget = t_pad
        while i < len(sequences) and budget:
            seq = sequences[i]
            n = min(budget, len(seq) - 1 - fed[i])
            segs.append((i, Segment(caches[i], list(seq[fed[i] : fed[i] + n]), fed[i], sample=False)))
            fed[i] += n
            budget -= n
            if fed[i] == len(seq) - 1:
                i += 1
        logits, _ = lm.forward([s for _, s in segs], grad=grad, kv=kv)
        rows, targets, owners = [], [], []
        at = 0
        for k, seg in segs:
            for j in range(len(seg.tokens)):  # row at position p predicts token p + 1
                if seg.start + j + 1 >= starts[k]:
                    rows.append(at + j)
                    targets.append(sequences[k][seg.start + j + 1])
                    owners.append(k)
            at += len(seg.tokens)
        if not rows:
            continue
        idx = torch.tensor(rows, dtype=torch.long, device=lm.device)
        tgt = torch.tensor(targets, dtype=torch.long, device=lm.device)
        if grad:
            lp = regions.token_logprobs(logits.buf[idx], tgt, head=lm.model.lm_head.head)
        else:  # the engine's own head (any layout), as at sampling time
            lp = lm.logprobs(StepLogits(logits.buf, idx))[torch.arange(len(rows), device=lm.device), tgt]
        for j, k in enumerate(owners):
            got[k].append(lp[j : j + 1])
    return [torch.cat(g) for g in got]


class Trainer:
    """Autograd and AdamW on this rank's shards of ``lm`` (a ``detcomm.hf.TPCausalLM``, tree layout). Construct on
    every rank (collective: declares the gradient site); ``lr``, ``betas``, ``eps``, ``weight_decay``: AdamW's."""

    def __init__(self, lm: Any, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        self.lm = lm
        self.params = [t for t, _ in pieces(lm)]  # refuses what the trainer cannot train, before any probe
        _check_local_boundaries(lm)
        for t in self.params:
            t.requires_grad_(True)
        regions.declare_grad_site(hidden=lm.config.hidden_size, dtype=lm.dtype, max_rows=lm.cfg.t_pad)
        # Qwen3's per-head q/k norms: replicated weights applied to this rank's heads only, so each rank's gradient
        # is its heads' part of the sum (one all-reduce of all of them after the backward).
        self.head_norms = [getattr(layer.self_attn, n).weight for layer in lm.layers for n in ("q_norm", "k_norm")
                           if hasattr(layer.self_attn, n)]
        if self.head_norms:
            detcomm.site(_HEAD_NORM_SITE, collective="all_reduce", dtype=lm.dtype, shape=(lm.shards.head_dim,),
                         max_rows=len(self.head_norms))
        # MoE blocks: each rank's gradients of the router, the experts and a shared expert are its chunk of the
        # rows' part (detcomm.rl.regions), summed over the ranks in one all-reduce after the backward.
        self.moe_params = [t for b in lm.shards.moe_blocks for t in (b.router, b.gate_up, b.down)
                           + tuple(p for mod in (b.shared_expert, b.shared_expert_gate) if mod is not None
                                   for p in mod.parameters())]
        for b in lm.shards.moe_blocks:
            b.declare_grad(dtype=lm.dtype, max_rows=lm.cfg.t_pad)
        if self.moe_params:
            detcomm.site(_MOE_SITE, collective="all_reduce", dtype=lm.dtype,
                         shape=(sum(t.numel() for t in self.moe_params),), max_rows=1)
        # foreach=False: one elementwise loop per tensor, the same arithmetic whatever the tensor list's shapes.
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                     foreach=False)

    def token_logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[torch.Tensor]:
        """For each sequence, the fp32 logprobs of its tokens ``starts[i]``.. (each given the tokens before it),
        with autograd: [len - starts[i]] per sequence. Collective (same arguments on every rank)."""
        return teacher_forced(self.lm, sequences, starts, grad=True)

    def backward(self, loss: torch.Tensor) -> None:
        """This rank's shards' gradients of ``loss`` (the same scalar graph on every rank; earlier gradients
        dropped). Collective (the conjugate all-reduces)."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.head_norms:
            summed = detcomm.all_reduce(torch.stack([w.grad for w in self.head_norms]), site=_HEAD_NORM_SITE)
            for w, g in zip(self.head_norms, summed):
                w.grad = g.clone()
        if self.moe_params:
            flat = torch.cat([(torch.zeros_like(t) if t.grad is None else t.grad).reshape(-1) for t in self.moe_params])
            summed = detcomm.all_reduce(flat[None], site=_MOE_SITE)[0]
            at = 0
            for t in self.moe_params:
                t.grad = summed[at : at + t.numel()].view(t.shape).clone()
                at += t.numel()
        if getattr(self.lm.config, "tie_word_embeddings", False):
            self._tie_gradients()

    def step(self, loss: torch.Tensor) -> None:
        """``backward(loss)`` and one AdamW step on this rank's shards. Collective."""
        self.backward(loss)
        self.opt.step()

    def _tie_gradients(self) -> None:
        """A tied checkpoint's embedding and LM head are one tensor; the engine holds this rank's vocabulary rows of
        it twice (the embedding's rows, the head's blocks of the same rows, transposed). Both copies get the sum of
        the two uses' gradients (embedding + head, in that order), so AdamW keeps them bit-identical."""
        emb = self.lm.model.model.embed_tokens.weight
        blocks = self.lm.model.lm_head.head.weights
        g = emb.grad + torch.cat([b.grad for b in blocks], dim=1).t()
        emb.grad = g
        at = 0
        for b in blocks:
            b.grad = g[at : at + b.shape[1]].t().contiguous()
            at += b.shape[1]

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole tensors of the trained model (transformers' names, CPU), for ``detcomm.rl.reshard.load_full``
        on an engine at any W. Collective."""
        return gather_full(self.lm)
