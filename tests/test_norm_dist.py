"""all_reduce_residual_rmsnorm on real spawned gloo ranks at W = 2, 3, 4 (docs/spec.md §9): the rows alone and
inside batches of other sizes at other offsets, bit for bit against the numpy composition oracle computed locally
from inputs every rank regenerates for every other rank. Negative control (W >= 3): the same composition over
a rotated rank order must be caught differing, so the comparison does see the fold's order through the norm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import norm_oracle
from datagen import DTYPES, ill_bits, random_bits, to_bits, to_torch
from norm_rows import adversarial_rows, weight_bits
from test_collectives_dist import _comm

HIDDEN = 2049  # one whole pass of 256 lanes x 8 elements and one element of a second pass
EPS = 1e-6


def _x_bits(rank: int, dtype: str, seed: int) -> np.ndarray:
    """Rank `rank`'s base rows: every adversarial kind, then ill-conditioned rows that cancel across ranks."""
    return np.concatenate([adversarial_rows(9, HIDDEN, dtype, seed=seed * 64 + rank),
                           ill_bits(3, HIDDEN, dtype, seed=seed, rank=rank)])


def job_norm_rows(rank: int, w: int, dtype: str, seed: int) -> dict[str, bool]:
    import detcomm

    _comm("rl-bitwise")
    site = f"norm.{dtype}"
    xs = [_x_bits(r, dtype, seed) for r in range(w)]
    rows = len(xs[0])
    res = random_bits(rows, HIDDEN, dtype, seed=seed + 1, rank=0)  # the residual stream is replicated
    wt = weight_bits(HIDDEN, dtype, seed=seed + 2)
    weight = to_torch(wt, dtype)
    y_exp, r_exp = norm_oracle.composition_oracle(xs, res, wt, dtype, dtype, EPS)

    def call(x: np.ndarray, residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        y, r = detcomm.all_reduce_residual_rmsnorm(to_torch(x, dtype), to_torch(residual, dtype), weight, eps=EPS,
                                                   site=site)
        return to_bits(y), to_bits(r)

    alone = [call(xs[rank][i : i + 1], res[i : i + 1]) for i in range(rows)]
    y_alone = np.concatenate([a[0] for a in alone])
    r_alone = np.concatenate([a[1] for a in alone])
    out = {"alone": bool(np.array_equal(y_alone, y_exp) and np.array_equal(r_alone, r_exp))}
    for total, off in ((rows, 0), (rows + 1, 1), (40, 17)):
        x = random_bits(total, HIDDEN, dtype, seed=seed + total, rank=rank).copy()
        residual = random_bits(total, HIDDEN, dtype, seed=seed + total, rank=99).copy()
        x[off : off + rows] = xs[rank]
        residual[off : off + rows] = res
        y, r = call(x, residual)
        out[f"batch{total}@{off}"] = bool(np.array_equal(y[off : off + rows], y_alone)
                                          and np.array_equal(r[off : off + rows], r_alone))
    if w >= 3:
        y_rot, r_rot = norm_oracle.composition_oracle(xs[1:] + xs[:1], res, wt, dtype, dtype, EPS)
        out["rotated_caught"] = not (np.array_equal(y_rot, y_alone) and np.array_equal(r_rot, r_alone))
    return out


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_all_reduce_residual_rmsnorm_rows_in_any_batch(cluster, dtype: str) -> None:
    results = cluster.run(job_norm_rows, dtype, 3)
    for rank, res in enumerate(results):
        assert all(res.values()), (rank, res)
    assert len({tuple(sorted(r.items())) for r in results}) == 1


def test_arguments_checked_before_any_communication() -> None:
    """A wrong residual, weight or eps is refused with ValueError by the checks Communicator.all_reduce_residual_
    rmsnorm runs before its all-reduce (so no rank enters it alone); valid arguments pass them."""
    from detcomm.numerics.norm import _check_add, eps_fp32

    x = torch.ones(2, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual"):
        _check_add("s", x, torch.ones(2, 8), w)
    with pytest.raises(ValueError, match="last dimension"):
        _check_add("s", x, x, torch.ones(7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="eps"):
        eps_fp32(-1.0)
    assert _check_add("s", x, x, w) == 8 and eps_fp32(EPS) > 0
