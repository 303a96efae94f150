"""Where the bench's calls run: W processes of a LocalCluster (gloo on CPU, NCCL with one GPU per rank), or W
ranks as W streams of this process on one GPU (the CUDA-IPC workspace only: NCCL cannot put two ranks on one
GPU). Both measure one point the same way and return the same dict:

    {"eager": [seconds per call], "graph": [seconds per call] | None, "graph_note": str,
     "numerics": {"changed_frac", "max_ulps"} | None}

Routes by label: native and native_ring_simple (detcomm site with route="native"; the Ring/Simple one runs in a
cluster created with NCCL_ALGO=Ring NCCL_PROTO=Simple), gather_fold, rs_ag_fold and a2a_fold (detcomm sites forced to those
routes, numerics="auto"), ipc_one_store / ipc_one_shot / ipc_two_shot / workspace (the CUDA-IPC workspace's
public API, which is the only way to force one kernel: detcomm's workspace route picks by size; a forced one-store
launch is chunked to the workspace's one-store limit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from detcomm.dtypes import FLOAT_NAMES, from_name

from ..errors import WorkspaceUnavailable
from . import divergence as div
from . import timing

__all__ = ["DTYPES", "rank_setup", "rank_point", "rank_teardown", "StreamsHarness"]

DTYPES = {name: from_name(name) for name in FLOAT_NAMES}

# Workspace route label -> (Workspace method, keyword arguments).
_WS_CALLS = {
    ("all_reduce", "ipc_one_store"): ("all_reduce", {"algo": "one_store"}),
    ("all_reduce", "ipc_one_shot"): ("all_reduce", {"algo": "one_shot"}),
    ("all_reduce", "ipc_two_shot"): ("all_reduce", {"algo": "two_shot"}),
    ("reduce_scatter", "ipc_fold"): ("reduce_scatter", {}),
    ("all_gather", "ipc_fold"): ("all_gather", {}),
}
_DETCOMM_ROUTE = {"native": "native", "native_ring_simple": "native", "gather_fold": "gather_fold",
                  "rs_ag_fold": "rs_ag_fold", "a2a_fold": "a2a_fold"}

# Per-rank state of a LocalCluster worker between jobs (each worker is its own process).
_STATE: dict[str, Any] = {}


def _in_rows(collective: str, rows: int, world_size: int) -> int:
    # All-gather: `rows` is the gathered output; each rank brings rows / W of it.
    return rows // world_size if collective == "all_gather" else rows


def _measure(fn: Callable[[], object], capture: Callable[[], Callable[[], None]] | None, *, cuda: bool,
             spec: dict[str, Any], barrier: Callable[[], None]) -> dict[str, Any]:
    res: dict[str, Any] = {"graph": None, "graph_note": ""}
    if not cuda:
        res["eager"] = timing.time_cpu(fn, iters=spec["iters"], warmup=spec["warmup"], barrier=barrier)
        res["graph_note"] = "no CUDA graphs on CPU"
        return res
    res["eager"] = timing.time_cuda_eager(fn, iters=spec["iters"], warmup=spec["warmup"], barrier=barrier)
    if capture is None or not spec["graph"]:
        res["graph_note"] = spec.get("graph_note") or "not captured"
        return res
    try:
        res["graph"] = timing.time_cuda_graph(capture, iters=spec["iters"], calls_per_graph=spec["graph_calls"],
                                              barrier=barrier)
    except Exception as e:  # noqa: BLE001 - a route that cannot be captured is a result, not a crash
        torch.cuda.synchronize()
        res["graph_note"] = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return res


# ---- LocalCluster ranks ----------------------------------------------------------------------------------
def rank_setup(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, str]:
    """Job: detcomm.init(numerics="auto") on the cluster's group, a gloo side group on CUDA (barriers, workspace
    bootstrap) and, when asked, the CUDA-IPC workspace. Returns what was armed."""
    import torch.distributed as dist

    import detcomm

    cuda = cfg["device"] == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    detcomm.init(numerics="auto", device=dev)
    side = dist.new_group(backend="gloo") if cuda else None
    info = {"backend": dist.get_backend(), "workspace": "not requested"}
    ws = None
    if cuda and cfg["workspace"]:
        from detcomm.workspace import Workspace, WorkspaceUnavailable

        try:
            ws = Workspace.create(side, device=dev, capacity_bytes=cfg["ws_bytes"], max_rows_armed=cfg["max_rows"])
            info["workspace"] = "armed"
        except WorkspaceUnavailable as e:
            info["workspace"] = f"unavailable: {e}"
    _STATE.clear()
    _STATE.update(dev=dev, cuda=cuda, side=side, ws=ws, cfg=cfg, pools={})
    return info


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier(group=_STATE["side"])


def _rank_pools(rank: int, world_size: int, dtype: torch.dtype, hidden: int, seed: int
                ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    key = (dtype, hidden)
    if key not in _STATE["pools"]:
        # Rank 0 judges the numbers, so it alone builds every rank's pool and the canonical fold of them.
        ranks = list(range(world_size)) if rank == 0 else [rank]
        pools = div.make_pools(hidden, dtype, world_size=world_size, seed=seed, ranks=ranks, device=_STATE["dev"])
        ref = div.reference_pool(pools, world_size) if rank == 0 else None
        _STATE["pools"] = {key: (pools, ref)}  # one shape at a time: the sweep is ordered by shape
    return _STATE["pools"][key]


def _rank_inplace(collective: str, route: str, dtype: torch.dtype, hidden: int
                  ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The in-place form of a site route's all-reduce through the public API (``out=x``), or None where the
    collective has no in-place form (reduce-scatter and all-gather change the row count) or the label is a raw
    workspace call."""
    import detcomm

    if collective != "all_reduce" or route not in _DETCOMM_ROUTE:
        return None
    name = f"bench.{collective}.{_DETCOMM_ROUTE[route]}.{str(dtype).replace('torch.', '')}.{hidden}"
    return lambda x: detcomm.all_reduce(x, name, out=x)  # type: ignore[return-value]


