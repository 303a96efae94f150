"""The static rule that keeps large all-reduce sites on the workspace, chunked: which sites it takes, which it
leaves to gather_fold / a2a_fold, and that the route table says why (no GPU: routing is a pure function of
static facts)."""

from __future__ import annotations

import torch

from detcomm.envelope import resolve_numerics
from detcomm.route import Router
from detcomm.sites import Capabilities, Collective, Route, Site

ARMED = 2048
CAPS = Capabilities(backend="nccl", device_type="cuda", world_size=2, workspace=True, workspace_max_rows=ARMED,
                    workspace_bytes=32 << 20)


def _decide(coll: Collective, shape: tuple[int, ...], max_rows: int, caps: Capabilities = CAPS):  # noqa: ANN202
    auto = Router(resolve_numerics("rl-bitwise"), caps)
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


def test_the_workspace_answers_for_its_own_rules() -> None:
    """workspace.admission is what the router asks: serves, and why or why not, for each of its rules."""
    from detcomm.sites import ReduceOp
    from detcomm.workspace import admission

    bitwise = resolve_numerics("rl-bitwise")
    ar = Site("s", Collective.ALL_REDUCE, torch.bfloat16, (8192,), ARMED)
    assert admission.admit(ar, CAPS, bitwise) == admission.Admission(
        True, f"canonical fold in the CUDA-IPC workspace (max_rows <= {ARMED})")
    avg = Site("s", Collective.ALL_REDUCE, torch.bfloat16, (8192,), ARMED, ReduceOp.AVG)
    assert admission.admit(avg, CAPS, bitwise) == admission.Admission(
        False, "the workspace kernels round to the dtype; avg needs the fp32 fold")
    rsag = resolve_numerics("rl-bitwise", force_deterministic_rsag=True)
    assert admission.admit(ar, CAPS, rsag) == admission.Admission(
        False, "force_deterministic_rsag: no symmetric-memory path")
    vrs = Site("s", Collective.REDUCE_SCATTER, torch.bfloat16, (8192,), ARMED, virtual_shards=8)
    assert not admission.admit(vrs, CAPS, bitwise).serves
    var = Site("s", Collective.ALL_REDUCE, torch.bfloat16, (8192,), ARMED, virtual_shards=8)
    assert "V/W=4 fp32 slabs" in admission.admit(var, CAPS, bitwise).why
    # Negative control: the same site on a group without a workspace is refused with the group's reason.
    cpu = Capabilities(backend="gloo", device_type="cpu", world_size=2, workspace_reason="CPU group")
    assert admission.admit(ar, cpu, bitwise) == admission.Admission(False, "CPU group")


def test_the_router_and_the_workspace_rules_import_no_torch() -> None:
    """`detcomm routes` decides without torch: the router and the workspace's rules are torch-free. Negative
    control: the workspace itself loads torch, and the probe sees it."""
    import subprocess
    import sys

    probe = "import sys, {0}; print('torch' in sys.modules)"
    for mod, torch_loaded in (("detcomm.sites", "False"), ("detcomm.route", "False"),
                              ("detcomm.workspace.admission", "False"), ("detcomm.workspace.workspace", "True")):
        out = subprocess.run([sys.executable, "-c", probe.format(mod)], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == torch_loaded, (mod, out.stdout, out.stderr)
