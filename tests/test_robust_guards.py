"""The host-side seams of the workspace's failure guards, on CPU (no GPU, no cupy): init(timeout_s=) reaching the
workspace, the self-checks running every kernel variant a site can reach, and the workspace refusing an
overlapping out/x pair. The device-side guards are tested on the accelerator (tests/gpu/test_workspace_failures.py);
tests/mutations.py removes each guard in turn and checks that its test fails.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from detcomm.launch.mpi_bootstrap import free_port


def test_init_timeout_reaches_the_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """init(timeout_s=) is also the workspace's device-side deadline: it reaches Workspace.create. A stand-in create
    records its arguments and declines to arm (so no GPU is needed); the route falls back as on a real refusal."""
    import detcomm
    import detcomm.comm as comm_mod
    from detcomm.errors import WorkspaceUnavailable
    from detcomm.workspace import Workspace

    if dist.is_initialized():
        pytest.skip("init(timeout_s=) needs init to create the process group; one exists in this process")
    seen: list[dict[str, object]] = []

    def create(cls, group=None, **kw):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        seen.append(kw)
        raise WorkspaceUnavailable("stand-in create: records its arguments, arms nothing")

    monkeypatch.setattr(Workspace, "create", classmethod(create))
    monkeypatch.setattr(comm_mod, "discover_topology",
                        lambda group, device: SimpleNamespace(same_host=True, hosts=1, describe=lambda: "stand-in topology"))
    saved = dict(os.environ)  # init applies the envelope's environment to this process
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        comm = detcomm.init(numerics="auto", device="cuda:0", workspace=True, selfcheck=False, timeout_s=7.5)
        try:
            assert not comm.caps.workspace and "stand-in create" in comm.caps.workspace_reason
        finally:
            detcomm.shutdown()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert len(seen) == 1 and seen[0].get("timeout_s") == 7.5, seen


class _StandInWorkspace:
    """Serves ipc_fold's calls on CPU with the canonical fold of the gathered inputs; the variant named `wrong`
    flips one bit of its result (None: none does). Records which variant each call forced."""

    def __init__(self, native, wrong: str | None) -> None:  # noqa: ANN001
        self.native, self.wrong = native, wrong
        self.ran: list[str] = []

    def variants(self, collective: str, dtype: torch.dtype, row_numel: int, max_rows: int) -> list[str]:
        return ["one_shot", "two_shot", "chunked"]

    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor | None = None, algo: str | None = None,
                   chunk_rows: int | None = None, label: str | None = None) -> torch.Tensor:
        from detcomm.numerics.fold import reference_fold

        variant = algo or ("chunked" if chunk_rows is not None else "")
        self.ran.append(variant)
        w = self.native.world_size
        y = reference_fold(self.native.all_gather(x).view(w, *x.shape), x.dtype).clone()
        if variant == self.wrong:
            y.view(torch.int32).view(-1)[0] ^= 1
        return y

    def bind_all_reduce(self, dtype: torch.dtype, row_numel: int, *, label: str | None = None):  # noqa: ANN201
        """The site-bound default call (the hot path), served like an unforced all_reduce."""
        return lambda x, out: self.all_reduce(x, out=out, label=label)


def job_variant_checks(rank: int, w: int) -> list[tuple[str | None, bool, str, list[str]]]:
    from detcomm.envelope import resolve_numerics
    from detcomm.route_impls.ipc_fold import IpcFoldRoute
    from detcomm.route_impls.native import NativeRoute
    from detcomm.selfcheck import SelfChecks
    from detcomm.sites import Collective, ReduceOp, Site

    native = NativeRoute(dist.group.WORLD)
    site = Site("guards.ar", Collective.ALL_REDUCE, torch.float32, (24,), 64, ReduceOp.SUM)
    out = []
    for wrong in (None, "two_shot", "chunked"):
        ws = _StandInWorkspace(native, wrong)
        result = SelfChecks(native=native, device=torch.device("cpu"))(IpcFoldRoute(ws, resolved=resolve_numerics("rl-bitwise")).bind(site))  # type: ignore[arg-type]
        out.append((wrong, result.passed, result.key.variant, sorted(set(ws.ran))))
    return out


@pytest.mark.parametrize("cluster", [2], indirect=True, ids=["W2"])
def test_selfchecks_run_every_variant_a_site_can_reach(cluster) -> None:  # noqa: ANN001
    """The self-checks of an ipc_fold site force every variant the workspace lists (one-shot, two-shot, chunked)
    besides the default call, and a wrong result in any one of them refuses the route on every rank, naming it."""
    for res in cluster.run(job_variant_checks, timeout_s=120):
        (_, ok, _, ran), *bad = res
        assert ok and ran == ["", "chunked", "one_shot", "two_shot"], res
        for wrong, passed, variant, _ in bad:
            assert not passed and variant == wrong, res


def test_workspace_refuses_overlapping_out_and_x() -> None:
    """Workspace._output, the check every workspace collective makes before launching: any byte overlap of out and
    x is a ValueError (chunk k's output would overwrite chunk k+1's input); adjacent buffers are accepted."""
    from detcomm.workspace import Workspace

    ws = object.__new__(Workspace)  # the check reads only its arguments: no device, no buffers
    buf = torch.zeros(17, 16)
    for x, out in ((buf[:8], buf[1:9]), (buf[1:9], buf[:8]), (buf[:8], buf[:8]), (buf[4:12], buf[8:16])):
        with pytest.raises(ValueError, match="overlaps"):
            ws._output(x, out, (8, 16))
    assert ws._output(buf[:8], buf[8:16], (8, 16)) is not None
    assert ws._output(buf[8:16], buf[:8], (8, 16)) is not None
