"""The canonical RMSNorm (docs/spec.md §9) against torch's, on one CUDA device, under CUDA graphs.

    python -m detcomm.bench.norm --out results/norm          # rows 1..256 x hidden 4096, 8192, bf16

For each (hidden, rows) it times, as medians of graph replays (``calls_per_graph`` captured calls per replay):

- ``torch_rms_norm``: torch.nn.functional.rms_norm (what an engine calls without batch invariance);
- ``hf_rms_norm``: the Hugging Face Llama formula (fp32 mean of squares, rsqrt, round, times the weight);
- ``detcomm_rms_norm``: detcomm.norm.rms_norm (the NVRTC kernel);
- ``torch_add_rms_norm``: residual + s, then torch's rms_norm (the unfused tail of an all-reduce);
- ``detcomm_add_rms_norm``: detcomm.norm.add_rms_norm (residual add and norm in one kernel pass).

Beside the times: whether the kernel's bits equal detcomm's torch implementation on the same device, and how
many of the first row's elements change bits when torch's rms_norm runs it alone instead of inside the batch
(its batch invariance; detcomm's is 0 by construction and checked here too). Writes norm.json and norm.md.
The all-reduce before the norm is timed by detcomm-bench per route; on one device there is no group to time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import norm
from .timing import summarize, time_cuda_graph

__all__ = ["main", "run"]

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HIDDEN = (4096, 8192)
EPS = 1e-6


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + EPS)).to(x.dtype)


def _graph_us(fn: Callable[[], object], *, calls_per_graph: int, iters: int) -> dict[str, float]:
    def capture() -> Callable[[], None]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm up on the capture stream (allocator, lazy loads)
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls_per_graph):
                fn()
        return graph.replay

    return summarize(time_cuda_graph(capture, iters=iters, calls_per_graph=calls_per_graph))


def _methods(s: torch.Tensor, res: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    h = w.shape[0]
    return {
        "torch_rms_norm": lambda: torch.nn.functional.rms_norm(r, (h,), w, eps=EPS),
        "hf_rms_norm": lambda: _hf_rms_norm(r, w),
        "detcomm_rms_norm": lambda: norm.rms_norm(r, w, eps=EPS),
        "torch_add_rms_norm": lambda: torch.nn.functional.rms_norm(res + s, (h,), w, eps=EPS),
        "detcomm_add_rms_norm": lambda: norm.add_rms_norm(s, res, w, eps=EPS),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def run(*, rows: Sequence[int], hidden: Sequence[int], dtype: torch.dtype, calls_per_graph: int,
        iters: int) -> list[dict[str, object]]:
    """One record per (hidden, rows) with each method's median/p10/p90 in microseconds and the bit checks."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    out: list[dict[str, object]] = []
    for h in hidden:
        w = (1.0 + 0.1 * torch.randn(h, device=dev, generator=gen)).to(dtype)
        for n in rows:
            s = torch.randn(n, h, device=dev, generator=gen).to(dtype)
            res = torch.randn(n, h, device=dev, generator=gen).to(dtype)
            r = (res.float() + s.float()).to(dtype)
            methods = _methods(s, res, r, w)
            rec: dict[str, object] = {"hidden": h, "rows": n, "dtype": str(dtype).removeprefix("torch.")}
            y = norm.rms_norm(r, w, eps=EPS)
            y2, r2 = norm.add_rms_norm(s, res, w, eps=EPS)
            rec["kernel_equals_torch_impl"] = bool(torch.equal(_bits(y), _bits(norm.rms_norm_torch(r, w, eps=EPS)))
                                                   and torch.equal(_bits(y2), _bits(y))
                                                   and torch.equal(_bits(r2), _bits(r)))
            rec["detcomm_row0_changed"] = int((_bits(norm.rms_norm(r[:1], w, eps=EPS)) != _bits(y[:1])).sum())
            t_alone = torch.nn.functional.rms_norm(r[:1], (h,), w, eps=EPS)
            t_batch = torch.nn.functional.rms_norm(r, (h,), w, eps=EPS)[:1]
            rec["torch_row0_changed"] = int((_bits(t_alone) != _bits(t_batch)).sum())
            rec["torch_vs_detcomm_elems_differ"] = int((_bits(t_batch) != _bits(y[:1])).sum())
            for name, fn in methods.items():
                rec[name] = _graph_us(fn, calls_per_graph=calls_per_graph, iters=iters)
            out.append(rec)
            print(_row_md(rec), file=sys.stderr, flush=True)
    return out


_COLS = ("torch_rms_norm", "hf_rms_norm", "detcomm_rms_norm", "torch_add_rms_norm", "detcomm_add_rms_norm")


def _header_md() -> str:
    head = ["hidden", "rows", *[f"{c} us" for c in _COLS], "detcomm/torch norm", "detcomm/torch add+norm",
            "kernel == torch impl", "torch row0 changed", "detcomm row0 changed"]
    return "| " + " | ".join(head) + " |\n|" + "---|" * len(head)


def _row_md(rec: dict[str, object]) -> str:
    med = {c: rec[c]["median_us"] for c in _COLS}  # type: ignore[index]
    cells = [str(rec["hidden"]), str(rec["rows"]), *[f"{med[c]:.2f}" for c in _COLS],
             f"{med['detcomm_rms_norm'] / med['torch_rms_norm']:.2f}",
             f"{med['detcomm_add_rms_norm'] / med['torch_add_rms_norm']:.2f}",
             "yes" if rec["kernel_equals_torch_impl"] else "NO", str(rec["torch_row0_changed"]),
             str(rec["detcomm_row0_changed"])]
    return "| " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m detcomm.bench.norm", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-results-norm"))
    p.add_argument("--rows", type=lambda t: tuple(int(v) for v in t.split(",")), default=ROWS)
    p.add_argument("--hidden", type=lambda t: tuple(int(v) for v in t.split(",")), default=HIDDEN)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--calls-per-graph", type=int, default=20)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the bench times the GPU kernel against torch's)")
    recs = run(rows=args.rows, hidden=args.hidden, dtype=getattr(torch, args.dtype),
               calls_per_graph=args.calls_per_graph, iters=args.iters)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    (args.out / "norm.json").write_text(json.dumps({"device": device, "torch": torch.__version__,
                                                    "records": recs}, indent=1))
    md = f"device: {device}, torch {torch.__version__}, {args.dtype}, CUDA graphs, median of {args.iters} replays " \
         f"of {args.calls_per_graph} calls\n\n" + _header_md() + "\n" + "\n".join(_row_md(r) for r in recs) + "\n"
    (args.out / "norm.md").write_text(md)
    print(md)
    bad = [r for r in recs if not r["kernel_equals_torch_impl"] or r["detcomm_row0_changed"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
