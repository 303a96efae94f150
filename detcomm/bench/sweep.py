"""The route sweep behind ``detcomm-bench``: every route the machine offers, over message sizes and group sizes, timed
beside its numerical divergence. Entry point: ``detcomm-bench`` (detcomm/bench/cli.py), or from a checkout

    python -m detcomm.bench --quick --out results/bench

Harnesses (one per (kind, W)):
  gloo     W processes on the CPU (LocalCluster, gloo).
  nccl     W processes, one GPU each (LocalCluster, NCCL), where the machine has W GPUs; the Ring/Simple native
           route runs in a second cluster whose NCCL_ALGO/NCCL_PROTO are set before its communicator exists.
  streams  W ranks as W streams of this process on one GPU: the CUDA-IPC workspace only (NCCL refuses two
           ranks on one GPU); the ranks share one GPU's SMs and HBM, so large messages are a lower bound.

Multicast gather and the in-switch reduction are measured only where docs/spec.md §8 allows multicast (hardware support,
no multicast-off variable set, the user's opt-in); elsewhere their rows say "unavailable: <reason>". This bench
never creates a multicast object: where multicast would be allowed it still says so, because no multimem route
is built (no machine here may run one).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch

from detcomm.dtypes import TABLE

from . import harness, timing

__all__ = ["BenchConfig", "ROUTES", "FOLD_ROUTES", "run_bench"]

# (collective, route) in display order. Labels, not detcomm Route values: native_ring_simple and the two
# workspace kernels are one detcomm route each, measured apart.
ROUTES: tuple[tuple[str, str], ...] = (
    ("all_reduce", "native"), ("all_reduce", "native_ring_simple"), ("all_reduce", "gather_fold"),
    ("all_reduce", "rs_ag_fold"),
    ("all_reduce", "ipc_one_store"), ("all_reduce", "ipc_one_shot"), ("all_reduce", "ipc_two_shot"),
    ("all_reduce", "in_switch"),
    ("reduce_scatter", "native"), ("reduce_scatter", "native_ring_simple"), ("reduce_scatter", "a2a_fold"),
    ("reduce_scatter", "ipc_fold"), ("reduce_scatter", "in_switch"),
    ("all_gather", "native"), ("all_gather", "native_ring_simple"), ("all_gather", "ipc_fold"),
    ("all_gather", "multicast_gather"),
)
# Canonical-fold routes whose time the ratio summary divides by native's (all-gather has no fold).
FOLD_ROUTES = ("gather_fold", "rs_ag_fold", "ipc_one_store", "ipc_one_shot", "ipc_two_shot", "a2a_fold", "ipc_fold")
_WORKSPACE = ("ipc_one_store", "ipc_one_shot", "ipc_two_shot", "ipc_fold")
_MULTICAST = ("in_switch", "multicast_gather")
_RING_SIMPLE_ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
_ELEM = {d.name: d.size for d in TABLE if d.is_float}


@dataclass(frozen=True)
class BenchConfig:
    """What to sweep and how. Sizes: every rows x hidden for each dtype (``fp32_hidden`` narrows fp32's hidden
    sizes, None = the same as ``hidden``), or exactly ``explicit_shapes`` ((dtype, hidden, rows) in sweep order:
    an nccl-tests style byte sweep); reduce-scatter and all-gather points need rows divisible by W."""

    device: str
    worlds: tuple[int, ...]
    rows: tuple[int, ...]
    hidden: tuple[int, ...]
    dtypes: tuple[str, ...]
    stream_worlds: tuple[int, ...] = ()
    fp32_hidden: tuple[int, ...] | None = None
    collectives: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather")
    iters: int = 50
    warmup: int = 5
    graph_calls: int = 4
    graph: bool = True
    numerics: bool = True
    seed: int = 1234
    budget_s: float | None = None
    allow_multicast: bool = False
    ws_bytes: int = 64 << 20
    progress: bool = True
    command: str = ""
    explicit_shapes: tuple[tuple[str, int, int], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")
        for name in ("worlds", "stream_worlds", "rows", "hidden"):
            vals = getattr(self, name)
            if any(not isinstance(v, int) or v < 1 for v in vals):
                raise ValueError(f"{name} must be positive ints, got {vals!r}")
        if any(w < 2 for w in self.worlds + self.stream_worlds):
            raise ValueError("group sizes must be >= 2 (a collective over one rank moves nothing)")
        if self.stream_worlds and self.device != "cuda":
            raise ValueError("stream_worlds (W ranks as W streams of one GPU) needs device='cuda'")
        bad = [d for d in self.dtypes if d not in _ELEM]
        if bad or not self.dtypes:
            raise ValueError(f"dtypes must be among {sorted(_ELEM)}, got {self.dtypes!r}")
        badc = [c for c in self.collectives if c not in ("all_reduce", "reduce_scatter", "all_gather")]
        if badc or not self.collectives:
            raise ValueError(f"collectives must be among all_reduce, reduce_scatter, all_gather; got {self.collectives!r}")
        if self.iters < 50:
            raise ValueError(f"iters must be >= 50 (medians need >= 50 timed calls per point), got {self.iters}")
        if self.warmup < 1 or self.graph_calls < 1:
            raise ValueError("warmup and graph_calls must be >= 1")
        if self.budget_s is not None and self.budget_s <= 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s}")

    def shapes(self) -> list[tuple[str, int, int]]:
        """(dtype, hidden, rows) in sweep order (grouped by shape: the ranks keep one payload pool at a time)."""
        if self.explicit_shapes:
            return list(self.explicit_shapes)
        out = []
        for d in self.dtypes:
            hs = self.fp32_hidden if (d == "float32" and self.fp32_hidden is not None) else self.hidden
            out += [(d, h, r) for h in hs for r in sorted(self.rows)]
        return out


def multicast_reason(*, allow_multicast: bool) -> str:
    """Why the multicast rows are not measured, from docs/spec.md §8's three conditions (detcomm.envelope)."""
    from detcomm.envelope import multicast_allowed, resolve_numerics

    # Hardware support is never probed: asking the driver about multicast is a step this bench does not take
    # unless the other two conditions already allow it. With them both met it would still say "not built".
    ok, why = multicast_allowed(resolve_numerics("auto", allow_multicast=allow_multicast), hardware_supports=True)
    if ok:
        return ("unavailable: multicast is allowed here, but this build has no multimem route (torch "
                "symmetric-memory multimem ops) to measure")
    if not allow_multicast:
        _, env_why = multicast_allowed(resolve_numerics("auto", allow_multicast=True), hardware_supports=True)
        if env_why.startswith("disabled"):
            why = f"{why}; {env_why}"
    return f"unavailable: {why}"


