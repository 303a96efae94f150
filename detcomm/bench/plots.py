"""The bench's PNG plots (matplotlib, no display needed): one column of panels per (harness, W).

  latency_vs_size.png     median latency per route against message size (eager solid, CUDA graph dashed), bf16
  divergence_vs_size.png  changed fraction and max ulps from the canonical fold per route against size
  ratio_vs_size.png       fold-route median over native median at the same point, per fold route
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_plots"]

_ROUTE_ORDER = ("native", "native_ring_simple", "gather_fold", "ipc_one_shot", "ipc_two_shot",
                "a2a_fold", "ipc_fold")
_COLL_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG"}
_FOLDS = {"all_reduce": ("gather_fold", "ipc_one_shot", "ipc_two_shot"),
          "reduce_scatter": ("a2a_fold", "ipc_fold")}


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("detcomm-bench needs matplotlib for its plots: pip install matplotlib") from e
    matplotlib.use("Agg")  # files only: no display on CI or the GPU machines
    import matplotlib.pyplot as plt

    return plt


def _series(points: list[dict[str, Any]], key: Any) -> tuple[list[int], list[float]]:
    pts = sorted((p for p in points if key(p) is not None), key=lambda p: p["bytes"])
    return [p["bytes"] for p in pts], [key(p) for p in pts]


def _groups(result: dict[str, Any]) -> list[tuple[str, int]]:
    return sorted({(p["harness"], p["world"]) for p in result["points"]})


def _color(route: str) -> str:
    return f"C{_ROUTE_ORDER.index(route) % 10}" if route in _ROUTE_ORDER else "k"


def _style_x(ax: Any) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.grid(True, which="both", alpha=0.3)


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the three PNGs under ``out_dir``; return their paths."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [p for p in result["points"] if p["status"] == "ok" and p["eager"]]
    groups = _groups(result) or [("none", 0)]
    colls = [c for c in _COLL_SHORT if any(p["collective"] == c for p in ok)] or ["all_reduce"]
    title = f"{result['meta']['hardware']}, {result['meta']['date']}"
    paths = []

    # Latency vs size, bf16 (fp32 is in the tables): rows = collectives, columns = harness/W.
    fig, axes = plt.subplots(len(colls), len(groups), figsize=(5.5 * len(groups), 3.6 * len(colls)), squeeze=False)
    for j, (harness, world) in enumerate(groups):
        for i, coll in enumerate(colls):
            ax = axes[i][j]
            mine = [p for p in ok if (p["harness"], p["world"], p["collective"], p["dtype"]) ==
                    (harness, world, coll, "bfloat16")]
            for route in _ROUTE_ORDER:
                rp = [p for p in mine if p["route"] == route]
                for mode, ls in (("eager", "-"), ("graph", "--")):
                    xs, ys = _series(rp, lambda p, m=mode: p[m]["median_us"] if p[m] else None)
                    if xs:
                        ax.plot(xs, ys, ls, marker=".", color=_color(route),
                                label=f"{route}{' (graph)' if mode == 'graph' else ''}")
            ax.set_yscale("log")
            ax.set_ylabel("median µs per call")
            ax.set_title(f"{harness} W={world} {_COLL_SHORT[coll]} bf16", fontsize=9)
            _style_x(ax)
            if ax.lines:
                ax.legend(fontsize=6)
            else:
                ax.text(0.5, 0.5, "no bf16 points", ha="center", transform=ax.transAxes)
    fig.suptitle(f"detcomm-bench latency: {title}", fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "latency_vs_size.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Divergence vs size: row 0 changed fraction, row 1 max ulps; every reduction route, bf16 solid, fp32 dashed.
    fig, axes = plt.subplots(2, len(groups), figsize=(5.5 * len(groups), 7.0), squeeze=False)
    for j, (harness, world) in enumerate(groups):
        for i, (key, ylab) in enumerate((("changed_frac", "fraction of elements changed"),
                                         ("max_ulps", "max ulps from canonical fold"))):
            ax = axes[i][j]
            for coll in ("all_reduce", "reduce_scatter"):
                for route in _ROUTE_ORDER:
                    for dtype, ls in (("bfloat16", "-"), ("float32", "--")):
                        rp = [p for p in ok if (p["harness"], p["world"], p["collective"], p["route"], p["dtype"]) ==
                              (harness, world, coll, route, dtype)]
                        xs, ys = _series(rp, lambda p, k=key: p[k])
                        ys = [min(y, 1e12) for y in ys]  # an infinite ulp distance plots at the top
                        if xs:
                            ax.plot(xs, ys, ls, marker="o" if coll == "all_reduce" else "s", ms=3,
                                    color=_color(route), label=f"{_COLL_SHORT[coll]} {route} {dtype[:4]}")
            ax.set_yscale("symlog", linthresh=1e-3 if key == "changed_frac" else 1.0)
            ax.set_ylabel(ylab)
            ax.set_title(f"{harness} W={world}", fontsize=9)
            _style_x(ax)
            if ax.lines:
                ax.legend(fontsize=6)
    fig.suptitle(f"detcomm-bench divergence when rows move in the batch: {title}", fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "divergence_vs_size.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Fold / native time ratio vs size.
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 3.8), squeeze=False)
    for j, (harness, world) in enumerate(groups):
        ax = axes[0][j]
        for coll, folds in _FOLDS.items():
            base = {(p["dtype"], p["hidden"], p["rows"]): p for p in ok
                    if (p["harness"], p["world"], p["collective"], p["route"]) == (harness, world, coll, "native")}
            for route in folds:
                for dtype, ls in (("bfloat16", "-"), ("float32", "--")):
                    for mode, mk in (("eager", "o"), ("graph", "x")):
                        rp = [p for p in ok if (p["harness"], p["world"], p["collective"], p["route"], p["dtype"]) ==
                              (harness, world, coll, route, dtype)]

                        def ratio(p: dict[str, Any], m: str = mode) -> float | None:
                            q = base.get((p["dtype"], p["hidden"], p["rows"]))
                            if q is None or not p[m] or not q[m]:
                                return None
                            return p[m]["median_us"] / q[m]["median_us"]

                        xs, ys = _series(rp, ratio)
                        if xs:
                            ax.plot(xs, ys, ls, marker=mk, ms=3, color=_color(route),
                                    label=f"{_COLL_SHORT[coll]} {route} {dtype[:4]} {mode}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("fold median / native median")
        ax.set_title(f"{harness} W={world}", fontsize=9)
        _style_x(ax)
        if ax.lines[1:]:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "no native route on this harness", ha="center", transform=ax.transAxes)
    fig.suptitle(f"detcomm-bench fold/native time: {title}", fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "ratio_vs_size.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
