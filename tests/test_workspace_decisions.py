"""The workspace's kernel choices, frozen: for every family (plain, fused norm, tree, fused tree, virtual), over row
counts at every breakpoint of its rule and +-1 around it, W in {1, 2, 3, 4, 8} and the tier tables in use, which
kernel (and one-store tier) each launch of a call takes, and which variants the self-checks run
(tests/workspace_decisions.txt, generated from the code of 757ba47 before the rule moved into plan).

The calls run on a CPU stand-in of a workspace whose kernel set records every launch instead of running it, so
the table holds what the real call path chose (the launch loop, the rule and the chunking), not a copy of the
rule. A digest of every launch's full argument block (pointers as offsets into the call's tensors) also holds the
launcher's parameter blocks to what they were. No GPU needed; the GPU tests run the same calls on the kernels.

Regenerate (only for a deliberate change of a decision, said in the commit):
    PYTHONPATH=. python tests/test_workspace_decisions.py --write
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from detcomm.workspace import debug, plan
from detcomm.workspace import workspace as wsmod
from detcomm.workspace.workspace import Workspace

TABLE = Path(__file__).with_name("workspace_decisions.txt")
WORLDS = (1, 2, 3, 4, 8)
SM_COUNT = 132
BIG, SMALL = 32 << 20, (192 << 10) + 48  # init's default workspace_bytes, and one that chunks every family
# (name, shared GPU, one_store_max_bytes forced or None, tier table): the topologies' defaults, and the forced
# one-store of the stream bench and the in-process tests.
CONFIGS = (("own", False, None, plan.DEFAULT_ONE_STORE_TIERS), ("own_untiered", False, None, ()),
           ("shared", True, None, plan.DEFAULT_ONE_STORE_TIERS),
           ("shared_one_store", True, 1 << 20, plan.DEFAULT_ONE_STORE_TIERS),
           ("shared_one_store_256k", True, 256 << 10, ((16 << 10, 8), (64 << 10, 16))))
_TAIL = (0x7A11_0000, 0x7A11_1000, 0, 0x7A11_2000, 0x7A11_3000)


class _Kernels:
    """A kernel set that records each launch (name, grid, argument values) instead of running it."""

    def __init__(self, world: int, trace: list) -> None:
        self.world, self.trace = world, trace

    def prepare(self, name: str, grid: int, args: list) -> Any:
        return lambda stream: self.trace.append((name, grid, [_value(a) for a in args]))

    def launch(self, name: str, grid: int, args: list, *, stream_ptr: int) -> None:
        self.trace.append((name, grid, [_value(a) for a in args]))

    def fused_norm_layout(self, hidden: int, dtype: str) -> str:
        return plan.fused_norm_layout(hidden, dtype, self.world)


def _value(a: Any) -> Any:
    return round(a.value, 9) if isinstance(a, ctypes.c_float) else a.value


class _Ctrl:
    words = [0] * plan.CTRL_WORDS

    def tagged(self) -> bool:
        return False


class _no_stream:  # noqa: N801 - the in-flight guard's stand-in: stream 0, no CUDA
    def __enter__(self) -> int:
        return 0

    def __exit__(self, *exc: Any) -> None:
        pass


def fake_workspace(world: int, *, shared: bool, one_store_max: int | None, table: tuple, capacity: int,
                   trace: list) -> Workspace:
    """A Workspace of `world` ranks as create() would configure it, on the CPU, its launches recorded in `trace`."""
    grid = plan.grid_blocks(world, SM_COUNT, shared_gpu=shared)
    if one_store_max is None:
        one_store_max = plan.one_store_max_bytes(world, shared_gpu=shared)
    tiers = plan.one_store_tiers(one_store_max, world, grid, base=plan.one_store_offset(capacity, world, grid),
                                 table=table)
    ws = object.__new__(Workspace)
    ws._transport = None
    ws._kernels = _Kernels(world, trace)
    ws.grid, ws.one_store_tiers, ws.capacity_bytes, ws.max_rows_armed = grid, tiers, capacity, 2048
    ws.one_shot_max_bytes = plan.one_shot_max_bytes(world, shared_gpu=shared)
    ws.one_store_max_bytes = tiers[-1].max_bytes if tiers else 0
    ws.timeout_ns, ws.device, ws.rank, ws.world_size = 1, torch.device("cpu"), 0, world
    ws._slot_bytes = plan.slot_bytes(capacity, world, grid)
    ws._ctrl = _Ctrl()
    ws._tail = [ctypes.c_uint64(v) if i != 2 else ctypes.c_int32(v) for i, v in enumerate(_TAIL)]
    ws._lock = threading.Lock()
    ws._launchers, ws._bound = {}, {}
    ws._dead, ws._failure, ws._calls, ws.refused = None, None, 0, {}
    ws._label_ring = [None] * wsmod._LABELS_KEPT
    ws._in_flight = _no_stream()
    debug.record(ws)
    return ws


def _short(name: str) -> str:
    """A kernel name without the prefix and the dtype suffixes: the choice, not the instantiation."""
    parts = name.removeprefix("detcomm_").split("_")
    drop = {"bf16", "f32", "f16", "wbf16", "wf32", "wf16", "fused", "rmsnorm", "tree", "virtual"}
    return "_".join(p for p in parts if p not in drop)


def _probes(row_bytes: tuple[int, ...], limits: tuple[int, ...], per: int, most: int) -> list[int]:
    """Row counts at every breakpoint of a rule over launch bytes and +-1 around it, and around the launch's rows."""
    ks = {1, 2, 3, per - 1, per, per + 1, 2 * per + 1}
    for rb in row_bytes:
        for b in limits:
            ks.update(b // rb + d for d in (-1, 0, 1, 2))
    return sorted(k for k in ks if 1 <= k <= min(2 * per + 1, most))


# (family, dtype, row widths, shards per rank)
FAMILIES = (("plain", "bfloat16", (1, 1001, 4096), 1), ("plain", "float32", (1, 1001), 1),
            ("fused", "bfloat16", (1001, 4096), 1), ("fused", "float32", (1001,), 1),
            ("tree", "bfloat16", (1, 1001, 4096), 2), ("tree", "float32", (1001,), 2),
            ("fused_tree", "bfloat16", (1001, 4096), 2), ("virtual", "bfloat16", (1001, 4096), 2),
            ("virtual", "float32", (1, 1001), 4))
_DT = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _call(ws: Workspace, family: str, dtype: str, k: int, h: int, shards: int, **kw: Any) -> list[Any]:
    """One call of `family` with k rows of h elements (kw: the self-checks' forcing, algo= or chunk_rows=); the
    tensors it launches on, for naming pointers."""
    dt = _DT[dtype]
    if family == "plain":
        x = torch.empty(k, h, dtype=dt)
        return [x, ws.all_reduce(x, **kw)]
    if family == "fused":
        x, res, w = torch.empty(k, h, dtype=dt), torch.empty(k, h, dtype=dt), torch.empty(h, dtype=torch.bfloat16)
        return [x, res, w, *ws.all_reduce_rmsnorm(x, res, w, 1e-6, **kw)]
    p = torch.empty(shards, k, h, dtype=torch.float32)
    if family == "fused_tree":
        res, w = torch.empty(k, h, dtype=dt), torch.empty(h, dtype=torch.bfloat16)
        return [p, res, w, *ws.all_reduce_rmsnorm_tree(p, res, w, 1e-6, **kw)]
    if family == "tree":
        return [p, ws.all_reduce_tree(p, dtype=dt, **kw)]
    return [p, ws.all_reduce_virtual(p, dtype=dt, **kw)]


def _forced(variant: str) -> dict[str, Any]:
    """How ipc_fold's self-check calls force a variant."""
    v = variant.removeprefix("fused_")
    return {"chunk_rows": 1} if v == "chunked" else {"algo": v}


def _variants(ws: Workspace, family: str, dtype: str, h: int, max_rows: int, shards: int) -> list[str]:
    dt = _DT[dtype]
    if family == "plain":
        return ws.variants("all_reduce", dt, h, max_rows)
    return ws.family_variants(family, dt, h, max_rows, shards=shards)


def _per(ws: Workspace, family: str, dtype: str, h: int, shards: int) -> int:
    if family == "plain":
        return ws.capacity_bytes // (h * plan.elem_size(dtype))
    if family == "fused":
        return plan.fused_norm_rows_per_launch(h, dtype, grid=ws.grid, slot_bytes=ws._slot_bytes)
    if family == "fused_tree":
        return plan.fused_norm_tree_rows_per_launch(h, grid=ws.grid, slot_bytes=ws._slot_bytes)
    if family == "tree":
        return plan.tree_rows_per_launch(ws.capacity_bytes, h, world_size=ws.world_size, dtype=dtype, grid=ws.grid)
    return plan.virtual_rows_per_launch(ws.capacity_bytes, h, shards, world_size=ws.world_size, dtype=dtype,
                                        grid=ws.grid)


def _named(args: list[Any], tensors: list[Any]) -> list[Any]:
    """Argument values with pointers into the call's tensors as (tensor index, offset), the tail as its name."""
    out: list[Any] = []
    for v in args:
        if v in _TAIL[:2] or v in _TAIL[3:]:
            out.append(f"tail{_TAIL.index(v)}")
            continue
        for i, t in enumerate(tensors):
            base = t.data_ptr()
            if isinstance(v, int) and base <= v <= base + t.numel() * t.element_size() and v > 1 << 20:
                out.append((i, v - base))
                break
        else:
            out.append(v)
    return out


def generate() -> tuple[list[str], str]:
    """The table's lines and the digest of every launch's argument block."""
    lines: list[str] = []
    digest = hashlib.sha256()
    _generate(lines, digest)
    return lines, digest.hexdigest()


def _generate(lines: list[str], digest: Any) -> None:
    for world in WORLDS:
        for cname, shared, one_store, table in CONFIGS:
            for capacity in (BIG, SMALL) if cname in ("own", "shared_one_store") else (BIG,):
                for family, dtype, widths, shards in FAMILIES:
                    for h in widths:
                        trace: list = []
                        ws = fake_workspace(world, shared=shared, one_store_max=one_store, table=table,
                                            capacity=capacity, trace=trace)
                        if family in ("tree", "fused_tree") and plan.tree_refusal(shards * world, world):
                            continue
                        per = _per(ws, family, dtype, h, shards)
                        if per < 1:
                            lines.append(f"{family} {dtype} W{world} {cname} cap{capacity} h{h}: no launch")
                            continue
                        esz = plan.elem_size(dtype)
                        limits = (ws.one_shot_max_bytes, ws.one_store_max_bytes, capacity,
                                  *(t.max_bytes for t in ws.one_store_tiers))
                        ks = _probes((h * esz, h * 4, h * 4 * shards, plan.tree_launch_bytes(h, dtype)), limits, per,
                                     (48 << 20) // (h * 4 * shards))
                        calls, variants = [], []
                        for k in ks:
                            del trace[:]
                            tensors = _call(ws, family, dtype, k, h, shards)
                            launches = [f"{_short(n)}/{g}" for n, g, _ in trace]
                            calls.append(f"{k}:{'+'.join(_rle(launches))}")
                            for n, g, a in trace:
                                digest.update(repr((family, world, cname, capacity, h, k, n, g,
                                                    _named(a, tensors))).encode())
                            variants.append(f"{k}:{','.join(_variants(ws, family, dtype, h, k, shards))}")
                        forced = []
                        for v in _variants(ws, family, dtype, h, ks[-1], shards):
                            k = min(3, ks[-1]) if v.endswith("chunked") else min(ks[-1], per)
                            del trace[:]
                            try:
                                tensors = _call(ws, family, dtype, k, h, shards, **_forced(v))
                            except ValueError:  # a forced one-store launch larger than the areas
                                forced.append(f"{v}@{k}:refused")
                                continue
                            forced.append(f"{v}@{k}:{'+'.join(_rle([f'{_short(n)}/{g}' for n, g, _ in trace]))}")
                            for n, g, a in trace:
                                digest.update(repr((family, world, cname, capacity, h, v, n, g,
                                                    _named(a, tensors))).encode())
                        head = f"{family} {dtype} W{world} {cname} cap{capacity} h{h} per{per}"
                        lines.append(f"{head} forced {' '.join(forced)}")
                        lines.append(f"{head} calls {' '.join(_rle(calls, key=lambda s: s.split(':')[1]))}")
                        lines.append(f"{head} variants {' '.join(_rle(variants, key=lambda s: s.split(':')[1]))}")


def _rle(items: list[str], *, key: Any = None) -> list[str]:
    """Runs of equal items as 'item*n' (by `key`: the first item of each run stands for it)."""
    key = key or (lambda s: s)
    out: list[str] = []
    run: list[str] = []
    for it in items:
        if run and key(run[0]) != key(it):
            out.append(run[0] + (f"*{len(run)}" if len(run) > 1 else ""))
            run = []
        run.append(it)
    if run:
        out.append(run[0] + (f"*{len(run)}" if len(run) > 1 else ""))
    return out


@pytest.fixture(scope="module")
def generated() -> tuple[list[str], str]:
    return generate()


def _stored() -> tuple[list[str], str]:
    text = TABLE.read_text().splitlines()
    assert text[0].startswith("# launch-args sha256 "), text[0]
    return text[1:], text[0].split()[-1]


def test_every_call_takes_the_kernels_it_took(generated: tuple[list[str], str]) -> None:
    lines, _ = generated
    want, _ = _stored()
    got_calls = [ln for ln in lines if " variants " not in ln]  # the calls the rule chose, and the forced ones
    want_calls = [ln for ln in want if " variants " not in ln]
    diff = [(w, g) for w, g in zip(want_calls, got_calls, strict=False) if w != g]
    assert len(got_calls) == len(want_calls) and not diff, diff[:3]


def test_the_self_checks_run_the_variants_they_ran(generated: tuple[list[str], str]) -> None:
    lines, _ = generated
    want, _ = _stored()
    got_v = [ln for ln in lines if " variants " in ln]
    want_v = [ln for ln in want if " variants " in ln]
    diff = [(w, g) for w, g in zip(want_v, got_v, strict=False) if w != g]
    assert len(got_v) == len(want_v) and not diff, diff[:3]


def test_every_launch_passes_the_arguments_it_passed(generated: tuple[list[str], str]) -> None:
    assert generated[1] == _stored()[1]


@pytest.mark.parametrize("family", list(plan.FAMILY_ALGOS))
def test_the_variants_are_the_rule_at_every_row_count(family: str) -> None:
    """plan.reached (bisection over the rule's breakpoints) equals the rule asked at every row count 1..top; the
    control: a rule that is not monotone in the rows is caught by the same comparison."""
    for h, dtype, shards, one_store, one_shot in ((1001, "bfloat16", 2, 64 << 10, 96 << 10),
                                                  (8, "float32", 4, 200, 0), (33, "bfloat16", 1, 0, 1 << 62)):
        per, max_rows = 700, 1400
        tiers = (one_store,) if one_store else ()
        brute = {plan.launch_kernel(family, k, row_elems=h, dtype=dtype, shards=shards, one_store_tiers=tiers,
                                    one_shot_max_bytes=one_shot)[0] for k in range(1, per + 1)}
        got = plan.reached(family, per, max_rows, row_elems=h, dtype=dtype, shards=shards, one_store_max=one_store,
                           one_shot_max_bytes=one_shot)
        assert got == [a for a in plan.FAMILY_ALGOS[family] if a in brute] + ["chunked"], (h, dtype)
    odd = {plan.launch_kernel("plain", k, row_elems=1, dtype="float32", one_store_tiers=(),
                              one_shot_max_bytes=400)[0] if k != 37 else "one_store" for k in range(1, 701)}
    assert "one_store" in odd and "one_store" not in plan.reached(
        "plain", 700, 700, row_elems=1, dtype="float32", one_store_max=0, one_shot_max_bytes=400)


def test_bind_refuses_bad_arguments_before_any_launch() -> None:
    """The checks a call shape gets once (Workspace.bind) and a call's tensor checks refuse every bad argument
    with its named error, and launch nothing (the ranks' call numbers still agree); the control: the same calls
    with good arguments launch."""
    trace: list = []
    ws = fake_workspace(2, shared=True, one_store_max=1 << 20, table=plan.DEFAULT_ONE_STORE_TIERS,
                        capacity=1 << 16, trace=trace)
    off = fake_workspace(2, shared=True, one_store_max=None, table=(), capacity=1 << 16, trace=trace)
    p, x = torch.zeros(4, 4, 8), torch.zeros(4, 64)
    refused: list[tuple[Any, type[Exception], str]] = [
        (lambda: ws.all_reduce(x, algo="three_shot"), ValueError, "algo"),
        (lambda: ws.all_reduce(x, chunk_rows=10**6), ValueError, "chunk_rows"),
        (lambda: ws.all_reduce(x, chunk_rows=True), TypeError, "chunk_rows"),
        (lambda: ws.all_reduce(x, out=x), ValueError, "overlaps"),
        (lambda: off.all_reduce(x, algo="one_store"), ValueError, "one_store_max_bytes"),
        (lambda: ws.all_reduce(torch.zeros(1, 1 << 15)), ValueError, "does not fit"),
        (lambda: ws.all_reduce_rmsnorm(x, x, x[0], 1e-6, algo="one_store", chunk_rows=10**4), ValueError,
         "chunk_rows"),
        (lambda: off.all_reduce_rmsnorm(x, x, x[0], 1e-6, algo="one_store"), ValueError, "one_store_max_bytes"),
        (lambda: ws.all_reduce_rmsnorm_tree(torch.zeros(3, 4, 64), x, x[0], 1e-6), ValueError, "power of two"),
        (lambda: off.all_reduce_tree(p, dtype=torch.bfloat16, algo="one_store"), ValueError, "one_store_max_bytes"),
    ]
    for fam in ("tree", "virtual"):
        f = getattr(ws, f"all_reduce_{fam}")
        refused += [(lambda f=f: f(p.to(torch.bfloat16), dtype=torch.bfloat16), ValueError, "float32"),
                    (lambda f=f: f(p, dtype="bfloat16"), TypeError, "dtype"),
                    (lambda f=f: f(p, dtype=torch.bfloat16, algo="three_shot"), ValueError, "algo"),
                    (lambda f=f: f(p, dtype=torch.bfloat16, chunk_rows=10**6), ValueError, "chunk_rows"),
                    (lambda f=f: f(p, dtype=torch.bfloat16, out=torch.empty(4, 8)), ValueError, "out must be")]
    refused.append((lambda: ws.all_reduce_tree(torch.zeros(3, 4, 8), dtype=torch.bfloat16), ValueError,
                    "power of two"))
    for call, exc, match in refused:
        with pytest.raises(exc, match=match):
            call()
    assert trace == [] and ws._calls == off._calls == 0
    ws.all_reduce(x, chunk_rows=2)
    ws.all_reduce_tree(p, dtype=torch.bfloat16, algo="one_store")
    assert len(trace) == 3 and ws._calls == 3


def test_the_table_sees_a_moved_breakpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: one-shot's limit one byte lower changes calls the table holds (and the digest)."""
    real = plan.one_shot_max_bytes
    monkeypatch.setattr(plan, "one_shot_max_bytes", lambda w, *, shared_gpu: real(w, shared_gpu=shared_gpu) - 1)
    lines, digest = generate()
    want, want_digest = _stored()
    assert digest != want_digest
    assert sum(a != b for a, b in zip(lines, want, strict=True)) > 0


def test_the_table_sees_a_tier_taken_by_another_launch() -> None:
    """Negative control: a launch recorded on another tier's blocks is a different line."""
    lines, _ = _stored()
    line = next(ln for ln in lines if ln.startswith("plain bfloat16 W2 own cap") and "one_store/16" in ln)
    assert line.replace("one_store/16", "one_store/32", 1) not in lines


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    table, digest = generate()
    TABLE.write_text(f"# launch-args sha256 {digest}\n" + "\n".join(table) + "\n")
    print(f"{len(table)} lines, {TABLE}")