@dataclass
class _Harness:
    kind: str  # gloo | nccl | streams
    world: int
    measured: dict[tuple[str, str], str]  # (collective, route) -> cluster tag ("default", "ring_simple", "streams")
    unavailable: dict[tuple[str, str], str]


def plan_harnesses(cfg: BenchConfig) -> list[_Harness]:
    """Which routes each harness measures and why the others are not measured there."""
    mc = multicast_reason(allow_multicast=cfg.allow_multicast)
    ngpu = torch.cuda.device_count() if cfg.device == "cuda" else 0
    plans = []
    wanted = [(c, r) for c, r in ROUTES if c in cfg.collectives]
    for w in cfg.worlds:
        kind = "gloo" if cfg.device == "cpu" else "nccl"
        measured, unavailable = {}, {}
        for c, r in wanted:
            if r in _MULTICAST:
                unavailable[(c, r)] = mc
            elif cfg.device == "cuda" and w > ngpu:
                unavailable[(c, r)] = f"unavailable: W={w} processes need {w} GPUs, this machine has {ngpu}"
            elif r == "native_ring_simple" and kind == "gloo":
                unavailable[(c, r)] = "n/a on gloo (NCCL_ALGO/NCCL_PROTO are NCCL's)"
            elif r in _WORKSPACE and kind == "gloo":
                unavailable[(c, r)] = "unavailable: CPU group: no CUDA-IPC workspace"
            elif r == "ipc_one_store" and w == 1:
                unavailable[(c, r)] = "n/a at W=1: no peer to store into (the one-shot kernel is one pass there)"
            else:
                measured[(c, r)] = "ring_simple" if r == "native_ring_simple" else "default"
        plans.append(_Harness(kind, w, measured, unavailable))
    for w in cfg.stream_worlds:
        measured, unavailable = {}, {}
        for c, r in wanted:
            if r in _MULTICAST:
                unavailable[(c, r)] = mc
            elif r == "ipc_one_store" and w == 1:
                unavailable[(c, r)] = "n/a at W=1: no peer to store into (the one-shot kernel is one pass there)"
            elif r in _WORKSPACE:
                measured[(c, r)] = "streams"
            else:
                unavailable[(c, r)] = ("unavailable: NCCL and gloo need one process per rank; W streams of one "
                                       "process carry the workspace only")
        plans.append(_Harness("streams", w, measured, unavailable))
    return plans


