"""The engine's TP collectives as autograd functions: forward the canonical call, backward its conjugate.

Megatron's column/row-parallel regions: a row-parallel sum (the embedding's all-reduce, each layer boundary's
``detcomm.all_reduce_residual_rmsnorm``) is an all-reduce forward and the identity backward; a replicated
activation entering column-parallel compute (every decoder RMSNorm's output: the q/k/v and gate/up projections,
the LM head) is the identity forward and an all-reduce of its gradient backward (at ``GRAD_SITE``, a detcomm
site: the gradients' sums take a canonical route too). The vocabulary-parallel log-softmax of the chosen tokens
is the head's own ``logprobs`` forward and ``onehot - softmax`` on each rank's vocabulary shard backward. A
biased o_proj/down_proj keeps its own all-reduce (``reduce_partials``), the whole bias added once after it
(``add_bias``: its gradient a row sum in one fixed order) and the local add + norm (``add_norm``, no site). An
expert-parallel MoE block's dispatch, combine and gather (``moe_dispatch``, ``moe_combine``, ``gather_chunks``)
send the gradients back along the other direction's path; each rank's gradients are its chunk of rows' part.

Each forward is the exact call the serving engine makes, on the same operand objects (autograd is off inside
it), so its bits are the engine's; under ``torch.no_grad`` (serving) the functions are just those calls. The norms' backward
differentiates the plain fp32 RMSNorm formula (the canonical norm's value to rounding): the gradients are
deterministic, not bit-equal to any other implementation's. Collective (backward too: every rank runs the same
graph, so the gradient all-reduces come in one order).
"""

from __future__ import annotations

from typing import Any

import torch

import detcomm

from ..numerics.norm import add_rms_norm

__all__ = ["GRAD_SITE", "declare_grad_site", "reduce_from", "reduce_partials", "add_bias", "norm", "add_norm",
           "token_logprobs", "moe_dispatch", "moe_combine", "gather_chunks"]

# The all-reduce of a replicated activation's gradient (each rank holds the part its shards contributed).
GRAD_SITE = "rl.grad.hidden"


def declare_grad_site(*, hidden: int, dtype: torch.dtype, max_rows: int) -> None:
    """Declare ``GRAD_SITE`` (collective; once, before the first backward)."""
    detcomm.site(GRAD_SITE, collective="all_reduce", dtype=dtype, shape=(hidden,), max_rows=max_rows)


def _grad_sum(g: torch.Tensor) -> torch.Tensor:
    return detcomm.all_reduce(g.contiguous(), site=GRAD_SITE)


