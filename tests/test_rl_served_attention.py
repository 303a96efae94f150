"""The trainer's attention over an impl without autograd (``detcomm.rl.trainer._ServedAttention``: the Triton kernel
CUDA serves with): forward is that impl's bits, backward the torch impl's gradient at the same inputs. On CPU the
served impl is played by the torch impl itself, so both sides are known exactly: the forward bits equal a direct
call, and the gradients of q, K and V equal autograd through the torch impl bit for bit (the wiring: which
gradient goes to which input, both requests' blocks reached). Negative control: a backward that hands K's gradient
to V and V's to K is caught. The Triton
case itself runs in tests/gpu/test_rl_gpu.py (logprobs bit-equal to the rollout, gradients within the fp64 bound).
"""

from __future__ import annotations

import math

import torch

from detcomm.numerics.attention import PagedKVCache, StepKV, paged_attention
from detcomm.rl.trainer import _ServedAttention

BS, KVH, GROUP, HD = 16, 2, 2, 8


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepKV]:
    g = torch.Generator().manual_seed(5)
    spans = [(0, 20), (0, 7)]  # two sequences: 20 rows over two blocks, 7 rows in one
    q = torch.randn(27, KVH * GROUP, HD, generator=g)
    k = torch.randn(1, 3, BS, KVH, HD, generator=g)
    v = torch.randn(1, 3, BS, KVH, HD, generator=g)
    tables = torch.tensor([[0, 1], [2, 0]])
    req = torch.tensor([0] * 20 + [1] * 7)
    pos = torch.cat([torch.arange(20), torch.arange(7)])
    assert sum(n for _, n in spans) == q.shape[0]
    return q, k, v, StepKV(tables, req, pos)


def _leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone().requires_grad_(True) for t in ts]


def _direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepKV, scale: float) -> torch.Tensor:
    return paged_attention(q, PagedKVCache(k, v), 0, block_tables=step.block_tables, row_request=step.row_request,
                           positions=step.positions, scale=scale, impl="torch")


def _mismatches(fn: type[torch.autograd.Function]) -> list[str]:
    """Which of the forward bits and the three gradients of ``fn`` differ from autograd through the torch impl."""
    q0, k0, v0, step = _inputs()
    scale = 1 / math.sqrt(HD)
    grad = torch.randn(q0.shape, generator=torch.Generator().manual_seed(9))
    q, k, v = _leaves(q0, k0, v0)
    served = fn.apply(q, k, v, step, scale, None, "torch")
    served.backward(grad)
    qd, kd, vd = _leaves(q0, k0, v0)
    direct = _direct(qd, kd, vd, step, scale)
    direct.backward(grad)
    assert float(kd.grad[0, 0].abs().sum()) > 0 and float(kd.grad[0, 2].abs().sum()) > 0  # both requests' blocks
    bad = [] if torch.equal(served, direct) else ["out"]
    return bad + [n for n, got, want in (("q", q.grad, qd.grad), ("k", k.grad, kd.grad), ("v", v.grad, vd.grad))
                  if got is None or not torch.equal(got, want)]


def test_served_attention_forward_bits_and_torch_gradient() -> None:
    assert _mismatches(_ServedAttention) == []


def test_a_miswired_backward_fails() -> None:
    """The negative control: the same forward with the K and V gradients exchanged (same shapes) is caught."""

    class _Swapped(_ServedAttention):
        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def, override]  # noqa: ANN001, ANN205
            gq, gk, gv, *rest = _ServedAttention.backward(ctx, grad)
            return (gq, gv, gk, *rest)

    assert _mismatches(_Swapped) == ["k", "v"]