def _rank_call(rank: int, world_size: int, collective: str, route: str, dtype: torch.dtype, hidden: int
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    import detcomm

    if (collective, route) in _WS_CALLS:
        ws = _STATE["ws"]
        if ws is None:
            raise WorkspaceUnavailable("ipc_fold route requested but the workspace is not armed: run with one GPU per rank and peer access")
        method, kw = _WS_CALLS[(collective, route)]
        return lambda x: getattr(ws, method)(x, **kw)
    name = f"bench.{collective}.{_DETCOMM_ROUTE[route]}.{str(dtype).replace('torch.', '')}.{hidden}"
    site = detcomm.site(name, collective=collective, dtype=dtype, shape=(hidden,), max_rows=_STATE["cfg"]["max_rows"],
                        route=_DETCOMM_ROUTE[route])
    fns: dict[str, Callable[..., torch.Tensor]] = {
        "all_reduce": detcomm.all_reduce, "reduce_scatter": detcomm.reduce_scatter, "all_gather": detcomm.all_gather}
    fn = fns[collective]
    return lambda x: fn(x, site=site)


def rank_point(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Job: time one (collective, route, dtype, hidden, rows) point and, on rank 0, judge its numbers."""
    import torch.distributed as dist

    dev, cuda = _STATE["dev"], _STATE["cuda"]
    coll, dtype, hidden, rows = spec["collective"], DTYPES[spec["dtype"]], spec["hidden"], spec["rows"]
    pools, ref = _rank_pools(rank, world_size, dtype, hidden, spec["seed"])
    own = pools[rank]
    call = _rank_call(rank, world_size, coll, spec["route"], dtype, hidden)
    x = own[div.batch_index(_in_rows(coll, rows, world_size)).to(dev)]
    barrier = _barrier if cuda else dist.barrier

    def capture() -> Callable[[], None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's graph notes ask
            for _ in range(2):
                call(x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(spec["graph_calls"]):
                call(x)
        return g.replay

    res = _measure(lambda: call(x), capture, cuda=cuda, spec=spec, barrier=barrier)
    inplace = _rank_inplace(coll, spec["route"], dtype, hidden)
    if inplace is not None:
        # The caller's buffer receives the result, as serving code calls it to avoid an allocation per call.
        # Its values change call after call; the time of a fold does not depend on them.
        buf = x.clone()
        res["inplace"] = _measure(lambda: inplace(buf), None, cuda=cuda, spec=dict(spec, graph=False),
                                  barrier=barrier)["eager"]
    res["numerics"] = None
    if spec["numerics"]:
        if coll == "all_gather":
            def gather(idx: torch.Tensor) -> torch.Tensor | None:
                out = call(own[idx.to(dev)])
                return out if rank == 0 else None

            res["numerics"] = div.measure_gather(gather, rows_per_rank=_in_rows(coll, rows, world_size),
                                                 world_size=world_size, pools=pools)
        else:
            def full(idx: torch.Tensor) -> torch.Tensor | None:
                out = call(own[idx.to(dev)])
                if coll == "reduce_scatter":  # every rank's shard, in rank order: the whole reduced buffer
                    parts = [torch.empty_like(out) for _ in range(world_size)]
                    dist.all_gather(parts, out.contiguous())
                    out = torch.cat(parts)
                return out if rank == 0 else None

            res["numerics"] = div.measure(full, collective=coll, rows=rows, world_size=world_size, ref_pool=ref)
    if cuda:
        torch.cuda.synchronize()
    return res


def rank_teardown(rank: int, world_size: int) -> None:
    """Job: release the workspace and detcomm (the worker destroys the group when the cluster closes)."""
    import detcomm

    ws = _STATE.get("ws")
    if ws is not None:
        ws.close()
    detcomm.shutdown()
    _STATE.clear()


# ---- W ranks as W streams of one GPU ---------------------------------------------------------------------
class StreamsHarness:
    """The workspace's W rank views in this process, each driven from its own stream (as bench/workspace.py);
    one timed call is all W ranks' launches, bracketed by events on the main stream."""

    def __init__(self, world_size: int, *, device: torch.device, capacity_bytes: int, max_rows_armed: int) -> None:
        from detcomm.workspace import Workspace

        self.world_size = world_size
        self.device = device
        # The one-store kernel on at every W >= 2 (areas of 256 KiB), so that ipc_one_store can be measured where the
        # default turns it off (ranks sharing one GPU: plan.one_store_max_bytes says why, this bench shows it).
        self.views = Workspace.in_process(world_size, device=device, capacity_bytes=capacity_bytes,
                                          max_rows_armed=max_rows_armed, timeout_s=30.0,
                                          one_store_max_bytes=0 if world_size == 1 else 256 * 1024)
        self.streams = [torch.cuda.Stream(device) for _ in range(world_size)]
        self.main = torch.cuda.current_stream(device)
        self._pools: dict[tuple[torch.dtype, int], tuple[dict[int, torch.Tensor], torch.Tensor]] = {}

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        for v in self.views:
            v.close()

    def _out_shape(self, collective: str, x: torch.Tensor) -> tuple[int, ...]:
        w = self.world_size
        if collective == "reduce_scatter":
            return (x.shape[0] // w, *x.shape[1:])
        if collective == "all_gather":
            return (x.shape[0] * w, *x.shape[1:])
        return tuple(x.shape)

    def _group(self, method: str, kw: dict[str, Any], xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for r in range(self.world_size):
            self.streams[r].wait_stream(self.main)
            with torch.cuda.stream(self.streams[r]):
                getattr(self.views[r], method)(xs[r], out=outs[r], **kw)
        for s in self.streams:
            self.main.wait_stream(s)

    def point(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Time and judge one point (same dict as rank_point)."""
        w = self.world_size
        coll, dtype, hidden, rows = spec["collective"], DTYPES[spec["dtype"]], spec["hidden"], spec["rows"]
        method, kw = _WS_CALLS[(coll, spec["route"])]
        key = (dtype, hidden)
        if key not in self._pools:
            pools = div.make_pools(hidden, dtype, world_size=w, seed=spec["seed"], ranks=list(range(w)),
                                   device=self.device)
            self._pools = {key: (pools, div.reference_pool(pools, w))}
        pools, ref = self._pools[key]
        idx = div.batch_index(_in_rows(coll, rows, w)).to(self.device)
        xs = [pools[r][idx] for r in range(w)]
        outs = [torch.empty(self._out_shape(coll, x), dtype=dtype, device=self.device) for x in xs]

        def capture() -> Callable[[], None]:
            graphs = []
            # One graph per rank on its own stream: one graph holding all ranks would serialize them.
            for r in range(w):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=self.streams[r]):
                    for _ in range(spec["graph_calls"]):
                        getattr(self.views[r], method)(xs[r], out=outs[r], **kw)
                graphs.append(g)

            def replay() -> None:
                for r in range(w):
                    self.streams[r].wait_stream(self.main)
                    with torch.cuda.stream(self.streams[r]):
                        graphs[r].replay()
                for s in self.streams:
                    self.main.wait_stream(s)

            return replay

        res = _measure(lambda: self._group(method, kw, xs, outs), capture, cuda=True, spec=spec, barrier=lambda: None)
        res["numerics"] = None
        if spec["numerics"]:
            def run(i: torch.Tensor) -> torch.Tensor:
                ins = [pools[r][i.to(self.device)] for r in range(w)]
                o = [torch.empty(self._out_shape(coll, t), dtype=dtype, device=self.device) for t in ins]
                self._group(method, kw, ins, o)
                torch.cuda.synchronize(self.device)
                return torch.cat(o) if coll == "reduce_scatter" else o[0]

            if coll == "all_gather":
                res["numerics"] = div.measure_gather(run, rows_per_rank=rows // w, world_size=w, pools=pools)
            else:
                res["numerics"] = div.measure(run, collective=coll, rows=rows, world_size=w, ref_pool=ref)
        torch.cuda.synchronize(self.device)
        return res
