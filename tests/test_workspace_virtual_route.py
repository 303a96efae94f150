"""The static rule that routes virtual-shard all-reduce sites (docs/spec.md §9.1) to the workspace's virtual kernels,
and ipc_fold's binding of such a site to Workspace.all_reduce_virtual with every reachable variant exposed for the
self-checks (no GPU: routing is a pure function of static facts; the binding is checked against a recording fake,
and the self-checks against a CPU stand-in of the workspace whose variants can each be made wrong, on gloo)."""

from __future__ import annotations

import pytest
import torch

from detcomm.envelope import resolve_numerics
from detcomm.route import Router
from detcomm.sites import NO_ARGS, Capabilities, Collective, Route, Site

ARMED = 2048
CAPS = Capabilities(backend="nccl", device_type="cuda", world_size=2, workspace=True, workspace_max_rows=ARMED,
                    workspace_bytes=1 << 20)
V = 8


def _site(coll: Collective = Collective.ALL_REDUCE, shape: tuple[int, ...] = (4096,), max_rows: int = 64,
          **kw: object) -> Site:
    return Site("o_proj", coll, torch.bfloat16, shape, max_rows, virtual_shards=V, **kw)  # type: ignore[arg-type]


def _candidates(site: Site, caps: Capabilities = CAPS, numerics: str = "rl-bitwise", **switches: object):  # noqa: ANN202
    return Router(resolve_numerics(numerics, **switches), caps).candidates(site)


def test_armed_workspace_takes_virtual_all_reduce_first() -> None:
    c = _candidates(_site(max_rows=16))  # 16 rows of 4 slabs x 4096 fp32: exactly one 1 MiB launch
    assert [d.route for d in c] == [Route.IPC_FOLD, Route.GATHER_FOLD, Route.A2A_FOLD]
    assert "V/W=4 fp32 slabs" in c[0].why and "global shard order" in c[0].why and "launches" not in c[0].why
    assert "4 launches per call" in _candidates(_site(max_rows=64))[0].why
    assert "ipc_fold refused" in c[1].why


def test_rows_beyond_a_launch_are_chunked_and_said_so() -> None:
    # one row: 4 slabs x 4096 fp32 = 64 KiB; 16 rows per 1 MiB launch; 4096 rows: 256 launches, above the armed rows
    d = _candidates(_site(max_rows=4096))[0]
    assert d.route is Route.IPC_FOLD
    assert f"chunked above the armed {ARMED} rows" in d.why and "256 launches per call" in d.why


def test_what_the_workspace_cannot_serve_keeps_the_fold_routes() -> None:
    # A row's 4 fp32 slabs larger than one 1 MiB launch (4 x 65537 x 4 bytes): gather_fold, with the reason.
    wide = _candidates(_site(shape=(1 << 16 | 1,)))
    assert wide[0].route is Route.GATHER_FOLD and "exceed a workspace launch" in wide[0].why
    assert Route.IPC_FOLD not in [d.route for d in wide]
    # No workspace on the group (the negative control of the rule): as before.
    bare = Capabilities(backend="gloo", device_type="cpu", world_size=2)
    c = _candidates(_site(), bare)
    assert [d.route for d in c] == [Route.GATHER_FOLD, Route.A2A_FOLD] and bare.workspace_reason in c[0].why
    # force_deterministic_rsag forbids symmetric memory.
    c = _candidates(_site(), CAPS, "auto", force_deterministic_rsag=True)
    assert c[0].route is Route.GATHER_FOLD and "force_deterministic_rsag" in c[0].why
    # Reduce-scatter has no virtual workspace kernel: a2a_fold, saying so.
    rs = _candidates(_site(Collective.REDUCE_SCATTER))
    assert [d.route for d in rs] == [Route.A2A_FOLD, Route.GATHER_FOLD] and "all-reduce only" in rs[0].why


def test_forced_ipc_fold() -> None:
    assert [d.route for d in _candidates(_site(route=Route.IPC_FOLD))] == [Route.IPC_FOLD]
    with pytest.raises(ValueError, match="route='ipc_fold' is unavailable for 8 virtual shards.*gather_fold"):
        _candidates(_site(route=Route.IPC_FOLD), Capabilities(backend="gloo", device_type="cpu", world_size=2))
    with pytest.raises(ValueError, match="exceed a workspace launch"):
        _candidates(_site(shape=(1 << 16 | 1,), route=Route.IPC_FOLD))
    with pytest.raises(ValueError, match="all_reduce sites only.*a2a_fold"):
        _site(Collective.REDUCE_SCATTER, route=Route.IPC_FOLD)


