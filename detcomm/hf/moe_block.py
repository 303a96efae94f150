"""Expert-parallel sparse MoE blocks for transformers' Mixtral, Qwen2-MoE and Qwen3-MoE (docs/spec.md §9.5).

``shard_model`` replaces each sparse MoE block that transformers built (``layer.mlp``; Mixtral's
``block_sparse_moe`` in transformers 4.x) by an ``EPMoEBlock`` holding this rank's experts of a
``detcomm.moe.Placement``. Attention stays tensor-parallel as for the dense families; the block's input, the
post-attention-norm hidden states, is therefore the same on every rank. One call of the block:

1. **Router, replicated.** Every rank computes the gating of every row of the step's fixed-width buffer with
   the same bits (``route``, the transformers routers' arithmetic, stated there).
2. **Shared expert, replicated** (Qwen2-MoE): ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` through
   transformers' own modules, in the model dtype, on the whole buffer.
3. **Dispatch.** The real rows are split in W contiguous chunks of ceil(rows / W); rank r dispatches chunk r
   (``detcomm.moe_dispatch``, replica key = the row's index in the step) to the ranks hosting the slots' experts.
4. **Experts.** Each rank runs its hosted experts with ``run_experts_blocked`` (fixed blocks of
   ``EPConfig.block`` rows, the last one zero-padded): transformers' expert MLP arithmetic
   ``down(act(gate(x)) * up(x))`` with the checkpoint's weights, at one shape whatever the batch.
5. **Combine.** ``detcomm.moe_combine`` returns the outputs to the chunk's rank and folds each row's slots in
   slot order (topk order) in fp32, the shared expert's output as the last term (weight 1), one rounding.
6. **Re-replicate.** The chunks are all-gathered in rank order (data movement) at site ``<block>.gather``.

So a row's output is a pure function of the row and the checkpoint, not of its co-batch, its offset, the placement,
the replicas or W. transformers' own block differs: it adds the weighted expert outputs in expert-index order in the
model dtype (one rounding per expert), then the shared expert's output (one more); here the slots are folded in topk
order in fp32, one rounding: the two agree to rounding, not bitwise (bf16 especially).

Sites per MoE block (named after the block, e.g. ``model.layers.3.mlp``): ``.dispatch`` and ``.combine``
(all_to_all), ``.gather`` (all_gather), ``max_rows`` from the step width ``T_pad``. transformers' own
``model(input_ids)`` also runs on the sharded model with transformers >= 5 (4.x's blocks return (hidden,
router_logits): there only ``TPCausalLM``'s step loop runs them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import detcomm
from detcomm.moe import COMBINE_ORDERS, MoESite, Placement, moe_combine, moe_dispatch, moe_site, run_experts_blocked

from ..rl import regions
from .layers import StepRows

__all__ = ["MOE_FAMILIES", "EPConfig", "EPMoEBlock", "moe_block_of", "dense_ffn_width", "route",
           "router_spec", "num_experts"]

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class EPConfig:
    """How the experts are spread: ``placement`` (None: every expert on every rank), ``block`` rows per expert
    GEMM (the fixed shape), ``combine_order`` ("slot"; "rank" is the negative control, ``numerics="auto"``
    only). One placement serves every MoE layer."""

    placement: Placement | None = None
    block: int = 64
    combine_order: str = "slot"

    def check(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"EPConfig.block must be a positive int, got {self.block!r}")
        if self.combine_order not in COMBINE_ORDERS:
            raise ValueError(f"EPConfig.combine_order must be one of {COMBINE_ORDERS}, got {self.combine_order!r}")
        if self.placement is not None and not isinstance(self.placement, Placement):
            raise TypeError(f"EPConfig.placement must be a detcomm.moe.Placement, got {type(self.placement).__name__}")


def num_experts(config: Any) -> int:
    """The routed experts of an MoE config (Mixtral: ``num_local_experts``; Qwen: ``num_experts``)."""
    return int(config.num_local_experts if config.model_type == "mixtral" else config.num_experts)


def dense_ffn_width(config: Any) -> int | None:
    """``intermediate_size`` when some layer has a dense MLP (tensor-parallel as in the dense families), None
    when every layer is a sparse MoE block (Mixtral; Qwen-MoE with no ``mlp_only_layers`` and sparse step 1)."""
    if config.model_type not in MOE_FAMILIES:
        return int(config.intermediate_size)
    if config.model_type == "mixtral":
        return None
    dense = bool(getattr(config, "mlp_only_layers", None)) or getattr(config, "decoder_sparse_step", 1) != 1
    return int(config.intermediate_size) if dense else None


def moe_block_of(layer: Any) -> tuple[str, Any] | None:
    """(attribute, module) of a decoder layer's sparse MoE block, or None for a dense MLP."""
    for attr in ("mlp", "block_sparse_moe"):
        m = getattr(layer, attr, None)
        if m is not None and hasattr(m, "experts") and hasattr(m, "gate"):
            return attr, m
    return None