def _fold_capture_check() -> str:
    # Runs in a fresh process (see fold_graph_note): "" when the fold leaf captures, else why not.
    from detcomm.numerics.fold import select_leaf

    leaf = select_leaf(device_type="cuda")
    x = torch.ones(2, 4, 64, device="cuda:0", dtype=torch.bfloat16)
    leaf.fold(x, x.dtype)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            leaf.fold(x, x.dtype)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return f"not capturable: fold leaf {leaf.name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return ""


def fold_graph_note() -> str:
    """"" when the fold leaf (gather_fold, a2a_fold) can be captured in a CUDA graph, else why not. Tried in a
    fresh process with no communicator: a capture that fails halfway through a route would leave NCCL work
    captured into a discarded graph on every rank, which is not worth risking a group (and device time) on."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    try:
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
            return ex.submit(_fold_capture_check).result(timeout=120)
    except Exception as e:  # noqa: BLE001
        return f"not captured: the capture check failed: {type(e).__name__}: {e}"


def _points(cfg: BenchConfig, h: _Harness, tag: str, fold_note: str = "") -> list[dict[str, Any]]:
    specs = []
    for dtype, hidden, rows in cfg.shapes():
        for c, r in h.measured:
            if h.measured[(c, r)] != tag:
                continue
            if c != "all_reduce" and rows % h.world:
                continue  # reduce-scatter / all-gather split the rows over the ranks
            no_graph = fold_note if r in ("gather_fold", "rs_ag_fold", "a2a_fold") else ""
            specs.append({"collective": c, "route": r, "dtype": dtype, "hidden": hidden, "rows": rows,
                          "iters": cfg.iters, "warmup": cfg.warmup, "graph_calls": cfg.graph_calls,
                          "graph": cfg.graph and not no_graph, "graph_note": no_graph, "numerics": cfg.numerics,
                          "seed": cfg.seed})
    return specs


def _row(h: _Harness, spec: dict[str, Any], res: dict[str, Any] | None, status: str) -> dict[str, Any]:
    nbytes = spec["rows"] * spec["hidden"] * _ELEM[spec["dtype"]]
    row: dict[str, Any] = {"harness": h.kind, "world": h.world, "collective": spec["collective"],
                           "route": spec["route"], "dtype": spec["dtype"], "hidden": spec["hidden"],
                           "rows": spec["rows"], "bytes": nbytes, "status": status, "eager": None, "graph": None,
                           "graph_note": "", "algbw_GBps": None, "busbw_GBps": None, "graph_algbw_GBps": None,
                           "graph_busbw_GBps": None, "inplace": None, "changed_frac": None, "max_ulps": None}
    if res is None:
        return row
    if res.get("inplace"):
        row["inplace"] = timing.summarize(res["inplace"])
    for mode in ("eager", "graph"):
        if res.get(mode):
            s = timing.summarize(res[mode])
            row[mode] = s
            alg, bus = timing.bandwidth(spec["collective"], nbytes=nbytes, seconds=s["median_us"] / 1e6,
                                        world_size=h.world)
            pre = "" if mode == "eager" else "graph_"
            row[pre + "algbw_GBps"], row[pre + "busbw_GBps"] = alg, bus
    row["graph_note"] = res.get("graph_note", "")
    if res.get("numerics"):
        row["changed_frac"] = res["numerics"]["changed_frac"]
        row["max_ulps"] = res["numerics"]["max_ulps"]
    return row


def _combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from W ranks: per call the slowest rank's time (the collective is done when all are), rank
    0's numbers (it alone judges them)."""
    out = dict(per_rank[0])
    for mode in ("eager", "graph", "inplace"):
        series = [r.get(mode) for r in per_rank]
        out[mode] = [max(v) for v in zip(*series)] if all(series) else None
    return out


