"""The static rule that gives an all-reduce site rs_ag_fold (route.py, docs/spec.md §3), without a group.

The expected break-even is restated here from docs/spec.md §3 (M = a·B·W/((W-1)(W-2)), a·B = 5.5 MB on one host
and 1.0 MB across hosts), not read from the package.
"""

from __future__ import annotations

import json

import pytest
import torch

from detcomm.envelope import resolve_numerics
from detcomm.route import Router
from detcomm.sites import Capabilities, Collective, ReduceOp, Route, Site

LINK = {1: 5_500_000, 2: 1_000_000}


def _break_even(w: int, hosts: int) -> int:
    return -(-LINK[min(hosts, 2)] * w // ((w - 1) * (w - 2)))


def _auto(w: int, hosts: int = 1, **caps: object) -> Router:
    c = Capabilities(backend="gloo", device_type="cpu", world_size=w, hosts=hosts, **caps)  # type: ignore[arg-type]
    return Router(resolve_numerics("rl-bitwise"), c)


def _site(nbytes_rows: int, coll: Collective = Collective.ALL_REDUCE, op: ReduceOp = ReduceOp.SUM) -> Site:
    return Site("s", coll, torch.float32, (1,), nbytes_rows, op)  # one fp32 per row: 4 bytes a row


@pytest.mark.parametrize("w", [3, 4, 8, 16, 64])
@pytest.mark.parametrize("hosts", [1, 2])
def test_break_even_boundary(w: int, hosts: int) -> None:
    auto = _auto(w, hosts)
    need = _break_even(w, hosts)
    at = _site(-(-need // 4))  # the first row count whose bytes reach the break-even
    below = _site((need - 1) // 4)
    assert auto.decide(at).route is Route.RS_AG_FOLD, auto.decide(at).why
    assert f"break-even {need} B" in auto.decide(at).why
    d = auto.decide(below)
    assert d.route is Route.GATHER_FOLD and f"below rs_ag_fold's break-even {need} B" in d.why
    # The fallback after rs_ag_fold is gather_fold: the same canonical bits.
    assert [c.route for c in auto.candidates(at)] == [Route.RS_AG_FOLD, Route.GATHER_FOLD]


def test_w2_never_and_hosts_lower_the_break_even() -> None:
    huge = _site(1 << 28)
    assert _auto(2).decide(huge).route is Route.GATHER_FOLD and "W=2" in _auto(2).decide(huge).why
    assert _auto(2, hosts=2).decide(huge).route is Route.GATHER_FOLD
    one_mib = _site(1 << 18)
    assert _auto(4).decide(one_mib).route is Route.GATHER_FOLD
    two = _auto(4, hosts=2).decide(one_mib)
    assert two.route is Route.RS_AG_FOLD and "2 hosts" in two.why
    # Negative control of the restated rule: a break-even one host too high would call this boundary wrong.
    assert _auto(8).decide(_site(-(-_break_even(8, 1) // 4) - 1)).route is Route.GATHER_FOLD


def test_which_sites_take_it() -> None:
    auto = _auto(4)
    big = 1 << 22
    assert auto.decide(_site(big, op=ReduceOp.AVG)).route is Route.RS_AG_FOLD
    assert auto.decide(_site(big, Collective.ALL_REDUCE_RMSNORM)).route is Route.RS_AG_FOLD
    assert auto.decide(_site(big * 4, Collective.REDUCE_SCATTER)).route is Route.A2A_FOLD
    assert auto.decide(_site(big, op=ReduceOp.MAX)).route is Route.NATIVE
    v = Site("v", Collective.ALL_REDUCE, torch.float32, (1,), big, virtual_shards=8)
    assert auto.decide(v).route is Route.GATHER_FOLD  # virtual-shard sites keep their own rule (§9.1)
    auto_env = Router(resolve_numerics("auto"), Capabilities(backend="gloo", device_type="cpu", world_size=4))
    assert auto_env.decide(_site(big)).route is Route.NATIVE
    with pytest.raises(ValueError, match="cannot carry reduce_scatter"):
        Site("r", Collective.REDUCE_SCATTER, torch.float32, (1,), 8, route=Route.RS_AG_FOLD)


def test_workspace_first_where_it_serves() -> None:
    auto = Router(
        resolve_numerics("rl-bitwise"),
        Capabilities(backend="nccl", device_type="cuda", world_size=8, workspace=True, workspace_max_rows=2048,
                     workspace_bytes=32 << 20))
    site = Site("o", Collective.ALL_REDUCE, torch.bfloat16, (4096,), 2048)
    assert [c.route for c in auto.candidates(site)] == [Route.IPC_FOLD, Route.RS_AG_FOLD, Route.GATHER_FOLD]


def test_cli_nodes_matches_the_router(capsys: pytest.CaptureFixture[str]) -> None:
    from detcomm.cli import main

    sites = ["a:all_reduce:bf16:4096:2048", "b:all_reduce:fp32:512:512", "c:all_reduce:bf16:64:8",
             "r:reduce_scatter:bf16:4096:64"]
    argv = ["routes", "--numerics", "rl-bitwise", "--backend", "nccl", "--world-size", "16", "--nodes", "2", "--json"]
    assert main([*argv, *[x for s in sites for x in ("--site", s)]]) == 0
    rows = {r["site"]: r for r in json.loads(capsys.readouterr().out)}
    auto = Router(resolve_numerics("rl-bitwise"), Capabilities(
        backend="nccl", device_type="cuda", world_size=16, hosts=2,
        workspace_reason="ranks on several hosts: CUDA IPC does not cross hosts"))
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for spec in sites:
        name, coll, dtype, width, rows_ = spec.split(":")
        d = auto.decide(Site(name, Collective(coll), dt[dtype], (int(width),), int(rows_)))
        assert (rows[name]["route"], rows[name]["why"]) == (d.route.value, d.why)
    assert [rows[s]["route"] for s in "abcr"] == ["rs_ag_fold", "rs_ag_fold", "gather_fold", "a2a_fold"]
    assert main(["routes", "--world-size", "2", "--nodes", "3"]) == 2