def router_spec(block: Any, family: str, dtype: torch.dtype) -> tuple[int, bool, torch.dtype]:
    """(top_k, renormalize, weights dtype) of a transformers sparse MoE block, as its own router computes them:
    Mixtral always renormalizes; Qwen2/Qwen3-MoE when ``norm_topk_prob``. The weights are cast to the model
    dtype, except Mixtral's router module in transformers >= 5, which returns them in fp32 (in 4.x the block
    casts them, and its ``gate`` is a plain Linear)."""
    top_k = int(getattr(block, "top_k", None) or block.gate.top_k)  # 4.x: on the block; 5.x: on the router
    if family == "mixtral":
        return top_k, True, (dtype if isinstance(block.gate, nn.Linear) else torch.float32)
    norm = getattr(block, "norm_topk_prob", None)
    if norm is None:
        norm = block.gate.norm_topk_prob
    return top_k, bool(norm), dtype


def route(x: torch.Tensor, weight: torch.Tensor, *, top_k: int, renormalize: bool,
          weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The gating, row by row (what transformers' routers compute): ``logits = x @ weight^T`` in the model
    dtype; ``p = softmax(fp32(logits))`` over the experts; the k largest (``torch.topk``: largest first, which
    is the slot order); divided by their fp32 sum when ``renormalize``; cast to ``weights_dtype``. Returns
    (expert ids [T, k] int64, weights [T, k]). Local; row-invariant at a fixed row count."""
    logits = F.linear(x, weight)
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top.to(weights_dtype)


def _expert_weights(experts: Any, e: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Expert e's ([2I, H] gate and up rows stacked, [H, I] down, activation) in either transformers layout."""
    if hasattr(experts, "gate_up_proj"):  # transformers >= 5: [E, 2I, H] and [E, H, I] tensors
        return experts.gate_up_proj.data[e], experts.down_proj.data[e], experts.act_fn
    m = experts[e]  # transformers 4.x: a ModuleList of MLPs
    if hasattr(m, "w1"):  # Mixtral: w1 gate, w3 up, w2 down
        return torch.cat([m.w1.weight.data, m.w3.weight.data]), m.w2.weight.data, m.act_fn
    return torch.cat([m.gate_proj.weight.data, m.up_proj.weight.data]), m.down_proj.weight.data, m.act_fn


def expert_ffn(experts: Any) -> int:
    """The FFN width of every expert (all experts of a block have one), in either transformers layout."""
    if hasattr(experts, "gate_up_proj"):  # transformers >= 5: [E, 2I, H]
        return int(experts.gate_up_proj.shape[1]) // 2
    m = experts[0]
    return int((m.w2 if hasattr(m, "w2") else m.down_proj).weight.shape[1])


class EPMoEBlock(nn.Module):
    """This rank's part of one sparse MoE block (module docstring). ``forward(x)`` takes [..., H] and returns
    the block's output, the same on every rank. Collective (dispatch, combine, gather)."""

    def __init__(self, block: Any, *, name: str, family: str, ep: EPConfig, rank: int, world: int,
                 step: StepRows) -> None:
        super().__init__()
        gate_weight = block.gate.weight.data
        e_count, hidden = gate_weight.shape
        placement = ep.placement or Placement.replicated(e_count, world)
        if placement.num_experts != e_count or placement.world_size != world:
            raise ValueError(f"{name}: the placement is for {placement.num_experts} experts over "
                             f"{placement.world_size} ranks; the block has {e_count} experts and the group {world}")
        resolved = detcomm.get_communicator().resolved
        if ep.combine_order == "rank" and resolved.bitwise:  # refused here, before any step, on every rank
            raise ValueError(f"{name}: combine_order='rank' sums per-rank partials, whose bits move with the placement "
                             f"and the batch; numerics={resolved.numerics!r} refuses it. Use combine_order='slot', "
                             "or numerics='auto' for the negative control")
        self.name, self.rank, self.world, self.hidden = name, rank, world, hidden
        self.placement, self.block, self.combine_order = placement, ep.block, ep.combine_order
        self.top_k, self.renormalize, self.weights_dtype = router_spec(block, family, gate_weight.dtype)
        self.router = nn.Parameter(gate_weight.clone(), requires_grad=False)
        self.hosted = placement.experts_on(rank)
        self._slot = {e: i for i, e in enumerate(self.hosted)}
        ups, downs = [], []
        act = None
        for e in self.hosted:
            up, down, act = _expert_weights(block.experts, e)
            ups.append(up)
            downs.append(down)
        self.act: Any = act
        ffn = None if not ups else downs[0].shape[1]
        self.gate_up = nn.Parameter(torch.stack(ups) if ups else gate_weight.new_zeros(0, 0, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.stack(downs) if downs else gate_weight.new_zeros(0, hidden, 0), requires_grad=False)
        self.ffn = ffn
        # Every expert's width, hosted here or not: each checkpoint tensor's shape is checked on every rank
        # (detcomm.hf.sliced), so the verdict does not depend on which experts a rank hosts.
        self.expert_ffn = expert_ffn(block.experts)
        self.shared_expert: Any = getattr(block, "shared_expert", None)  # transformers' own modules, replicated
        self.shared_expert_gate: Any = getattr(block, "shared_expert_gate", None)
        self.sites = MoESite(name, f"{name}.dispatch", f"{name}.combine")  # what moe_site(name) declares
        self._step = step

    def chunk(self, rows: int) -> int:
        """Rows per rank's chunk of a step with ``rows`` real rows."""
        return -(-rows // self.world)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Hosted expert e on a [block, H] input: ``down(act(gate(x)) * up(x))`` (transformers' expert MLP)."""
        i = self._slot[e]
        gate, up = F.linear(x, self.gate_up[i]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down[i])

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The gated shared expert's output in the model dtype (transformers' own modules), or None."""
        if self.shared_expert is None:
            return None
        return F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.hidden)
        n = flat.shape[0]
        rows = n if self._step.rows is None else self._step.rows
        ids, weights = route(flat, self.router, top_k=self.top_k, renormalize=self.renormalize,
                             weights_dtype=self.weights_dtype)  # on the whole fixed-width buffer
        shared = self.shared(flat)
        per = self.chunk(rows)
        lo, hi = min(self.rank * per, rows), min((self.rank + 1) * per, rows)
        token_ids = torch.arange(lo, hi, device=flat.device)
        chunk_shared = None if shared is None else shared[lo:hi].contiguous()
        if self.combine_order == "slot":  # the same calls, with autograd (detcomm.rl.regions: the trainer)
            d = regions.moe_dispatch(flat[lo:hi].contiguous(), ids[lo:hi].contiguous(), placement=self.placement,
                                     site=self.sites, token_ids=token_ids)
            y = run_experts_blocked(d.rows, d.expert_ids, self.expert, block=self.block)
            mine = regions.moe_combine(y, weights[lo:hi].contiguous(), d.handle, site=self.sites,
                                       grad_site=self.grad_site, shared=chunk_shared)
        else:  # the rank-order negative control (numerics="auto"): serving only
            d = moe_dispatch(flat[lo:hi].contiguous(), ids[lo:hi].contiguous(), placement=self.placement,
                             site=self.sites, token_ids=token_ids)
            y = run_experts_blocked(d.rows, d.expert_ids, self.expert, block=self.block)
            mine = moe_combine(y, weights[lo:hi].contiguous(), d.handle, site=self.sites, shared=chunk_shared,
                               combine_order=self.combine_order)
        part = flat.new_zeros(per, self.hidden)
        part[: hi - lo] = mine
        full = regions.gather_chunks(part, site=self.sites_gather, rank=self.rank)  # [W * per, H], row order
        out = torch.zeros_like(flat)
        out[:rows] = full[:rows]
        return out.view(x.shape)

    @property
    def sites_gather(self) -> str:
        return f"{self.name}.gather"

    @property
    def grad_site(self) -> str:
        """The backward's all_to_all of the expert outputs' gradients (declared by ``declare_grad``)."""
        return f"{self.name}.grad"

    def declare_grad(self, *, dtype: torch.dtype, max_rows: int) -> None:
        """Declare ``grad_site`` for steps of at most ``max_rows`` rows (the trainer, detcomm.rl). Collective."""
        sent = self.chunk(max_rows) * self.top_k
        detcomm.site(self.grad_site, collective="all_to_all", dtype=dtype, shape=(self.hidden,),
                     max_rows=self.world * sent)

    def declare(self, *, dtype: torch.dtype, max_rows: int) -> None:
        """Declare the block's three sites for steps of at most ``max_rows`` rows. Collective."""
        per = self.chunk(max_rows)
        moe_site(self.name, dtype=dtype, hidden=self.hidden, top_k=self.top_k, max_tokens=per)
        detcomm.site(self.sites_gather, collective="all_gather", dtype=dtype, shape=(self.hidden,), max_rows=per)

    def local_ops(self) -> list[tuple[Any, int]]:
        """The router's and the shared expert's GEMMs (row-wise, run on the step's whole buffer)."""
        ops: list[tuple[Any, int]] = [(lambda x: F.linear(x, self.router), self.hidden)]
        if self.shared_expert is not None:
            ops.append((self.shared, self.hidden))
        return ops

    def expert_ops(self) -> list[tuple[Any, int]]:
        """Each hosted expert as a row-wise op on [block, H] inputs."""
        return [(lambda x, e=e: self.expert(e, x), self.hidden) for e in self.hosted]

    def extra_repr(self) -> str:
        return (f"{self.name}: experts {list(self.hosted)} of {self.placement.num_experts} on rank {self.rank}, "
                f"top_k={self.top_k}, renormalize={self.renormalize}, block={self.block}, "
                f"combine={self.combine_order}")

