"""The static rule that keeps large all-reduce sites on the workspace, chunked: which sites it takes, which it
leaves to gather_fold / a2a_fold, and that the route table says why (no GPU: routing is a pure function of
static facts)."""

from __future__ import annotations

import torch

from detcomm.envelope import resolve_numerics
from detcomm.route import AutoBackend, Capabilities, Collective, Route, Site

ARMED = 2048
CAPS = Capabilities(backend="nccl", device_type="cuda", world_size=2, workspace=True, workspace_max_rows=ARMED,
                    workspace_bytes=32 << 20)


def _decide(coll: Collective, shape: tuple[int, ...], max_rows: int, caps: Capabilities = CAPS):  # noqa: ANN202
    auto = AutoBackend(resolve_numerics("rl-bitwise"), caps)
    return auto.decide(Site("s", coll, torch.bfloat16, shape, max_rows))


def test_large_all_reduce_site_stays_on_the_workspace_chunked() -> None:
    d = _decide(Collective.ALL_REDUCE, (8192,), 16384)  # 256 MiB at max_rows: 8 launches of 32 MiB
    assert d.route is Route.IPC_FOLD, d.why
    assert "chunked" in d.why and "8 launches per call" in d.why and "an all-reduce row fits one launch" in d.why
    assert "H200" not in d.why and "docs/performance.md" not in d.why  # the rule, not its measurement
    norm = _decide(Collective.ALL_REDUCE_RMSNORM, (8192,), 16384)
    assert norm.route is Route.IPC_FOLD, norm.why
    # Within the armed rows nothing changes.
    small = _decide(Collective.ALL_REDUCE, (8192,), ARMED)
    assert small.route is Route.IPC_FOLD and "chunked" not in small.why


def test_rule_leaves_what_it_was_not_measured_for() -> None:
    # Reduce-scatter above the armed rows: a2a_fold, as before.
    rs = _decide(Collective.REDUCE_SCATTER, (8192,), 16384)
    assert rs.route is Route.A2A_FOLD and f"> workspace's armed {ARMED} rows" in rs.why
    # A row larger than one launch cannot be chunked by rows: gather_fold.
    wide = _decide(Collective.ALL_REDUCE, (32 << 20,), 4096)
    assert wide.route is Route.GATHER_FOLD, wide.why
    # Negative control: without a known launch size the rule does not apply (the armed rows alone decide).
    unknown = Capabilities(backend="nccl", device_type="cuda", world_size=2, workspace=True, workspace_max_rows=ARMED)
    assert _decide(Collective.ALL_REDUCE, (8192,), 16384, unknown).route is Route.GATHER_FOLD