def _plain_norm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm formula in fp32, differentiated for the backward (transformers' LlamaRMSNorm's)."""
    r32 = r.to(torch.float32)
    return (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float32)).to(r.dtype)


def _norm_backward(r: torch.Tensor, weight: torch.Tensor, eps: float,
                   grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        rr, ww = r.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        gr, gw = torch.autograd.grad(_plain_norm(rr, ww, eps), (rr, ww), grad_y)
    return gr, gw


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, site: str) -> torch.Tensor:  # type: ignore[override]
        return detcomm.all_reduce(part.contiguous(), site=site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def reduce_from(part: torch.Tensor, *, site: str) -> torch.Tensor:
    """``detcomm.all_reduce(part, site=site)``; backward the identity (the sum's gradient is whole)."""
    out: torch.Tensor = _ReduceFrom.apply(part, site)
    return out


class _ReducePartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, parts: torch.Tensor, site: str) -> torch.Tensor:  # type: ignore[override]
        ctx.shape, ctx.dtype = parts.shape, parts.dtype
        return detcomm.all_reduce(parts, site=site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # every partial (the tree layout's slabs [V/W, rows, N]) reaches the sum unchanged
        g = grad.to(ctx.dtype)
        return (g.expand(ctx.shape) if len(ctx.shape) == 3 else g), None


def reduce_partials(parts: torch.Tensor, *, site: str) -> torch.Tensor:
    """``detcomm.all_reduce(parts, site=site)`` of a row-parallel layer's partials (``detcomm.tp.RowParallelLinear.
    partials``: [rows, N], or the virtual layout's fp32 slabs [V/W, rows, N]; contiguous), the exact call of the
    layer's own ``__call__``; backward: the sum's gradient to every partial. Collective in forward only."""
    out: torch.Tensor = _ReducePartials.apply(parts, site)
    return out


def _row_sum(g: torch.Tensor) -> torch.Tensor:
    """The sum over the rows of ``g`` [T, N] in one fixed order: fp32 from +0.0, rows 0, 1, .., T-1, one rounding
    per add (no torch reduction kernel picks the order); T is the engine's T_pad, whatever the batch."""
    acc = torch.zeros(g.shape[-1], dtype=torch.float32, device=g.device)
    for row in g.reshape(-1, g.shape[-1]).to(torch.float32):
        acc = acc + row
    return acc


class _AddBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.bias_dtype = bias.dtype
        return x + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return grad, _row_sum(grad).to(ctx.bias_dtype)


def add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + bias`` (a row-parallel projection's whole bias, added once after the sum: the engine's op); backward:
    the bias's gradient is ``_row_sum`` of x's (replicated, whole on every rank: every rank computes the same
    bits, at every W). Local."""
    out: torch.Tensor = _AddBias.apply(x, bias)
    return out


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h, weight)
        ctx.eps = eps
        return detcomm.rms_norm(h, weight, eps=eps)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        h, weight = ctx.saved_tensors
        gh, gw = _norm_backward(h, weight, ctx.eps, _grad_sum(grad_y))
        return gh, gw, None


def norm(h: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """``detcomm.rms_norm(h, weight, eps=eps)`` (the replicated output feeds column-parallel compute: backward
    all-reduces its gradient first). Collective in backward only."""
    out: torch.Tensor = _Norm.apply(h, weight, eps)
    return out


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,  # type: ignore[override]
                site: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        if site is None:
            y, r = add_rms_norm(x, residual, weight, eps=eps)
        else:
            y, r = detcomm.all_reduce_residual_rmsnorm(x, residual, weight, eps=eps, site=site)
        ctx.save_for_backward(r, weight)
        ctx.eps, ctx.x_shape, ctx.x_dtype = eps, x.shape, x.dtype
        return y, r

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, grad_r: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        r, weight = ctx.saved_tensors
        gr, gw = _norm_backward(r, weight, ctx.eps, _grad_sum(grad_y))
        g = grad_r + gr  # whole on every rank: r's gradient reaches every partial of its sum unchanged
        gx = g.to(ctx.x_dtype).expand(ctx.x_shape) if len(ctx.x_shape) == 3 else g.to(ctx.x_dtype)
        return gx, g, gw, None, None


def add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float,
             site: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``detcomm.all_reduce_residual_rmsnorm(x, residual, weight, eps=eps, site=site)`` -> (y, r). ``x``: this
    rank's part of the sum ([rows, H], or the tree layout's fp32 shard partials [V/W, rows, H]); ``site`` None:
    x is already the whole sum [rows, H] (a biased projection's output, an MoE block's), and the forward is the
    local ``detcomm.numerics.norm.add_rms_norm``. Backward: y's gradient all-reduced (it feeds column-parallel
    compute), then the norm's; x and the residual get r's whole gradient. Collective (with ``site`` None: in
    backward only)."""
    y, r = _AddNorm.apply(x, residual, weight, eps, site)
    return y, r


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, tokens: torch.Tensor, head: Any) -> torch.Tensor:  # type: ignore[override]
        full = head.logprobs(shard.contiguous())  # the engine's call: [n, vocab], every rank
        lp_shard = full[:, head.vocab_start : head.vocab_start + head.vocab_local]  # this rank's own shard
        ctx.save_for_backward(lp_shard, tokens)
        ctx.start = head.vocab_start
        n = shard.shape[0]
        return full[torch.arange(n, device=shard.device), tokens]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        lp_shard, tokens = ctx.saved_tensors
        g = -torch.exp(lp_shard) * grad[:, None]
        local = tokens - ctx.start
        mine = (local >= 0) & (local < lp_shard.shape[1])
        rows = torch.nonzero(mine).flatten()
        g[rows, local[rows]] += grad[rows]
        return g, None, None


def token_logprobs(shard: torch.Tensor, tokens: torch.Tensor, *, head: Any) -> torch.Tensor:
    """The fp32 logprob of ``tokens[i]`` under row i of this rank's logits ``shard`` [n, vocab/W], the bits of
    ``head.logprobs(shard)[i, tokens[i]]`` (``head``: the invariant layouts' ``detcomm.tp.VocabParallelHead``),
    identical on every rank. Backward: ``grad * (onehot - softmax)`` on this rank's shard. Collective."""
    out: torch.Tensor = _TokenLogprobs.apply(shard, tokens, head)
    return out


# -- expert-parallel MoE blocks (detcomm.hf.moe_block.EPMoEBlock) ---------------------------------------------
# A block's input is replicated; rank r dispatches only its chunk of the rows, so every gradient the block sends
# back (to its input, the router, the experts) is this rank's chunk's part: the input's parts are summed by the
# boundary norm's gradient all-reduce before the block (disjoint rows), the parameters' by the trainer
# (``detcomm.rl.trainer``: one all-reduce of the MoE blocks' gradients after the backward).


