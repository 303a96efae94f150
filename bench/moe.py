"""Cost of the deterministic MoE collectives: ``detcomm.moe`` dispatch + slot-order combine against a plain
expert-parallel all-to-all pair and a weighted sum in the dtype (what engines run), at decode and prefill token
counts.

    python bench/moe.py --quick                       # CPU: gloo, W=4, small hidden (~1 min)
    python bench/moe.py                               # hidden 4096, 64 experts, top-8
    python bench/moe.py --device cuda                 # NCCL, one rank per GPU

Both paths route the same tokens with the same placement (random, with replicas) and the same replica rule,
and both exchange the per-rank counts; the experts are the identity (expert output = the dispatched row), so
the numbers are communication plus combine arithmetic only. ``detcomm`` = ``moe_dispatch`` (counts, then rows +
16 bytes of metadata per slot in one uneven all-to-all) + ``moe_combine`` (the rows back, whose counts are the
dispatch's: no second count exchange, + the fp32 slot-order fold);
``plain`` = counts + rows out + rows back (``torch.distributed.all_to_all_single``) + ``(w * y).sum(1)`` in the
dtype. On CPU each rank runs one torch thread. Each sample is one call from an aligned start (a barrier; on GPUs the device is synchronized after the
call: both paths need the counts on the host). Rank 0's median, p10 and p90 are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from detcomm._spawn import LocalCluster
from detcomm.tables import format_table

QUICK = {"nproc": 4, "hidden": 256, "experts": 8, "top_k": 4, "tokens": [1, 8, 64, 2048], "iters": 20}
FULL = {"hidden": 4096, "experts": 64, "top_k": 8, "tokens": [1, 8, 64, 2048], "iters": 30}


def _plain(tokens, ids, weights, placement, rank: int, w: int):  # type: ignore[no-untyped-def]
    """Engines' path: counts, rows out, rows back, then the weighted sum over slots in the dtype."""
    import torch
    import torch.distributed as dist

    T, k = ids.shape
    flat = ids.reshape(-1)
    pos = torch.arange(T * k, device=tokens.device)
    dest = placement.replica_ranks(flat, pos // k + rank)
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=w)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    ins, outs = send_counts.tolist(), recv_counts.tolist()
    send = tokens[pos[order] // k]
    recv = send.new_empty(sum(outs), tokens.shape[1])
    dist.all_to_all_single(recv, send, outs, ins)
    back = torch.empty_like(send)
    dist.all_to_all_single(back, recv, ins, outs)  # identity experts: the rows go straight back
    y = torch.empty_like(back)
    y[order] = back
    return (weights.to(tokens.dtype).unsqueeze(2) * y.view(T, k, -1)).sum(dim=1)


def job(rank: int, w: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    import detcomm
    from detcomm.bench.timing import summarize, synced, time_cpu
    from detcomm.moe import Placement, moe_combine, moe_dispatch, moe_site

    if cfg["device"] == "cpu":
        torch.set_num_threads(1)  # W ranks share the machine's cores: no oversubscription for either path
    detcomm.shutdown()
    comm = detcomm.init(numerics="rl-bitwise")
    dev, cuda = comm.device, comm.device.type == "cuda"
    dtype = torch.bfloat16
    H, E, k = cfg["hidden"], cfg["experts"], cfg["top_k"]
    placement = Placement.random(E, w, seed=7, max_replicas=min(2, w))
    site = moe_site("bench.moe", dtype=dtype, hidden=H, top_k=k, max_tokens=max(cfg["tokens"]))
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for T in cfg["tokens"]:
        tokens = torch.randn(T, H, generator=gen).to(dev, dtype)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(dev)
        weights = torch.softmax(torch.randn(T, k, generator=gen), dim=1).to(dev)

        def ours() -> object:
            d = moe_dispatch(tokens, ids, placement=placement, site=site)
            return moe_combine(d.rows, weights, d.handle, site=site)

        def plain() -> object:
            return _plain(tokens, ids, weights, placement, rank, w)

        res: dict[str, list[float]] = {"detcomm": [], "plain": []}
        # Interleaved in rounds so a drift of the machine's load does not land on one path.
        for _ in range(2):
            for name, fn in (("detcomm", ours), ("plain", plain)):
                res[name] += time_cpu(synced(fn, cuda=cuda), iters=cfg["iters"] // 2, warmup=2, barrier=dist.barrier)
        s = {name: summarize(v) for name, v in res.items()}
        rows.append({"tokens": T, "hidden": H, "experts": E, "top_k": k, "world_size": w, "device": str(dev),
                     "dtype": "bf16", **{f"{n}_{q}": s[n][q] for n in s for q in ("median_us", "p10_us", "p90_us")},
                     "ratio": s["detcomm"]["median_us"] / s["plain"]["median_us"]})
    detcomm.shutdown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"small CPU run: {QUICK}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one rank per GPU")
    p.add_argument("--nproc", type=int, help="ranks (default: 4 on CPU, every GPU on cuda)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--tokens", help="comma-separated token counts per rank (default 1,8,64,2048)")
    p.add_argument("--iters", type=int)
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args()
    cfg = dict(QUICK if a.quick else FULL)
    for key in ("hidden", "experts", "top_k", "iters"):
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    cfg["device"] = a.device
    if a.tokens:
        cfg["tokens"] = [int(t) for t in a.tokens.split(",")]
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device")
        nproc = a.nproc or torch.cuda.device_count()
        backend = "nccl"
    else:
        nproc, backend = a.nproc or cfg.get("nproc", 4), "gloo"
    print(f"MoE dispatch+combine vs plain all_to_all+sum: {backend} W={nproc}, hidden {cfg['hidden']}, "
          f"{cfg['experts']} experts (random placement with replicas), top-{cfg['top_k']}, bf16, identity experts, "
          f"median of {cfg['iters']} calls (p10..p90) per token count")
    # NCCL reads NCCL_ALGO/NCCL_PROTO when the ranks' communicator is created: give them rl-bitwise's environment.
    from detcomm.envelope import envelope_environment

    with LocalCluster(nproc, backend=backend, pg_timeout_s=300, env=envelope_environment("rl-bitwise")) as cluster:
        rows = cluster.run(job, cfg, timeout_s=1800)[0]
    print(format_table(("tokens", "detcomm us", "(p10..p90)", "plain us", "(p10..p90)", "ratio"),
                       [[r["tokens"], f"{r['detcomm_median_us']:.1f}", f"{r['detcomm_p10_us']:.0f}..{r['detcomm_p90_us']:.0f}",
                         f"{r['plain_median_us']:.1f}", f"{r['plain_p10_us']:.0f}..{r['plain_p90_us']:.0f}",
                         f"{r['ratio']:.2f}"] for r in rows], align="rrrrrr"))
    if backend == "gloo":
        print("(CPU timings on a shared machine are noise beyond a factor of about 2)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": cfg, "rows": rows, "median_ratio": statistics.median(r["ratio"] for r in rows)}, f,
                      indent=1)


if __name__ == "__main__":
    main()