class _FakeWorkspace:
    """Records what the binding asks of the workspace (the kernels themselves: tests/gpu/test_workspace_virtual.py)."""

    world_size = 2

    def __init__(self, variants: list[str]) -> None:
        self._variants = variants
        self.asked: tuple[object, ...] = ()
        self.calls: list[dict[str, object]] = []

    def virtual_variants(self, dtype: torch.dtype, row_numel: int, max_rows: int, shards: int) -> list[str]:
        self.asked = (dtype, row_numel, max_rows, shards)
        return self._variants

    def all_reduce_virtual(self, x: torch.Tensor, **kw: object) -> torch.Tensor:
        self.calls.append(kw)
        return x[0]


def test_ipc_fold_binds_virtual_sites_with_every_variant_forced() -> None:
    from detcomm.route_impls.ipc_fold import IpcFoldRoute

    ws = _FakeWorkspace(["one_shot", "two_shot", "chunked"])
    bound = IpcFoldRoute(ws, resolved=resolve_numerics("rl-bitwise")).bind(_site(max_rows=64))  # type: ignore[arg-type]
    assert ws.asked == (torch.bfloat16, 4096, 64, V // 2)
    assert bound.route is Route.IPC_FOLD and not bound.in_place
    assert list(bound.variants) == ["one_shot", "two_shot", "chunked"]
    x = torch.zeros(4, 3, 4096)
    bound(x, NO_ARGS)
    for v in bound.variants.values():
        v(x, NO_ARGS)
    base = {"dtype": torch.bfloat16, "label": "o_proj"}
    assert ws.calls == [base, {**base, "algo": "one_shot"}, {**base, "algo": "two_shot"}, {**base, "chunk_rows": 1}]


class _StandInVirtualWorkspace:
    """Serves ipc_fold's virtual-shard calls on CPU with the reference fold of the gathered shards (rank r's slab j
    is shard r*S + j); the variant named `wrong` flips one bit of its result (None: none does). Records which
    variant each call forced."""

    def __init__(self, native, wrong: str | None) -> None:  # noqa: ANN001
        self.native, self.wrong = native, wrong
        self.world_size = native.world_size
        self.ran: list[str] = []

    def virtual_variants(self, dtype: torch.dtype, row_numel: int, max_rows: int, shards: int) -> list[str]:
        return ["one_shot", "two_shot", "chunked"]

    def all_reduce_virtual(self, x: torch.Tensor, *, dtype: torch.dtype, algo: str | None = None,
                           chunk_rows: int | None = None, label: str | None = None) -> torch.Tensor:
        from detcomm.numerics.fold import reference_fold

        variant = algo or ("chunked" if chunk_rows is not None else "")
        self.ran.append(variant)
        shards = self.native.all_gather(x.contiguous()).view(-1, *x.shape[1:])  # [W*S, rows, ...]: shard order
        y = reference_fold(shards, dtype).clone()
        if variant == self.wrong:
            y.view(torch.int16 if dtype != torch.float32 else torch.int32).view(-1)[0] ^= 1
        return y


def job_virtual_variant_checks(rank: int, w: int) -> list[tuple[str | None, bool, str, list[str]]]:
    import torch.distributed as dist

    from detcomm.route_impls.ipc_fold import IpcFoldRoute
    from detcomm.route_impls.native import NativeRoute
    from detcomm.selfcheck import SelfChecks

    native = NativeRoute(dist.group.WORLD)
    site = Site("vs.ar", Collective.ALL_REDUCE, torch.bfloat16, (24,), 64, virtual_shards=12)
    out = []
    for wrong in (None, "one_shot", "two_shot", "chunked"):
        ws = _StandInVirtualWorkspace(native, wrong)
        bound = IpcFoldRoute(ws, resolved=resolve_numerics("rl-bitwise")).bind(site)  # type: ignore[arg-type]
        result = SelfChecks(native=native, device=torch.device("cpu"))(bound)
        out.append((wrong, result.passed, result.key.variant, sorted(set(ws.ran))))
    return out


@pytest.mark.parametrize("cluster", [2, 3], indirect=True, ids=["W2", "W3"])
def test_selfchecks_prove_every_virtual_variant(cluster) -> None:  # noqa: ANN001
    """The self-checks of a virtual-shard ipc_fold site run the default call and every forced variant with V fp32
    inputs against the reference fold of the V shards; a wrong bit in any one variant refuses the route, naming it."""
    for res in cluster.run(job_virtual_variant_checks, timeout_s=300):
        (_, ok, _, ran), *bad = res
        assert ok and ran == ["", "chunked", "one_shot", "two_shot"], res
        for wrong, passed, variant, _ in bad:
            assert not passed and variant == wrong, res
