"""Benchmarks of the CUDA-IPC workspace kernels.

    python bench/ipc_kernels.py --out results/workspace [--modes fold,latency,nccl] [--quick]

writes results/workspace.md (tables) and results/workspace.json (every row).

Modes:
- fold: one GPU. The canonical-fold kernel over W local buffers (csrc/fold_local.cu, the fold every collective
  runs) against a device-to-device copy measured in the same run. Bytes counted for the fold: W inputs read + one
  output written; for the copy: read + write. Goal: fold >= 85% of the copy's bandwidth.
- latency: one GPU, W ranks as W streams of this process (Workspace.in_process). One-store (forced on, up to 256
  KiB: by default ranks sharing a GPU never take it), one-shot and two-shot all-reduce latency at W = 2, 4, 8 for 16 KiB .. 64 MiB
  (bf16 messages), eager and as CUDA-graph replay. The W ranks share the GPU's SMs and HBM, so large-message times
  are a lower bound on what W GPUs over NVLink would give, not a prediction of it. W = 1 (pass --worlds 1) adds a
  device-to-device copy of the same bytes ("copy"): the local pass against the copy.
- nccl: only where torch sees >= 2 GPUs: one process per GPU, the workspace over CUDA IPC against NCCL
  all_reduce (NCCL's default, and NCCL_ALGO=Ring NCCL_PROTO=Simple), eager and graph, same sizes; beside them
  what a caller pays through the public API (`detcomm.all_reduce` on a site routed to the workspace: "detcomm"
  with an output buffer, "detcomm_inplace" with out=x), and, at the smallest size, the host time of one eager
  call of each (mode "host"). gather_fold (the public call on a site routed to gather_fold) is timed eager; with
  --gather-graph also captured in a CUDA graph.
--one-store-grid N runs the raw workspace's one-store launches on N blocks instead of the whole grid (the public-API
rows keep the default).

Medians over repeats, timed with CUDA events. The multicast-off variables of docs/spec.md §8 are set here and inherited
by every child process.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from pathlib import Path
from typing import Any

from detcomm.envelope import MULTICAST_OFF_ENV as MULTICAST_OFF  # torch-free: set before torch loads

os.environ.update(MULTICAST_OFF)

import torch

from detcomm.bench.timing import host_us_per_call
from detcomm.bench.timing import median_ms_back_to_back as _median_ms
from detcomm.dtypes import info
from detcomm.tables import format_table

SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
WORLDS = [2, 4, 8]


# ---- (a) fold bandwidth against a copy -------------------------------------------------------------------
def bench_fold(quick: bool) -> list[dict]:
    from detcomm.workspace.kernels import kernel_set

    dev = torch.device("cuda", 0)
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    total_in = (256 << 20) if quick else (1 << 30)  # bytes of all W inputs together: far beyond the 60 MB L2
    copy_bytes = total_in
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), repeats=5, iters=10)
    copy_gbs = 2 * copy_bytes / copy_ms / 1e6
    rows.append({"mode": "fold", "kernel": "d2d copy", "bytes": 2 * copy_bytes, "ms": copy_ms, "GB/s": copy_gbs})
    for dtype, sfx in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        for w in WORLDS:
            ks = kernel_set(0, w)
            n = total_in // w // info(dtype).size
            xs = torch.randn(w, n, device=dev).to(dtype)  # input k at base + k * n elements
            out = torch.empty(n, dtype=dtype, device=dev)
            stream = torch.cuda.current_stream().cuda_stream
            args = [ctypes.c_uint64(xs.data_ptr()), ctypes.c_int64(n), ctypes.c_uint64(out.data_ptr()), ctypes.c_int64(n)]

            def run() -> None:
                ks.launch(f"detcomm_fold_local_{sfx}", sm * 4, args, stream_ptr=stream)

            ms = _median_ms(run, repeats=5, iters=10)
            moved = (w + 1) * n * out.element_size()
            gbs = moved / ms / 1e6
            rows.append({"mode": "fold", "kernel": f"fold W={w} {sfx}", "world": w, "dtype": sfx, "bytes": moved,
                         "ms": ms, "GB/s": gbs, "pct_of_copy": 100.0 * gbs / copy_gbs})
            del xs, out
    return rows


# ---- (b) in-process latency --------------------------------------------------------------------------------
def bench_latency(quick: bool, worlds: list[int] = WORLDS, sizes: list[int] | None = None, *,
                  one_store_grid: int | None = None, untiered: bool = False) -> list[dict]:
    from detcomm.workspace import Workspace

    dev = torch.device("cuda", 0)
    sizes = sizes or (SIZES[:4] if quick else SIZES)
    rows = []
    main = torch.cuda.current_stream(dev)
    for w in worlds:
        # The one-store kernel forced on at every W >= 2 (256 KiB areas): ranks sharing a GPU never take it by default
        # (plan.one_store_max_bytes), and this table is where that rule is checked.
        views = Workspace.in_process(w, device=dev, capacity_bytes=max(sizes), max_rows_armed=1 << 20, timeout_s=30.0,
                                     one_store_max_bytes=0 if w == 1 else 256 << 10, one_store_grid=one_store_grid,
                                     one_store_tiers=() if untiered else None)
        streams = [torch.cuda.Stream(dev) for _ in range(w)]
        for size in sizes:
            n = size // 2
            xs = [torch.randn(n // 1024, 1024, device=dev).to(torch.bfloat16) for _ in range(w)]
            outs = [torch.empty_like(x) for x in xs]
            iters = 20 if size <= (1 << 20) else 5
            algos = (["one_store"] if size <= views[0].one_store_max_bytes else []) + ["one_shot", "two_shot"]
            if w == 1:
                algos.append("copy")
            for algo in algos:
                def one(r: int, algo: str = algo) -> None:
                    if algo == "copy":  # the same bytes read and written as W = 1's local pass
                        outs[r].copy_(xs[r])  # noqa: F821 (runs before the del below)
                    else:
                        views[r].all_reduce(xs[r], out=outs[r], algo=algo)  # noqa: F821

                def eager() -> None:
                    for r in range(w):
                        streams[r].wait_stream(main)
                        with torch.cuda.stream(streams[r]):
                            one(r)
                    for s in streams:
                        main.wait_stream(s)

                eager()
                torch.cuda.synchronize()
                eager_ms = _median_ms(eager, repeats=5, iters=iters)
                graphs = []
                for r in range(w):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, stream=streams[r]):
                        for _ in range(iters):
                            one(r)
                    graphs.append(g)

                def replay() -> None:
                    for r in range(w):
                        streams[r].wait_stream(main)
                        with torch.cuda.stream(streams[r]):
                            graphs[r].replay()  # noqa: F821 (runs before the del below)
                    for s in streams:
                        main.wait_stream(s)

                replay()
                torch.cuda.synchronize()
                graph_ms = _median_ms(replay, repeats=5, iters=1) / iters
                rows.append({"mode": "latency", "world": w, "bytes": size, "algo": algo, "eager_us": eager_ms * 1e3,
                             "graph_us": graph_ms * 1e3})
                print(f"W={w} {size >> 10} KiB {algo}: eager {eager_ms * 1e3:.1f} us, graph {graph_ms * 1e3:.1f} us",
                      flush=True)
                del graphs
            del xs, outs
        for v in views:
            v.close()
        torch.cuda.synchronize()
    return rows


# ---- (c) multi-GPU against NCCL ----------------------------------------------------------------------------
def _nccl_rank(rank: int, world: int, init_file: str, sizes: list[int], nccl_env: dict, result_file: str,
               gather_graph: bool = False, one_store_grid: int | None = None, untiered: bool = False) -> None:
    os.environ.update(MULTICAST_OFF)
    os.environ.update(nccl_env)  # before the communicator exists: NCCL reads its environment at init
    import torch.distributed as dist

    import detcomm
    from detcomm.workspace import Workspace

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev)
    gloo = dist.new_group(backend="gloo")
    ws = Workspace.create(gloo, device=dev, capacity_bytes=max(sizes), max_rows_armed=1 << 20, timeout_s=60.0,
                          one_store_grid=one_store_grid, one_store_tiers=() if untiered else None)
    # What a caller pays: the public API on the same GPUs, its own workspace armed with the same capacity, the
    # site forced onto the workspace route (numerics="auto" keeps the NCCL environment under test untouched).
    max_rows = max(sizes) // 2048
    detcomm.init(numerics="auto", device=dev, workspace=True, workspace_bytes=max(sizes), workspace_max_rows=max_rows)
    site = detcomm.site("bench.all_reduce", collective="all_reduce", dtype=torch.bfloat16, shape=(1024,),
                        max_rows=max_rows, route="ipc_fold")
    # The route large sites took before they could stay on the workspace chunked: the same public call.
    gather = detcomm.site("bench.all_reduce.gather_fold", collective="all_reduce", dtype=torch.bfloat16,
                          shape=(1024,), max_rows=max_rows, route="gather_fold")
    rows = []
    for size in sizes:
        x = torch.randn(size // 2048, 1024, device=dev).to(torch.bfloat16)
        out = torch.empty_like(x)
        buf = x.clone()
        iters = 20 if size <= (1 << 20) else 5
        cands = {"nccl": lambda: dist.all_reduce(x),
                 "one_store": lambda: ws.all_reduce(x, out=out, algo="one_store"),
                 "one_shot": lambda: ws.all_reduce(x, out=out, algo="one_shot"),
                 "two_shot": lambda: ws.all_reduce(x, out=out, algo="two_shot"),
                 "detcomm": lambda: detcomm.all_reduce(x, site, out=out),
                 "detcomm_inplace": lambda: detcomm.all_reduce(buf, site, out=buf),
                 "gather_fold": lambda: detcomm.all_reduce(x, gather, out=out)}
        if size > ws.one_store_max_bytes:
            del cands["one_store"]
        if size == min(sizes):
            for r in _host_times(world, size, cands, gloo):
                rows.append(dict(r, nccl_env=nccl_env))
                _progress(rank, rows[-1])
        for name, fn in cands.items():
            fn()
            torch.cuda.synchronize()
            dist.barrier(group=gloo)
            eager = _median_ms(fn, repeats=5, iters=iters)
            if name in EAGER_ONLY and not gather_graph:
                rows.append({"mode": "nccl", "world": world, "bytes": size, "impl": name, "nccl_env": nccl_env,
                             "eager_us": eager * 1e3, "graph_us": float("nan"), "graph_note": EAGER_ONLY[name]})
                _progress(rank, rows[-1])
                continue
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, stream=s):
                    for _ in range(iters):
                        fn()
            except Exception as e:  # noqa: BLE001 - a route that cannot be captured is a result (every rank fails alike)
                torch.cuda.synchronize()
                rows.append({"mode": "nccl", "world": world, "bytes": size, "impl": name, "nccl_env": nccl_env,
                             "eager_us": eager * 1e3, "graph_us": float("nan"),
                             "graph_note": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
                del g
                continue
            torch.cuda.synchronize()
            dist.barrier(group=gloo)
            graph = _median_ms(g.replay, repeats=5, iters=1) / iters
            rows.append({"mode": "nccl", "world": world, "bytes": size, "impl": name, "nccl_env": nccl_env,
                         "eager_us": eager * 1e3, "graph_us": graph * 1e3})
            _progress(rank, rows[-1])
            # A graph that captured an NCCL collective (gather_fold's all-gather) holds NCCL resources: alive at
            # teardown, it makes the communicator's destruction wait forever (pytorch/pytorch#115388), so each graph
            # goes as soon as it is timed.
            del g
    if rank == 0:  # before the teardown: a hang there cannot cost the measurements
        Path(result_file).write_text(json.dumps(rows))
    torch.cuda.synchronize()
    ws.close()
    detcomm.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


# Measured eager only: a graph capture that fails inside an NCCL collective can leave the communicator unusable
# for the rest of the run.
EAGER_ONLY = {"gather_fold": "eager only in this bench"}


def _progress(rank: int, row: dict) -> None:
    """Rank 0 prints every row as it is measured (a run cut short by its time limit keeps what it measured)."""
    if rank == 0:
        print("ROW " + json.dumps(row), flush=True)


def _host_times(world: int, size: int, cands: dict, gloo: Any) -> list[dict]:
    """Host time per eager call of each candidate (timing.host_us_per_call), every repeat started together."""
    import torch.distributed as dist

    return [{"mode": "host", "world": world, "bytes": size, "impl": name,
             "host_us": host_us_per_call(fn, barrier=lambda: dist.barrier(group=gloo))} for name, fn in cands.items()]


NCCL_ENVS = {"default": {}, "ring_simple": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}}


def bench_nccl(quick: bool, tmp: Path, sizes: list[int] | None = None, envs: list[str] | None = None, *,
               gather_graph: bool = False, one_store_grid: int | None = None, untiered: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    world = min(torch.cuda.device_count(), 8)
    if world < 2:
        print("nccl mode: fewer than 2 GPUs, skipped", flush=True)
        return []
    sizes = sizes or (SIZES[:4] if quick else SIZES)
    rows = []
    for tag in envs or list(NCCL_ENVS):
        env = NCCL_ENVS[tag]
        result = tmp / f"nccl_{tag}.json"
        init = tmp / f"init_{tag}_{time.time_ns()}"
        mp.spawn(_nccl_rank, args=(world, str(init), sizes, env, str(result), gather_graph, one_store_grid, untiered),
                 nprocs=world, join=True)
        rows += json.loads(result.read_text())
    return rows


# ---- report ------------------------------------------------------------------------------------------------
def to_markdown(rows: list[dict], header: str) -> str:
    out = [header, ""]

    def section(title: str, head: tuple[str, ...], align: str, cells: list[list[object]]) -> None:
        if cells:
            out.extend([title, "", format_table(head, cells, markdown=True, align=align), ""])

    def env(r: dict) -> str:
        return " ".join(f"{k}={v}" for k, v in r.get("nccl_env", {}).items()) or "default"

    section("### Fold kernel bandwidth vs device-to-device copy (one GPU)",
            ("kernel", "bytes moved", "time (ms)", "GB/s", "% of copy"), "lrrrr",
            [[r["kernel"], f"{r['bytes']:,}", f"{r['ms']:.3f}", f"{r['GB/s']:.0f}",
              f"{r['pct_of_copy']:.1f}" if "pct_of_copy" in r else "100 (reference)"]
             for r in rows if r["mode"] == "fold"])
    section("### All-reduce latency, W ranks as W streams of one GPU (bf16; us per call, median)",
            ("W", "size", "kernel", "eager", "graph"), "rrlrr",
            [[r["world"], _size(r["bytes"]), r["algo"], f"{r['eager_us']:.1f}", f"{r['graph_us']:.1f}"]
             for r in sorted((r for r in rows if r["mode"] == "latency"), key=lambda r: (r["world"], r["bytes"]))])
    section("### Host time per eager call (device idle at the start; median of 15 x 200 back-to-back calls)",
            ("W", "NCCL env", "size", "impl", "host us per call"), "rlrlr",
            [[r["world"], env(r), _size(r["bytes"]), r["impl"], f"{r['host_us']:.1f}"]
             for r in rows if r["mode"] == "host"])
    section("### Multi-GPU: workspace vs NCCL all_reduce (bf16; us per call, median)",
            ("W", "NCCL env", "size", "impl", "eager", "graph"), "rlrlrr",
            [[r["world"], env(r), _size(r["bytes"]), r["impl"], f"{r['eager_us']:.1f}", f"{r['graph_us']:.1f}"]
             for r in rows if r["mode"] == "nccl"])
    return "\n".join(out)


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= (1 << 20) else f"{b >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="path prefix: writes <out>.md and <out>.json")
    ap.add_argument("--modes", default="fold,latency,nccl", help="comma-separated subset of fold,latency,nccl")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="latency mode: comma-separated W values")
    ap.add_argument("--nccl-envs", default=",".join(NCCL_ENVS), help=f"nccl mode: comma-separated subset of {','.join(NCCL_ENVS)}")
    ap.add_argument("--sizes", default="", help="latency and nccl modes: comma-separated sizes in KiB (default: all)")
    ap.add_argument("--gather-graph", action="store_true", help="nccl mode: also capture gather_fold in a CUDA graph")
    ap.add_argument("--one-store-grid", type=int, default=None,
                    help="latency and nccl modes: at most this many blocks in the raw workspace's one-store launches "
                         "(Workspace.create's one_store_grid; default: no cap); the public-API rows keep the default")
    ap.add_argument("--untiered", action="store_true",
                    help="latency and nccl modes: the raw workspace's one-store launches all on one tier (one_store_tiers=(): "
                         "the whole grid for every size), to compare with the default tiers")
    args = ap.parse_args()
    modes = set(args.modes.split(","))
    if not modes <= {"fold", "latency", "nccl"}:
        raise SystemExit(f"unknown modes: {modes - {'fold', 'latency', 'nccl'}}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/ipc_kernels.py needs a CUDA device")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    header = (f"## detcomm workspace bench: {torch.cuda.device_count()} x {props.name} ({props.multi_processor_count} SMs), "
              f"torch {torch.__version__}, CUDA {torch.version.cuda}"
              + (f", one-store launches on at most {args.one_store_grid} blocks" if args.one_store_grid else "")
              + (", one-store launches untiered" if args.untiered else ""))
    rows: list[dict] = []
    if "fold" in modes:
        rows += bench_fold(args.quick)
    sizes = [int(k) << 10 for k in args.sizes.split(",")] if args.sizes else None
    if "latency" in modes:
        rows += bench_latency(args.quick, [int(w) for w in args.worlds.split(",")], sizes, one_store_grid=args.one_store_grid,
                              untiered=args.untiered)
    if "nccl" in modes:
        rows += bench_nccl(args.quick, out.parent, sizes, args.nccl_envs.split(","), gather_graph=args.gather_graph,
                           one_store_grid=args.one_store_grid, untiered=args.untiered)
    md = to_markdown(rows, header)
    out.with_suffix(".md").write_text(md + "\n")
    out.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
