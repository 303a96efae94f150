"""The bench's PNG plots (matplotlib, no display needed): one column of panels per (harness, W).

  latency_vs_size.png     median latency per route against message size, with the p10..p90 band (eager solid,
                          CUDA graph dashed), bf16
  divergence_vs_size.png  changed fraction and max ulps from the canonical fold per route against size; at W=2
                          a panel says that nothing can diverge (a+b == b+a) instead of drawing zeros
  ratio_vs_size.png       fold-route median over native median at the same point, per fold route

Every (collective, route) pair has its own colour in every plot; legends sit right of the axes, outside the
data, and figures are saved with a tight bounding box so that no title or legend is cut.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

__all__ = ["write_plots"]

_ROUTE_ORDER = ("native", "native_ring_simple", "gather_fold", "ipc_one_store", "ipc_one_shot", "ipc_two_shot",
                "a2a_fold", "ipc_fold")
_COLL_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG"}
_FOLDS = {"all_reduce": ("gather_fold", "ipc_one_store", "ipc_one_shot", "ipc_two_shot"),
          "reduce_scatter": ("a2a_fold", "ipc_fold")}
# One colour per (collective, route) pair the bench measures: tab20's ten dark hues first, then their light
# variants, so the first ten pairs never share a hue.
_PAIRS = [("all_reduce", r) for r in ("native", "native_ring_simple", "gather_fold", "ipc_one_store", "ipc_one_shot",
                                      "ipc_two_shot")]
_PAIRS += [("reduce_scatter", r) for r in ("native", "native_ring_simple", "a2a_fold", "ipc_fold")]
_PAIRS += [("all_gather", r) for r in ("native", "native_ring_simple", "ipc_fold")]
_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "fontsize": 7, "borderaxespad": 0.0}


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("detcomm-bench needs matplotlib for its plots: pip install matplotlib") from e
    matplotlib.use("Agg")  # files only: no display on CI or the GPU machines
    import matplotlib.pyplot as plt

    return plt


def _series(points: list[dict[str, Any]], key: Any) -> tuple[list[int], list[float]]:
    pts = sorted((p for p in points if key(p) is not None), key=lambda p: p["bytes"])
    return [p["bytes"] for p in pts], [key(p) for p in pts]


def _groups(result: dict[str, Any]) -> list[tuple[str, int]]:
    return sorted({(p["harness"], p["world"]) for p in result["points"]})


def _color(plt: Any, collective: str, route: str) -> Any:
    if (collective, route) not in _PAIRS:
        return "k"
    i = _PAIRS.index((collective, route))
    return plt.get_cmap("tab20")((2 * i) % 20 + (i >= 10))


def _style_x(ax: Any) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.grid(True, which="both", alpha=0.3)


def _title(fig: Any, text: str, width_in: float) -> None:
    # Wrapped to the figure's width (about 11 characters per inch at 10 pt), never cut at the edge.
    fig.suptitle(textwrap.fill(text, width=max(40, int(width_in * 11))), fontsize=10)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends outside the axes are kept in the file
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the three PNGs under ``out_dir``; return their paths."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [p for p in result["points"] if p["status"] == "ok" and p["eager"]]
    groups = _groups(result) or [("none", 0)]
    colls = [c for c in _COLL_SHORT if any(p["collective"] == c for p in ok)] or ["all_reduce"]
    title = f"{result['meta']['hardware']}, {result['meta']['date']}"
    panel_w = 7.5  # inches per column: the axes plus the legend to their right
    paths = []

    # Latency vs size, bf16 (fp32 is in the tables): rows = collectives, columns = harness/W.
    fig, axes = plt.subplots(len(colls), len(groups), figsize=(panel_w * len(groups), 3.8 * len(colls)),
                             squeeze=False)
    for j, (harness, world) in enumerate(groups):
        for i, coll in enumerate(colls):
            ax = axes[i][j]
            mine = [p for p in ok if (p["harness"], p["world"], p["collective"], p["dtype"]) ==
                    (harness, world, coll, "bfloat16")]
            for route in _ROUTE_ORDER:
                rp = [p for p in mine if p["route"] == route]
                for mode, ls in (("eager", "-"), ("graph", "--")):
                    pts = sorted((p for p in rp if p[mode]), key=lambda p: p["bytes"])
                    if not pts:
                        continue
                    xs = [p["bytes"] for p in pts]
                    color = _color(plt, coll, route)
                    ax.plot(xs, [p[mode]["median_us"] for p in pts], ls, marker=".", color=color,
                            label=f"{route}{' (CUDA graph)' if mode == 'graph' else ''}: median, p10..p90")
                    ax.fill_between(xs, [p[mode]["p10_us"] for p in pts], [p[mode]["p90_us"] for p in pts],
                                    color=color, alpha=0.18, linewidth=0)
            ax.set_yscale("log")
            ax.set_ylabel("µs per call")
            ax.set_title(f"{harness} W={world}: {coll}, bfloat16", fontsize=9)
            _style_x(ax)
            if ax.lines:
                ax.legend(**_LEGEND)
            else:
                ax.text(0.5, 0.5, "no bfloat16 points", ha="center", transform=ax.transAxes)
    _title(fig, f"detcomm-bench latency (median, band p10..p90): {title}", panel_w * len(groups))
    paths.append(_save(fig, plt, out_dir / "latency_vs_size.png"))

    # Divergence vs size: row 0 changed fraction, row 1 max ulps; every reduction route, bf16 solid, fp32 dashed.
    fig, axes = plt.subplots(2, len(groups), figsize=(panel_w * len(groups), 7.6), squeeze=False)
    for j, (harness, world) in enumerate(groups):
        for i, (key, ylab) in enumerate((("changed_frac", "fraction of elements changed"),
                                         ("max_ulps", "max ulps from the canonical fold"))):
            ax = axes[i][j]
            ax.set_title(f"{harness} W={world}", fontsize=9)
            ax.set_ylabel(ylab)
            if world == 2:
                # Two ranks add two values: a+b == b+a bit for bit, so no route can change a bit when rows move.
                ax.text(0.5, 0.5, "W=2: a+b == b+a, so no route can change a bit\nwhen rows move; divergence "
                        "needs W >= 3", ha="center", va="center", transform=ax.transAxes, fontsize=9)
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            _style_x(ax)
            for coll in ("all_reduce", "reduce_scatter"):
                for route in _ROUTE_ORDER:
                    for dtype, ls in (("bfloat16", "-"), ("float32", "--")):
                        rp = [p for p in ok if (p["harness"], p["world"], p["collective"], p["route"], p["dtype"]) ==
                              (harness, world, coll, route, dtype)]
                        xs, ys = _series(rp, lambda p, k=key: p[k])
                        ys = [min(y, 1e12) for y in ys]  # an infinite ulp distance plots at the top
                        if xs:
                            ax.plot(xs, ys, ls, marker="o" if coll == "all_reduce" else "s", ms=3,
                                    color=_color(plt, coll, route), label=f"{coll} {route} {dtype}")
            ax.set_yscale("symlog", linthresh=1e-3 if key == "changed_frac" else 1.0)
            ax.set_ylim(bottom=0)  # counts and fractions: no negative axis
            if ax.lines:
                ax.legend(**_LEGEND)
    _title(fig, f"detcomm-bench divergence when rows move in the batch: {title}", panel_w * len(groups))
    paths.append(_save(fig, plt, out_dir / "divergence_vs_size.png"))

    # Fold / native time ratio vs size.
    fig, axes = plt.subplots(1, len(groups), figsize=(panel_w * len(groups), 4.2), squeeze=False)
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
                            ax.plot(xs, ys, ls, marker=mk, ms=3, color=_color(plt, coll, route),
                                    label=f"{coll} {route} {dtype} {mode}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("fold median / native median")
        ax.set_title(f"{harness} W={world}" + (" (CPU timings: noise)" if harness == "gloo" else ""), fontsize=9)
        _style_x(ax)
        if ax.lines[1:]:
            ax.legend(**_LEGEND)
        else:
            ax.text(0.5, 0.5, "no native route on this harness", ha="center", transform=ax.transAxes)
    _title(fig, f"detcomm-bench fold/native time: {title}", panel_w * len(groups))
    paths.append(_save(fig, plt, out_dir / "ratio_vs_size.png"))
    return paths
