"""Multi-host groups simulated on one machine (DETCOMM_HOSTS, detcomm/topology.py): the topology, the routes,
the bits and the refusals of a W = 4 gloo group on two named hosts, and `detcomm routes --nodes 2` against it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import oracle
from datagen import ill_bits, to_bits, to_torch
from detcomm.topology import HOSTS_ENV, RankFacts, from_facts, host_name

# (name, dtype, width, max_rows, collective): 1 MiB fp32 at W = 4 is above rs_ag_fold's break-even across hosts
# (667 kB) and below it on one host (3.67 MB); the small site stays on gather_fold either way.
SITES = [("mid", "float32", 512, 512, "all_reduce"), ("small", "bfloat16", 64, 8, "all_reduce"),
         ("rs", "bfloat16", 256, 64, "reduce_scatter")]


def test_host_name_override() -> None:
    assert host_name(2, 4, {HOSTS_ENV: "a,a,b,b"}) == "b"
    assert host_name(0, 4, {HOSTS_ENV: " x , y,y,y "}) == "x"
    import socket

    assert host_name(1, 4, {}) == socket.gethostname()
    with pytest.raises(ValueError, match="names 3 hosts for 4 ranks"):
        host_name(0, 4, {HOSTS_ENV: "a,a,b"})
    with pytest.raises(ValueError, match="one non-empty host per global rank"):
        host_name(0, 4, {HOSTS_ENV: "a,,b,b"})


def test_from_facts_counts_hosts() -> None:
    cpu = [RankFacts(h, -1, "") for h in "aabb"]
    t = from_facts(cpu)
    assert (t.same_host, t.hosts, t.describe()) == (False, 2, "CPU, 2 hosts")
    assert from_facts([RankFacts("a", -1, "")] * 3).describe() == "CPU, one host"
    gpu = from_facts([RankFacts("a", 0, "00000000:1A:00"), RankFacts("b", 0, "00000000:1A:00")])
    assert (gpu.same_host, gpu.hosts, gpu.gpus, gpu.link) == (False, 2, 2, "multi-host")


def job_two_hosts(rank: int, w: int, hosts: str | None) -> dict[str, object]:
    """Init on the named hosts (None: the real one), declare SITES, reduce 'mid' against the oracle, try the
    workspace route forced. Returns what the test compares."""
    import detcomm

    if hosts is not None:
        os.environ[HOSTS_ENV] = hosts
    try:
        comm = detcomm.init(numerics="rl-bitwise")
        try:
            dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}
            for name, dtype, width, rows, coll in SITES:
                comm.site(name, collective=coll, dtype=dt[dtype], shape=(width,), max_rows=rows)
            inputs = [ill_bits(300, 512, "float32", seed=17, rank=r) for r in range(w)]
            got = to_bits(detcomm.all_reduce(to_torch(inputs[rank], "float32"), site="mid"))
            try:
                comm.site("forced", collective="all_reduce", dtype=torch.bfloat16, shape=(8,), max_rows=4,
                          route="ipc_fold")
                forced = "accepted"
            except ValueError as e:
                forced = str(e)
            table = {d["site"]: (d["route"], d["why"]) for d in comm.routes().as_dicts()}
            return {"hosts": comm.caps.hosts, "topology": comm.caps.topology, "table": table, "forced": forced,
                    "bits_ok": bool(np.array_equal(got, oracle.fold_oracle(inputs, "float32"))),
                    "bits": got.tobytes()}
        finally:
            detcomm.shutdown()
    finally:
        os.environ.pop(HOSTS_ENV, None)


def job_bad_hosts(rank: int, w: int) -> str:
    import detcomm

    os.environ[HOSTS_ENV] = "a,b"
    try:
        detcomm.init(numerics="rl-bitwise")
    except ValueError as e:
        return str(e)
    finally:
        os.environ.pop(HOSTS_ENV, None)
    detcomm.shutdown()
    return "init accepted a DETCOMM_HOSTS of the wrong length"


def _static(capsys: pytest.CaptureFixture[str], nodes: int) -> dict[str, tuple[str, str]]:
    from detcomm.cli import main

    short = {"float32": "fp32", "bfloat16": "bf16"}
    specs = [f"{n}:{c}:{short[d]}:{wd}:{r}" for n, d, wd, r, c in SITES]
    assert main(["routes", "--numerics", "rl-bitwise", "--backend", "gloo", "--world-size", "4", "--nodes",
                 str(nodes), "--json", *[x for s in specs for x in ("--site", s)]]) == 0
    return {r["site"]: (r["route"], r["why"]) for r in json.loads(capsys.readouterr().out)}


def test_two_simulated_hosts(cluster4, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    two = cluster4.run(job_two_hosts, "a,a,b,b", timeout_s=600)
    one = cluster4.run(job_two_hosts, None, timeout_s=600)
    for res, hosts, topo in ((two, 2, "CPU, 2 hosts"), (one, 1, "CPU, one host")):
        assert all(r["bits_ok"] for r in res) and len({r["bits"] for r in res}) == 1
        r0 = res[0]
        assert (r0["hosts"], r0["topology"]) == (hosts, topo)
        assert all(r["table"] == r0["table"] for r in res)
    t2, t1 = two[0]["table"], one[0]["table"]
    assert [t2[s][0] for s in ("mid", "small", "rs")] == ["rs_ag_fold", "gather_fold", "a2a_fold"]
    assert [t1[s][0] for s in ("mid", "small", "rs")] == ["gather_fold", "gather_fold", "a2a_fold"]
    # The workspace is never armed across hosts, and the table says so; forcing it is refused with the reason.
    assert all("ranks on several hosts: CUDA IPC does not cross hosts" in t2[s][1] for s in ("mid", "small", "rs"))
    assert "route='ipc_fold' is unavailable: ranks on several hosts" in two[0]["forced"]
    # The same bits on one host and on two (gather_fold there, rs_ag_fold here).
    assert two[0]["bits"] == one[0]["bits"]
    # `detcomm routes --nodes N` prints the live group's table.
    assert {s: t2[s] for s in ("mid", "small", "rs")} == _static(capsys, 2)
    assert {s: t1[s] for s in ("mid", "small", "rs")} == _static(capsys, 1)


def test_wrong_hosts_refused(cluster4) -> None:  # noqa: ANN001
    msgs = cluster4.run(job_bad_hosts)
    assert all("DETCOMM_HOSTS='a,b' names 2 hosts for 4 ranks" in m for m in msgs), msgs[0]