def hardware() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{torch.cuda.device_count()} x {p.name} ({p.multi_processor_count} SMs)"
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the sweep; return {"meta", "points", "unavailable"} (the report module writes the files)."""
    from detcomm._spawn import LocalCluster, RankFailed

    try:
        from tqdm import tqdm
    except ImportError as e:  # the progress bar is part of the contract; say what to install
        raise ImportError("detcomm-bench needs tqdm for its progress bar: pip install tqdm") from e

    plans = plan_harnesses(cfg)
    fold_note = fold_graph_note() if cfg.device == "cuda" and cfg.graph and any(h.kind == "nccl" for h in plans) else ""
    work = [(h, tag, _points(cfg, h, tag, fold_note)) for h in plans for tag in sorted(set(h.measured.values()))]
    total = sum(len(p) for _, _, p in work)
    start = time.monotonic()
    points: list[dict[str, Any]] = []
    unavailable = [{"harness": h.kind, "world": h.world, "collective": c, "route": r, "status": why}
                   for h in plans for (c, r), why in h.unavailable.items()]
    setups: list[dict[str, Any]] = []
    bar = tqdm(total=total, disable=not cfg.progress, file=sys.stderr, unit="pt", dynamic_ncols=True)
    max_rows = 2 * max(cfg.rows) + 2 * max(cfg.worlds + cfg.stream_worlds) + 8  # the largest placement batch

    def over_budget() -> bool:
        return cfg.budget_s is not None and time.monotonic() - start > cfg.budget_s

    for h, tag, specs in work:
        if not specs:
            continue
        if over_budget():
            points += [_row(h, s, None, "skipped: time budget") for s in specs]
            bar.update(len(specs))
            continue
        label = f"{h.kind} W={h.world}{' Ring/Simple' if tag == 'ring_simple' else ''}"
        runner, close = None, None
        try:
            if h.kind == "streams":
                sh = harness.StreamsHarness(h.world, device=torch.device("cuda", 0), capacity_bytes=cfg.ws_bytes,
                                            max_rows_armed=max_rows)
                runner, close = sh.point, sh.close
                setups.append({"harness": label, "workspace": "armed (in-process)"})
            else:
                env = dict(_RING_SIMPLE_ENV) if tag == "ring_simple" else {}
                cluster = LocalCluster(h.world, backend=h.kind, env=env)
                wants_ws = any(r in _WORKSPACE for (_, r), t in h.measured.items() if t == tag)
                info = cluster.run(harness.rank_setup, {"device": cfg.device, "workspace": wants_ws,
                                                        "ws_bytes": cfg.ws_bytes, "max_rows": max_rows})
                setups.append({"harness": label, **info[0]})

                def runner(spec: dict[str, Any], _c: Any = cluster) -> dict[str, Any]:
                    return _combine(_c.run(harness.rank_point, spec))

                def close(_c: Any = cluster) -> None:
                    try:
                        _c.run(harness.rank_teardown, timeout_s=60)
                    finally:
                        _c.close()
        except Exception as e:  # noqa: BLE001 - one harness failing leaves the others' results
            msg = f"error: {label} did not start: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
            points += [_row(h, s, None, msg) for s in specs]
            bar.update(len(specs))
            continue
        broken = ""
        for spec in specs:
            bar.set_description(f"{label} {spec['collective']} {spec['route']} {spec['dtype']} "
                                f"{spec['rows']}x{spec['hidden']}")
            if broken or over_budget():
                points.append(_row(h, spec, None, broken or "skipped: time budget"))
            else:
                try:
                    points.append(_row(h, spec, runner(spec), "ok"))
                except RankFailed as e:
                    last = next(iter(e.messages.values()), "")
                    points.append(_row(h, spec, None, f"error: {last[:200]}"))
                    if e.torn_down:
                        broken = "error: the cluster was torn down by an earlier failure"
                except Exception as e:  # noqa: BLE001 - in-process harness
                    points.append(_row(h, spec, None, f"error: {type(e).__name__}: {str(e)[:200]}"))
                    broken = "error: the in-process harness failed earlier"
            bar.update(1)
        try:
            if not broken:
                close()
        except Exception as e:  # noqa: BLE001
            setups.append({"harness": label, "close": f"{type(e).__name__}: {e}"})
    bar.close()
    cfg_dict = {k: v for k, v in asdict(cfg).items() if k not in ("extra", "progress")}
    meta = {"hardware": hardware(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "command": cfg.command,
            "config": cfg_dict, "harnesses": setups, "elapsed_s": round(time.monotonic() - start, 1),
            "multicast": multicast_reason(allow_multicast=cfg.allow_multicast),
            "fold_graph": fold_note or ("capturable" if cfg.device == "cuda" else "n/a"), **cfg.extra}
    return {"meta": meta, "points": points, "unavailable": unavailable}

