"""Where each tensor of a TP-invariant ``TPCausalLM`` shard lies in the checkpoint's whole tensors, and the
weight sync built on it: gather a trainer's shards into whole tensors (W_t ranks), cut them into an engine's
shards (W_s ranks), in memory.

``pieces(lm)`` lists every tensor the engine's forward computes with (the tree layout's column blocks, its
fp32 virtual shards of o_proj/down_proj and their whole biases, the vocabulary rows of the embedding and the
LM head's blocks, the replicated norms and MoE blocks) with its place: the whole tensor's name (transformers'
parameter names), the dimension it is cut along and the range, and whether the shard holds the slice
transposed (``detcomm.tp``'s [in, out] matrices). Gathering and cutting are copies only, so a synced engine
computes with exactly the trainer's bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Piece", "pieces", "gather_full", "load_full"]


@dataclass(frozen=True)
class Piece:
    """``name``'s whole tensor, cut along ``dim`` to [start, stop) (``dim`` None: the whole tensor), held
    transposed when ``transposed``."""

    name: str
    dim: int | None
    start: int = 0
    stop: int = 0
    transposed: bool = False

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """This piece of the whole tensor, as the shard holds it."""
        part = whole if self.dim is None else whole.narrow(self.dim, self.start, self.stop - self.start)
        return part.t() if self.transposed else part


def check_invariant(lm: Any) -> None:
    """ValueError unless ``lm`` runs the tree-order virtual layout with fused boundaries, its MoE blocks (if any)
    with every expert on every rank in slot order: the engine this package trains (docs/rl.md "What is
    supported")."""
    s = lm.shards
    if not (s.layout == "virtual" and s.shard_fold == "tree" and lm.fuse):
        raise ValueError("detcomm.rl trains the TP-size-invariant tree layout with fused boundaries: build the engine "
                         "with TPCausalLM(model, layout='virtual', virtual_shards=V, shard_fold='tree') under a bitwise "
                         "envelope (detcomm.init(numerics='rl-bitwise')) and no forced route")
    for b in s.moe_blocks:
        if b.hosted != tuple(range(b.placement.num_experts)):
            raise ValueError(f"detcomm.rl: {b.name} hosts experts {list(b.hosted)} of {b.placement.num_experts} on "
                             f"rank {s.rank}; the trainer trains every expert on every rank: build the engine "
                             "with ep=None (or EPConfig(placement=Placement.replicated(E, W)))")
        if b.combine_order != "slot":
            raise ValueError(f"detcomm.rl: {b.name} combines in rank order (the negative control): train with "
                             "EPConfig(combine_order='slot')")


def pieces(lm: Any) -> list[tuple[torch.Tensor, Piece]]:
    """Every tensor this rank's forward computes with, and its piece of the whole tensors, in one order on every
    rank. Local."""
    check_invariant(lm)
    s = lm.shards
    r, hd = s.rank, s.head_dim
    out: list[tuple[torch.Tensor, Piece]] = []

    def column(mod: Any, name: str, start: int) -> None:  # BlockColumnLinear: rows of the [out, in] weight
        at = start
        for j, w in enumerate(mod.blocks):
            out.append((w, Piece(f"{name}.weight", 0, at, at + w.shape[0])))
            if mod.biases is not None:
                out.append((mod.biases[j], Piece(f"{name}.bias", 0, at, at + w.shape[0])))
            at += w.shape[0]

    def row(mod: Any, name: str) -> None:  # detcomm.tp.RowParallelLinear, virtual: fp32 [K/V, N] of W^T
        layer = mod.layer
        kv = layer.in_features // layer.virtual_shards
        first = r * (layer.virtual_shards // layer.world)
        for j, w in enumerate(layer.weights):
            out.append((w, Piece(f"{name}.weight", 1, (first + j) * kv, (first + j + 1) * kv, transposed=True)))
        if mod.bias is not None:  # whole on every rank, added once after the sum
            out.append((mod.bias, Piece(f"{name}.bias", None)))

    def whole(mod: Any, name: str) -> None:
        out.append((mod.weight, Piece(f"{name}.weight", None)))

    e = lm.model.model.embed_tokens
    out.append((e.weight, Piece("model.embed_tokens.weight", 0, e.start, e.start + e.width)))
    for i, layer in enumerate(lm.layers):
        p, a, m = f"model.layers.{i}", layer.self_attn, layer.mlp
        whole(layer.input_layernorm, f"{p}.input_layernorm")
        column(a.q_proj, f"{p}.self_attn.q_proj", r * s.heads * hd)
        column(a.k_proj, f"{p}.self_attn.k_proj", r * s.kv_heads * hd)
        column(a.v_proj, f"{p}.self_attn.v_proj", r * s.kv_heads * hd)
        for qk in ("q_norm", "k_norm"):
            if hasattr(a, qk):
                whole(getattr(a, qk), f"{p}.self_attn.{qk}")
        row(a.o_proj, f"{p}.self_attn.o_proj")
        whole(layer.post_attention_layernorm, f"{p}.post_attention_layernorm")
        if m in s.moe_blocks:  # replicated on every rank (check_invariant): whole tensors
            out.append((m.router, Piece(f"{m.name}.gate.weight", None)))
            out.append((m.gate_up, Piece(f"{m.name}.experts.gate_up_proj", None)))
            out.append((m.down, Piece(f"{m.name}.experts.down_proj", None)))
            for mod, sub in ((m.shared_expert, "shared_expert"), (m.shared_expert_gate, "shared_expert_gate")):
                if mod is not None:
                    out += [(t, Piece(f"{m.name}.{sub}.{n}", None)) for n, t in mod.named_parameters()]
            continue
        column(m.gate_proj, f"{p}.mlp.gate_proj", r * s.ffn)
        column(m.up_proj, f"{p}.mlp.up_proj", r * s.ffn)
        row(m.down_proj, f"{p}.mlp.down_proj")
    whole(lm.model.model.norm, "model.norm")
    head = lm.model.lm_head.head
    for j, w in enumerate(head.weights):
        b = r * head.local_blocks + j
        out.append((w, Piece("lm_head.weight", 0, b * head.block, (b + 1) * head.block, transposed=True)))
    return out


def gather_full(lm: Any, *, grad: bool = False, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The whole tensors (transformers' names, on the CPU) from every rank's shards of ``lm`` (``grad``: of their
    gradients, after a backward): one all-gather of the pieces (data movement: the bits are the shards'). Collective
    over ``group``."""
    mine = []
    for t, p in pieces(lm):
        src = t.grad if grad else t
        assert src is not None, f"{p.name}: no gradient (gather_full(grad=True) runs after a backward)"
        mine.append((p, src.detach().cpu().clone()))
    world = dist.get_world_size(group)
    got: list[Any] = [None] * world
    dist.all_gather_object(got, mine, group=group)
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for rank_pieces in got:
        for p, t in rank_pieces:
            dtypes[p.name] = t.dtype
            whole = list(t.t().shape if p.transposed else t.shape)
            if p.dim is not None:
                shapes[p.name] = [max(a, b) for a, b in zip(shapes.get(p.name, whole), whole)]
                shapes[p.name][p.dim] = max(shapes[p.name][p.dim], p.stop)
            else:
                shapes[p.name] = whole
    full = {n: torch.empty(s, dtype=dtypes[n]) for n, s in shapes.items()}
    filled = {n: 0 for n in full}
    for rank_pieces in got:
        for p, t in rank_pieces:
            p.of(full[p.name]).copy_(t)
            filled[p.name] += t.numel()
    for n, t in full.items():  # every element written exactly once, or a replicated tensor written by every rank
        assert filled[n] in (t.numel(), t.numel() * world), (n, filled[n], t.numel())
    return full


@torch.no_grad()
def load_full(lm: Any, full: dict[str, torch.Tensor]) -> None:
    """Cut the whole tensors ``full`` (``gather_full``'s) into this rank's shards of ``lm``, in place (the
    weight sync's engine side; also the copies the probe's ``local_ops`` read). Local."""
    for t, p in pieces(lm):
        t.copy_(p.of(full[p.name]).to(t.dtype))
    for i, layer in enumerate(lm.layers):
        rows = [(layer.self_attn.o_proj, f"model.layers.{i}.self_attn.o_proj")]
        if layer.mlp not in lm.shards.moe_blocks:
            rows.append((layer.mlp.down_proj, f"model.layers.{i}.mlp.down_proj"))
        for mod, name in rows:
            k = mod.in_features
            mod.weight.copy_(full[f"{name}.weight"][:, lm.rank * k : (lm.rank + 1) * k])
    head = lm.model.lm_head
    head.weight.copy_(torch.cat(head.head.weights, dim=1).t())
