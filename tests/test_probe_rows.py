"""The op row-count mapper (docs/spec.md §7 (row-count mapper)) and the probes' bit comparisons."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from detcomm.probe.bits import changed_mask, ulp_distance
from detcomm.probe.rows import load_op, map_rows, matmul_op

ROOT = Path(__file__).resolve().parents[1]
# The CLI test names the callables below by import path, as a user names theirs.
OPS = "tests.test_probe_rows"


def stepped_sum(x: torch.Tensor) -> torch.Tensor:
    """Row sums whose association order changes with the row count, by construction: natural order for
    t < 5, reversed for 5 <= t < 17, and pairs (1, 2) first then 0, 3.. for t >= 17 (as a kernel dispatcher
    changing its schedule at ladder thresholds would)."""
    t, k = x.shape
    if t < 5:
        order = list(range(k))
    elif t < 17:
        order = list(range(k - 1, -1, -1))
    else:
        order = [1, 2, 0] + list(range(3, k))
    acc = torch.zeros(t, dtype=torch.float32)
    for j in order:
        acc = acc + x[:, j].to(torch.float32)
    return acc[:, None]


def rowwise_scale(x: torch.Tensor) -> torch.Tensor:
    """Elementwise, so no row count can change any row's bits."""
    return x * 3.0 + 1.0


def _crafted(rows: int = 24) -> torch.Tensor:
    # Row 0 = [1, 1e8, -1e8, 3]: in fp32 the natural order gives 3, reversed gives 1, (1e8, -1e8, 1, 3)
    # gives 4, so every change of order changes row 0's bits.
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(0))
    x[0] = torch.tensor([1.0, 1e8, -1e8, 3.0])
    return x


def test_boundaries_known_by_construction() -> None:
    m = map_rows(stepped_sum, _crafted(), max_rows=24, name="stepped")
    assert [b.t for b in m.boundaries] == [5, 17]
    assert all(b.changed == 1 and b.elements == 1 for b in m.boundaries)
    assert "t=5 (1 of 1 elements" in m.describe() and "t=17" in m.describe()


def test_fixed_padded_width_removes_every_boundary() -> None:
    # Seed 002's fix: every t runs at T_pad rows, so the op sees one row count.
    assert map_rows(stepped_sum, _crafted(), max_rows=20, pad_to=24).boundaries == ()


def test_row_invariant_op_has_no_boundary() -> None:
    m = map_rows(rowwise_scale, torch.randn(40, 33), max_rows=40)
    assert m.boundaries == () and m.describe() == "none - invariant for t <= 40"


def test_matmul_map_runs_and_padding_makes_it_invariant() -> None:
    op, name = matmul_op(64, 96, dtype=torch.float32, device="cpu", seed=0)
    x = torch.randn(32, 96)
    assert name == "matmul [64x96]"
    assert map_rows(op, x, max_rows=32, pad_to=32).boundaries == ()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_rows"):
        map_rows(rowwise_scale, torch.randn(4, 2), max_rows=5)
    with pytest.raises(ValueError, match="row dimension"):
        map_rows(lambda x: x.sum(), torch.randn(4, 2))
    with pytest.raises(ValueError, match="pkg.mod:fn"):
        load_op("no_colon")
    with pytest.raises(ValueError, match="has no attribute"):
        load_op(f"{OPS}:missing")


def test_cli_op_and_matmul_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "detcomm.probe", "rows", "--op", f"{OPS}:stepped_sum", "--op",
         f"{OPS}:rowwise_scale", "--width", "64", "--shape", "48", "32", "--max-rows", "24",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{OPS}:stepped_sum" in proc.stdout and "matmul [48x32]" in proc.stdout
    maps = {m["op"]: m for m in json.loads(out.read_text())["maps"]}
    # Random normal data over 64 columns: reversing or rotating the order changes row 0's sum.
    assert [b["t"] for b in maps[f"{OPS}:stepped_sum"]["boundaries"]] == [5, 17]
    assert maps[f"{OPS}:rowwise_scale"]["boundaries"] == []


def test_bits_and_ulps() -> None:
    a = torch.tensor([0.0, 1.0, float("nan"), -1.0], dtype=torch.float32)
    b = torch.tensor([-0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item(), 0.0, -1.0])
    assert changed_mask(a, b).tolist() == [True, True, True, False]
    # -0.0 is one step below +0.0: distance 0 exactly when the bits are identical (detcomm.invariance)
    assert ulp_distance(a, b).tolist() == [1.0, 1.0, float("inf"), 0.0]
    lo = torch.tensor([-1e-45], dtype=torch.float32)  # crossing zero: -denorm_min, -0.0, +0.0, +denorm_min
    assert ulp_distance(lo, -lo).item() == 3.0
    x = torch.tensor([1.0], dtype=torch.bfloat16)
    assert ulp_distance(x, x * (1 + 2**-7)).item() == 1.0
