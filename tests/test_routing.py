"""Routing in one place: Router.route is the runtime's only way to resolve a site, and every route implementation
binds sites to objects that satisfy the BoundRoute protocol."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from detcomm.envelope import resolve_numerics
from detcomm.errors import RouteRefused
from detcomm.numerics.fold import select_leaf
from detcomm.route import Router
from detcomm.route_impls import A2AFoldRoute, GatherFoldRoute, NativeRoute
from detcomm.sites import _CARRIES, NO_ARGS, BoundRoute, CallArgs, Capabilities, Collective, ReduceOp, Route, Site

CPU1 = Capabilities(backend="gloo", device_type="cpu", world_size=1)


class _Verdict(NamedTuple):
    """A planted self-check outcome: the fields routing reads (detcomm.route.Verdict)."""

    passed: bool
    reason: str
    label: str
    site_only: bool = False


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group: enough to bind and call every CPU route in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _site(coll: Collective, *, dtype=torch.float32, op=ReduceOp.SUM, shape=(5,)) -> Site:
    if coll is Collective.ARGMAX:
        op = ReduceOp.MAX
    return Site(f"t.{coll.value}", coll, dtype, shape, 8, op)


def test_every_route_impl_binds_what_it_carries_to_a_bound_route(group) -> None:
    native = NativeRoute(group)
    leaf = select_leaf(device_type="cpu", required=frozenset())
    impls = {Route.NATIVE: native, Route.GATHER_FOLD: GatherFoldRoute(native, leaf),
             Route.A2A_FOLD: A2AFoldRoute(native, leaf)}
    x = torch.randn(4, 5)
    for route, impl in impls.items():
        assert impl.route is route
        for coll in _CARRIES[route]:
            bound = impl.bind(_site(coll))
            assert isinstance(bound, BoundRoute), (route, coll)
            assert bound.route is route and bound.site.collective is coll
            args = {Collective.TOKEN_ALL_GATHER: CallArgs(rows_per_rank=(4,)),
                    Collective.ALL_TO_ALL: CallArgs(in_splits=(4,), out_splits=(4,))}.get(coll, NO_ARGS)
            out = bound(x, args)
            if coll is Collective.ARGMAX:
                assert torch.equal(out, torch.argmax(x, dim=-1))
            else:  # one rank: every collective returns its input's bits (a fold of one input is that input)
                assert torch.equal(out.view(torch.int32), x.view(torch.int32)), (route, coll)


def test_binding_a_collective_the_route_cannot_carry_is_a_routing_bug(group) -> None:
    native = NativeRoute(group)
    fold = A2AFoldRoute(native, select_leaf(device_type="cpu", required=frozenset()))
    with pytest.raises(AssertionError, match="cannot carry all_reduce"):
        fold.bind(_site(Collective.ALL_REDUCE))


class _Recorder:
    """A route implementation whose bound calls return a marker, and a checker that refuses chosen routes."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.bound: list[Site] = []

    def bind(self, site: Site) -> BoundRoute:
        from detcomm.route_impls import Bound

        self.bound.append(site)
        return Bound(self.route, site, lambda x, a: x)


def _auto(refuse: set[Route], *, checks: list[str]) -> Router:
    def checker(bound: BoundRoute) -> _Verdict:
        checks.append(f"{bound.route.value}:{bound.site.name}")
        return _Verdict(bound.route not in refuse, "planted failure", f"{bound.route.value} check")

    impls = {r: _Recorder(r) for r in (Route.NATIVE, Route.GATHER_FOLD, Route.A2A_FOLD)}
    return Router(resolve_numerics("rl-bitwise"), CPU1, impls=impls, checker=checker)


def test_route_checks_remembers_refusals_and_falls_back_only_to_a_canonical_route() -> None:
    checks: list[str] = []
    gpu = Capabilities(backend="nccl", device_type="cuda", world_size=1, workspace=True, workspace_max_rows=64)
    impls = {r: _Recorder(r) for r in Route}

    def checker(bound: BoundRoute) -> _Verdict:
        checks.append(bound.route.value)
        return _Verdict(bound.route is not Route.IPC_FOLD, "planted failure", "ipc check")

    auto = Router(resolve_numerics("rl-bitwise"), gpu, impls=impls, checker=checker)
    s1 = Site("a", Collective.ALL_REDUCE, torch.bfloat16, (8,), 16)
    assert auto.decide(s1).route is Route.IPC_FOLD  # the static view
    b1 = auto.route(s1)
    assert b1.route is Route.GATHER_FOLD and checks == ["ipc_fold", "gather_fold"]
    entry = auto.table([s1]).entries[0]
    assert entry.selfcheck == "passed" and "refused: ipc_fold" in entry.decision.why
    # The refusal holds for the collective on every dtype and shape: no second ipc_fold check.
    s2 = Site("b", Collective.ALL_REDUCE, torch.float32, (3,), 4)
    assert auto.route(s2).route is Route.GATHER_FOLD and checks == ["ipc_fold", "gather_fold", "gather_fold"]
    # Cached per site: no further checks, the same bound object.
    assert auto.route(s1) is b1 and len(checks) == 3
    # A site routing never resolved shows its static decision.
    s3 = Site("c", Collective.REDUCE_SCATTER, torch.float32, (3,), 4)
    assert auto.table([s3]).entries[0].selfcheck == "static"


def test_route_refused_on_every_candidate_raises() -> None:
    checks: list[str] = []
    auto = _auto({Route.GATHER_FOLD}, checks=checks)
    with pytest.raises(RouteRefused, match="gather_fold: gather_fold check: planted failure"):
        auto.route(Site("x", Collective.ALL_REDUCE, torch.float32, (3,), 4))


def test_route_without_claim_is_not_checked() -> None:
    checks: list[str] = []
    auto = _auto(set(), checks=checks)
    assert auto.route(Site("g", Collective.ALL_GATHER, torch.float32, (3,), 4)).route is Route.NATIVE
    assert checks == []
    assert auto.route(Site("m", Collective.ALL_REDUCE, torch.float32, (3,), 4, ReduceOp.MAX)).route is Route.NATIVE
    assert checks == ["native:m"]  # MAX on keys claims exact bits: checked


def test_route_table_says_when_a_site_is_chunked() -> None:
    caps = Capabilities(backend="nccl", device_type="cuda", world_size=2, workspace=True, workspace_max_rows=2048,
                        workspace_bytes=16 << 20)
    auto = Router(resolve_numerics("rl-bitwise"), caps)
    wide = Site("o", Collective.ALL_REDUCE, torch.bfloat16, (8192,), 2048)
    assert "2 launches per call at max_rows" in auto.decide(wide).why
    narrow = Site("n", Collective.ALL_REDUCE, torch.bfloat16, (4096,), 2048)
    assert "launches" not in auto.decide(narrow).why


def test_topology_from_rank_facts() -> None:
    from detcomm.topology import RankFacts, from_facts

    a, b = RankFacts("h1", 0, "00000000:1B:00"), RankFacts("h1", 1, "00000000:2C:00")
    assert from_facts([a, a]).link == "same GPU"
    two = from_facts([a, b])
    assert two.same_host and two.gpus == 2 and two.link == ""  # the link is NVML's to tell
    multi = from_facts([a, RankFacts("h2", 0, "00000000:1B:00")])
    assert not multi.same_host and multi.link == "multi-host" and multi.gpus == 2
