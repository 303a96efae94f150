"""The workspace all-reduce in place (out=x): the site-bound kernels write x itself, with no copy, and the bits
are the canonical fold's (tests/oracle.py) on every kernel a site can reach: one-store, one-shot, two-shot and chunked.

Why it is exact (Workspace.bind_all_reduce): in every launch the thread that writes an element of the output is
the one that copied that element of the input into its slot, before the START barrier; chunks cover disjoint
rows. Tested twice: W ranks as W streams of one GPU (W = 3, where the rank order matters; small one-store and
one-shot thresholds and capacity so every kernel and chunking run), and through the public API on two GPUs over
NCCL, eager and captured in a CUDA graph. Negative control: every rank's input differs from the result, so a
kernel that left x alone, or a call that wrote its result elsewhere, fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import on_ranks, recorded_in_process
from payloads import first_mismatch, from_tensor, ill_conditioned, to_tensor

import oracle
from datagen import ill_bits, to_bits, to_torch
from detcomm._spawn import LocalCluster

pytestmark = pytest.mark.gpu

TRAILING = 40  # 80 B bf16 rows: rows start on 16 B boundaries only every few rows


@pytest.mark.parametrize("world", [3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_site_bound_all_reduce_in_place_every_kernel(world: int, dtype: str) -> None:
    views = recorded_in_process(world, device="cuda:0", capacity_bytes=64 * 1024, max_rows_armed=4096,
                                one_shot_max_bytes=4096, one_store_max_bytes=1024)
    try:
        tdt = getattr(torch, dtype)
        calls = [v.bind_all_reduce(tdt, TRAILING, label="in_place") for v in views]
        streams = [torch.cuda.Stream() for _ in views]
        for v in views:
            v.variants_run.clear()
        rng = np.random.default_rng(7 * world)
        row_bytes = TRAILING * torch.empty((), dtype=tdt).element_size()
        # one-store (<= 1 KiB), one-shot (<= 4 KiB), two-shot (one launch) and chunked launches
        for rows in (1, 7, 2048 // row_bytes + 1, 4096 // row_bytes + 5, 3 * (64 * 1024 // row_bytes) + 11):
            bits = ill_conditioned(rng, world, (rows, TRAILING), dtype)
            want = oracle.fold_oracle(bits, dtype)
            xs = [to_tensor(b, dtype, "cuda:0") for b in bits]
            ptrs = [x.data_ptr() for x in xs]
            outs = on_ranks(streams, lambda r: calls[r](xs[r], xs[r]))
            for r, (x, out) in enumerate(zip(xs, outs)):
                assert out is x and x.data_ptr() == ptrs[r]
                got = from_tensor(x)
                assert not np.array_equal(bits[r], want), "negative control: an input equals the result"
                assert np.array_equal(got, want), f"W={world} {dtype} rows={rows} rank {r}: {first_mismatch(got, want)}"
        ran = {v for _, d, v in views[0].variants_run if d == dtype}
        assert ran == {"one_store", "one_shot", "two_shot", "chunked"}, ran
    finally:
        for v in views:
            v.close()


def job_workspace_in_place(rank: int, w: int) -> list[str]:
    import detcomm

    comm = detcomm.init(numerics="rl-bitwise", workspace_bytes=64 * 1024)
    dev = comm.device
    problems: list[str] = []
    # 64 KiB per launch: 256 rows of 1000 bf16 take 8 chunked launches (two ranks on two GPUs always take
    # one-shot; two-shot in place is the in-process test's).
    width, rows = 1000, 256
    detcomm.site("ip.ar", collective="all_reduce", dtype=torch.bfloat16, shape=(width,), max_rows=rows)
    route = detcomm.routes().entries[0].decision.route.value
    if route != "ipc_fold":
        return [f"ip.ar took {route}: {comm.caps.workspace_reason}"]
    seen: list = []
    sc = comm._site_calls["ip.ar"]
    inner = sc.bound
    sc.bound = lambda x, a: (seen.append(a.out), inner(x, a))[1]
    for n in (1, 37, rows):
        bits = [ill_bits(n, width, "bfloat16", seed=10 + n, rank=r) for r in range(w)]
        x = to_torch(bits[rank], "bfloat16").to(dev)
        ptr = x.data_ptr()
        got = detcomm.all_reduce(x, "ip.ar", out=x)
        torch.cuda.synchronize()
        if got is not x or x.data_ptr() != ptr or not np.array_equal(to_bits(x), oracle.fold_oracle(bits, "bfloat16")):
            problems.append(f"{n} rows: in place is not the canonical fold in x")
        if seen[-1] is not x:
            problems.append(f"{n} rows: the route was not handed x (the communicator copied)")
    # Captured in place, replayed with new values.
    x = to_torch(ill_bits(4, width, "bfloat16", seed=50, rank=rank), "bfloat16").to(dev)
    detcomm.all_reduce(x, "ip.ar", out=x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        detcomm.all_reduce(x, "ip.ar", out=x)
    for seed in (51, 52):
        bits = [ill_bits(4, width, "bfloat16", seed=seed, rank=r) for r in range(w)]
        x.copy_(to_torch(bits[rank], "bfloat16").to(dev))
        graph.replay()
        torch.cuda.synchronize()
        if not np.array_equal(to_bits(x), oracle.fold_oracle(bits, "bfloat16")):
            problems.append(f"captured in place, seed {seed}: differs from the oracle")
        if np.array_equal(to_bits(x), bits[rank]):
            problems.append("negative control: x still holds its input after the replay")
    detcomm.shutdown()
    return problems


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_workspace_all_reduce_in_place_without_a_copy() -> None:
    from detcomm.envelope import envelope_environment

    with LocalCluster(2, backend="nccl", pg_timeout_s=60, env=envelope_environment("rl-bitwise")) as c:
        assert c.run(job_workspace_in_place, timeout_s=180) == [[]] * 2