def _to_sources(rows: torch.Tensor, handle: Any, site: Any) -> torch.Tensor:
    """Rows in a dispatch's received order (the expert side) back to their source ranks, there [T * k, H] by
    flat slot t * k + j (+0.0 for slots sent nowhere): the return path of ``detcomm.moe.moe_combine``, at the
    block's combine site. Collective."""
    back = torch.empty_like(rows)
    back[handle.recv_order] = rows
    comm = detcomm.get_communicator(site.group)
    returned = comm.all_to_all(back.contiguous(), site.combine, splits=list(handle.recv_splits),
                               out_splits=list(handle.send_splits))
    slots = torch.zeros(handle.num_tokens * handle.top_k, rows.shape[1], dtype=rows.dtype, device=rows.device)
    slots[handle.send_pos] = returned
    return slots


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, ids: torch.Tensor, placement: Any, site: Any,  # type: ignore[override]
                token_ids: torch.Tensor, out: list[Any]) -> torch.Tensor:
        from ..moe import moe_dispatch

        d = moe_dispatch(tokens, ids, placement=placement, site=site, token_ids=token_ids)
        out.append(d)
        ctx.handle, ctx.site, ctx.dtype = d.handle, site, tokens.dtype
        return d.rows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        h = ctx.handle
        slots = _to_sources(grad.contiguous(), h, ctx.site).view(h.num_tokens, h.top_k, -1).to(torch.float32)
        acc = torch.zeros(h.num_tokens, slots.shape[2], dtype=torch.float32, device=grad.device)
        for j in range(h.top_k):  # a token's slots in slot order, fp32 from +0.0, one rounding at the end
            acc = acc + slots[:, j]
        return acc.to(ctx.dtype), None, None, None, None, None


def moe_dispatch(tokens: torch.Tensor, expert_ids: torch.Tensor, *, placement: Any, site: Any,
                 token_ids: torch.Tensor) -> Any:
    """``detcomm.moe.moe_dispatch(tokens, expert_ids, ...)`` (the same call) -> its ``MoEDispatch``, the rows with
    autograd; backward: each received row's gradient back to its source (the combine site's path), a token's
    slots summed in slot order. Collective (backward too)."""
    import dataclasses

    got: list[Any] = []
    rows = _Dispatch.apply(tokens, expert_ids, placement, site, token_ids, got)
    return dataclasses.replace(got[0], rows=rows)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, handle: Any,  # type: ignore[override]
                site: Any, grad_site: str) -> torch.Tensor:
        from ..moe import moe_combine

        ctx.save_for_backward(y, weights)
        ctx.handle, ctx.site, ctx.grad_site, ctx.shared = handle, site, grad_site, shared is not None
        return moe_combine(y, weights, handle, site=site, shared=shared)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        y, weights = ctx.saved_tensors
        h = ctx.handle
        g32 = grad.to(torch.float32)
        # the weights' gradient <grad_t, y_tj>: the expert outputs fetched back to the tokens' rank first
        y_slots = _to_sources(y.contiguous(), h, ctx.site).view(h.num_tokens, h.top_k, -1).to(torch.float32)
        gw = (g32[:, None, :] * y_slots).sum(-1).to(weights.dtype)
        # each slot's output gradient w_tj * grad_t, sent where the slot's row was served (the dispatch's path)
        g_slots = (weights.to(torch.float32)[:, :, None] * g32[:, None, :]).to(y.dtype).view(-1, y.shape[1])
        comm = detcomm.get_communicator(ctx.site.group)
        recv = comm.all_to_all(g_slots[h.send_pos].contiguous(), ctx.grad_site, splits=list(h.send_splits),
                               out_splits=list(h.recv_splits))
        gy = recv[h.recv_order]
        return gy, gw, (grad if ctx.shared else None), None, None, None


def moe_combine(y: torch.Tensor, weights: torch.Tensor, handle: Any, *, site: Any, grad_site: str,
                shared: torch.Tensor | None = None) -> torch.Tensor:
    """``detcomm.moe.moe_combine(y, weights, handle, site=site, shared=shared)`` (the same call, slot order);
    backward: the weights' gradient from the expert outputs brought back to this rank, the outputs' gradient
    ``w * grad`` sent to the serving ranks at ``grad_site`` (an all_to_all site of the block's width), the shared
    expert's ``grad``. Collective (backward too)."""
    out: torch.Tensor = _Combine.apply(y, weights, shared, handle, site, grad_site)
    return out


class _GatherChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, site: str, rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.rank, ctx.rows = rank, part.shape[0]
        return detcomm.all_gather(part, site=site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # the gathered rows' gradient is whole on every rank: this rank's chunk is its part's
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None, None


def gather_chunks(part: torch.Tensor, *, site: str, rank: int) -> torch.Tensor:
    """``detcomm.all_gather(part, site=site)`` of the ranks' equal chunks; backward: this rank's chunk of the
    (replicated) gradient. Collective in forward only."""
    out: torch.Tensor = _GatherChunks.apply(part, site, rank)
    return out
