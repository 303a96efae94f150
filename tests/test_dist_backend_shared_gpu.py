"""The "detcomm" backend's CUDA transport on ranks that share a GPU, the parts that run without one.

* ``transport_for``: the decision as a pure function of the ranks' (host, GPU) facts, W = 2, 3 (two of three ranks
  on one GPU) and 4, one and two hosts, NCCL present or not.
* The facts exchange (``_gather_facts``: two all-gathers on the group's gloo backend) at W = 3 with simulated hosts.
* ``_HostStaged``, the host-memory transport, at W = 3 on CPU tensors: every collective it serves writes the
  expected values back into the caller's tensors (exact: integers and data movement), each through a separate host
  buffer, as on CUDA. What needs a GPU (the copies from and to the device, the workspace, capture) is in
  tests/gpu/test_trainers_shared_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from detcomm.dist_backend import HOST, NCCL, transport_for
from detcomm.topology import RankFacts

BUS_A, BUS_B = "00000000:19:00", "00000000:3B:00"


def _facts(*spec: tuple[str, str]) -> list[RankFacts]:
    return [RankFacts(host, 0, bus) for host, bus in spec]


def test_one_rank_per_gpu_takes_nccl() -> None:
    t, why = transport_for(_facts(("h", BUS_A), ("h", BUS_B)), nccl_available=True)
    assert t == NCCL and "one rank per GPU" in why


def test_two_ranks_on_one_gpu_take_the_host() -> None:
    t, why = transport_for(_facts(("h", BUS_A), ("h", BUS_A)), nccl_available=True)
    assert t == HOST and "ranks 0, 1 on GPU " + BUS_A in why and "NCCL refuses" in why


def test_w3_two_of_three_ranks_on_one_gpu() -> None:
    """One shared GPU is enough: the whole group goes through the host, and the reason names the pair."""
    t, why = transport_for(_facts(("h", BUS_A), ("h", BUS_B), ("h", BUS_A)), nccl_available=True)
    assert t == HOST and "ranks 0, 2 on GPU " + BUS_A in why and "1" not in why.split("(")[1].split("GPU")[0]


def test_w4_two_ranks_on_each_of_two_gpus() -> None:
    t, why = transport_for(_facts(("h", BUS_A), ("h", BUS_A), ("h", BUS_B), ("h", BUS_B)), nccl_available=True)
    assert t == HOST and "ranks 0, 1" in why and "ranks 2, 3" in why


def test_the_same_bus_id_on_two_hosts_is_two_gpus() -> None:
    t, _ = transport_for(_facts(("a", BUS_A), ("b", BUS_A), ("c", BUS_A)), nccl_available=True)
    assert t == NCCL


def test_no_nccl_takes_the_host() -> None:
    t, why = transport_for(_facts(("h", BUS_A), ("h", BUS_B), ("h", "00000000:5D:00")), nccl_available=False)
    assert t == HOST and "NCCL is not available" in why


def test_no_facts_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="no ranks"):
        transport_for([], nccl_available=True)


def job_staged(rank: int, w: int) -> dict[str, object]:
    """The facts exchange and every ``_HostStaged`` collective on CPU tensors of a "detcomm" group's gloo backend."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import (
        AllgatherOptions,
        AllreduceOptions,
        AllToAllOptions,
        BroadcastOptions,
        GatherOptions,
        ReduceOptions,
        ReduceScatterOptions,
        ScatterOptions,
    )

    import detcomm.dist_backend as db

    pg = dist.new_group(backend="detcomm")
    out: dict[str, object] = {}
    hosts = ",".join("ab"[r % 2] for r in range(dist.get_world_size()))
    old = os.environ.get("DETCOMM_HOSTS")
    os.environ["DETCOMM_HOSTS"] = hosts
    try:
        out["facts"] = [(f.host, f.device_index, f.pci_bus_id) for f in pg._gather_facts(torch.device("cpu"))]
    finally:
        if old is None:
            del os.environ["DETCOMM_HOSTS"]
        else:
            os.environ["DETCOMM_HOSTS"] = old
    st = db._HostStaged(pg._gloo, "test")
    mine = lambda r: torch.arange(w * 2, dtype=torch.int64) + 100 * r  # noqa: E731
    every = [mine(r) for r in range(w)]
    ok = out["ok"] = {}

    x = mine(rank)
    st.allreduce([x], AllreduceOptions()).wait()
    ok["allreduce"] = x.equal(sum(every))
    x, ro = mine(rank), ReduceOptions()
    ro.rootRank = 1
    st.reduce([x], ro).wait()
    ok["reduce"] = rank != 1 or x.equal(sum(every))  # only the root's result is defined (gloo reuses the others)
    y = torch.empty(2, dtype=torch.int64)
    st._reduce_scatter_base(y, mine(rank), ReduceScatterOptions()).wait()
    ok["reduce_scatter"] = y.equal(sum(every)[2 * rank : 2 * rank + 2])
    g = torch.empty(w * 2 * w, dtype=torch.int64)
    st._allgather_base(g, mine(rank), AllgatherOptions()).wait()
    ok["allgather_base"] = g.equal(torch.cat(every))
    lst = [torch.empty(w * 2, dtype=torch.int64) for _ in range(w)]
    st.allgather([lst], [mine(rank)], AllgatherOptions()).wait()
    ok["allgather"] = all(a.equal(b) for a, b in zip(lst, every))
    x, bo = mine(rank), BroadcastOptions()
    bo.rootRank = 2
    st.broadcast([x], bo).wait()
    ok["broadcast"] = x.equal(every[2])
    a2a = torch.empty(w * 2, dtype=torch.int64)
    st.alltoall_base(a2a, mine(rank), [], [], AllToAllOptions()).wait()
    ok["alltoall_base"] = a2a.equal(torch.cat([e[2 * rank : 2 * rank + 2] for e in every]))
    outs = [torch.empty(2, dtype=torch.int64) for _ in range(w)]
    st.alltoall(outs, list(mine(rank).chunk(w)), AllToAllOptions()).wait()
    ok["alltoall"] = torch.cat(outs).equal(a2a)
    go = GatherOptions()
    go.rootRank = 0
    gat = [[torch.empty(w * 2, dtype=torch.int64) for _ in range(w)]] if rank == 0 else []
    st.gather(gat, [mine(rank)], go).wait()
    ok["gather"] = rank != 0 or all(a.equal(b) for a, b in zip(gat[0], every))
    so = ScatterOptions()
    so.rootRank = 0
    sc = torch.empty(w * 2, dtype=torch.int64)
    st.scatter([sc], [every] if rank == 0 else [], so).wait()
    ok["scatter"] = sc.equal(every[rank])
    if rank == 0:
        st.send([mine(0)], 1, 7).wait()
    elif rank == 1:
        r1 = torch.empty(w * 2, dtype=torch.int64)
        st.recv([r1], 0, 7).wait()
        ok["send/recv"] = r1.equal(every[0])
    return out


def test_facts_exchange_and_host_staged_collectives_w3() -> None:
    from clusters import get_cluster

    res = get_cluster(3).run(job_staged)
    for r in res:
        assert r["facts"] == [("a", -1, ""), ("b", -1, ""), ("a", -1, "")]
        assert all(r["ok"].values()), r["ok"]  # type: ignore[union-attr]
    assert "send/recv" in res[1]["ok"]  # type: ignore[operator]
