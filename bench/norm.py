"""The canonical RMSNorm (docs/spec.md §9) against torch's, on one CUDA device, under CUDA graphs.

    python bench/norm.py --out results/norm          # rows 1..256 x hidden 4096, 8192, bf16

For each (hidden, rows) it times, as medians of graph replays (``calls_per_graph`` captured calls per replay):

- ``torch_rms_norm``: torch.nn.functional.rms_norm (what an engine calls without batch invariance);
- ``hf_rms_norm``: the Hugging Face Llama formula (fp32 mean of squares, rsqrt, round, times the weight);
- ``detcomm_rms_norm``: detcomm.numerics.norm.rms_norm (the NVRTC kernel);
- ``torch_add_rms_norm``: residual + s, then torch's rms_norm (the unfused tail of an all-reduce);
- ``detcomm_add_rms_norm``: detcomm.numerics.norm.add_rms_norm (residual add and norm in one kernel pass).

Beside the times: whether the kernel's bits equal detcomm's torch implementation on the same device, and how
many of the first row's elements change bits when torch's rms_norm runs it alone instead of inside the batch
(its batch invariance; detcomm's is 0 by construction and checked here too). Writes norm.json and norm.md.

    python bench/norm.py --fused --nproc 2 --out results/fused   # W ranks, one per GPU, rl-bitwise

``--fused`` times the all-reduce + residual add + RMSNorm of docs/spec.md §9.2 on W ranks (NCCL group, one GPU
each, the CUDA-IPC workspace armed), every method captured in a CUDA graph on every rank (rank 0's medians):

- ``fused``: detcomm.all_reduce_residual_rmsnorm on its site (the fused workspace kernel the site chooses
  per launch: the one-store kernel, no barrier, at decode sizes; one-shot / two-shot above);
- ``fused_one_shot``: the workspace's fused one-shot kernel forced (its start and end barriers), beside ``fused``
  to show what the one-store kernel saves;
- ``unfused``: detcomm.all_reduce on an all-reduce site (the workspace's fold kernel), then
  detcomm.numerics.norm.add_rms_norm (the composition: two kernels);
- ``nccl_torch``: torch.distributed.all_reduce (NCCL, in place) then torch's rms_norm of residual + s (what an
  engine runs without batch invariance; three kernels).

Beside the times: which fused kernel the automatic choice takes for the shape, whether fused, fused_one_shot and
unfused give the same bits on every row and rank, and whether the first row's fused bits change when it runs alone
(one row takes the one-store kernel, the batch may not). Writes fused.json and fused.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from detcomm._spawn import LocalCluster
from detcomm.bench.timing import summarize, time_cuda_graph
from detcomm.errors import WorkspaceUnavailable
from detcomm.numerics import norm
from detcomm.tables import format_table

__all__ = ["main", "run"]

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HIDDEN = (4096, 8192)
EPS = 1e-6


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + EPS)).to(x.dtype)


def _graph_us(fn: Callable[[], object], *, calls_per_graph: int, iters: int,
              barrier: Callable[[], None] | None = None) -> dict[str, float]:
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

    return summarize(time_cuda_graph(capture, iters=iters, calls_per_graph=calls_per_graph, barrier=barrier))


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
            print("  ".join(_cells(rec)), file=sys.stderr, flush=True)  # progress; the table comes at the end
    return out


_COLS = ("torch_rms_norm", "hf_rms_norm", "detcomm_rms_norm", "torch_add_rms_norm", "detcomm_add_rms_norm")


_HEAD = ("hidden", "rows", *[f"{c} us" for c in _COLS], "detcomm/torch norm", "detcomm/torch add+norm",
         "kernel == torch impl", "torch row0 changed", "detcomm row0 changed")


def _cells(rec: dict[str, object]) -> list[str]:
    med = {c: rec[c]["median_us"] for c in _COLS}  # type: ignore[index]
    cells = [str(rec["hidden"]), str(rec["rows"]), *[f"{med[c]:.2f}" for c in _COLS],
             f"{med['detcomm_rms_norm'] / med['torch_rms_norm']:.2f}",
             f"{med['detcomm_add_rms_norm'] / med['torch_add_rms_norm']:.2f}",
             "yes" if rec["kernel_equals_torch_impl"] else "NO", str(rec["torch_row0_changed"]),
             str(rec["detcomm_row0_changed"])]
    return cells


_FUSED_COLS = ("fused", "fused_one_shot", "unfused", "nccl_torch")


def _fused_job(rank: int, world: int, rows: Sequence[int], hidden: Sequence[int], dtype_name: str,
               calls_per_graph: int, iters: int) -> list[dict[str, object]]:
    """One rank of ``--fused`` (collective: every rank runs the same calls)."""
    import torch.distributed as dist  # noqa: PLC0415

    import detcomm  # noqa: PLC0415
    from detcomm.workspace import debug  # noqa: PLC0415

    dtype = getattr(torch, dtype_name)
    detcomm.shutdown()
    comm = detcomm.init(numerics="rl-bitwise")
    dev = comm.device
    ws = comm._workspace  # the forced one-shot column calls the armed workspace directly
    if ws is None:
        raise WorkspaceUnavailable("--fused needs the CUDA-IPC workspace armed (one GPU per rank, peer access)")
    eps32 = norm.eps_fp32(EPS)
    out: list[dict[str, object]] = []
    for h in hidden:
        fused_site = detcomm.site(f"bench.norm.fused.{h}", collective="all_reduce_rmsnorm", dtype=dtype, shape=(h,),
                                  max_rows=max(rows))
        ar_site = detcomm.site(f"bench.norm.ar.{h}", collective="all_reduce", dtype=dtype, shape=(h,),
                               max_rows=max(rows))
        gen = torch.Generator(device=dev).manual_seed(1000 * rank + h)
        w = (1.0 + 0.1 * torch.randn(h, device=dev, generator=gen)).to(dtype)
        for n in rows:
            x = torch.randn(n, h, device=dev, generator=gen).to(dtype)
            res = torch.randn(n, h, device=dev, generator=gen).to(dtype)
            x_nccl = x.clone()

            def fused(x: torch.Tensor = x, res: torch.Tensor = res) -> tuple[torch.Tensor, torch.Tensor]:
                return detcomm.all_reduce_residual_rmsnorm(x, res, w, eps=EPS, site=fused_site)

            def fused_one_shot(x: torch.Tensor = x, res: torch.Tensor = res) -> tuple[torch.Tensor, torch.Tensor]:
                return ws.all_reduce_rmsnorm(x, res, w, eps32, algo="one_shot", label=f"bench.norm.fused_1shot.{h}")

            def unfused(x: torch.Tensor = x, res: torch.Tensor = res) -> tuple[torch.Tensor, torch.Tensor]:
                return norm.add_rms_norm(detcomm.all_reduce(x, ar_site), res, w, eps=EPS)

            def nccl_torch(x_nccl: torch.Tensor = x_nccl, res: torch.Tensor = res) -> object:
                dist.all_reduce(x_nccl)  # in place: the values grow, the time does not depend on them
                return torch.nn.functional.rms_norm(res + x_nccl, (h,), w, eps=EPS)

            y_f, r_f = fused()
            y_u, r_u = unfused()
            y_o, r_o = fused_one_shot()
            same = bool(torch.equal(_bits(y_f), _bits(y_u)) and torch.equal(_bits(r_f), _bits(r_u))
                        and torch.equal(_bits(y_o), _bits(y_u)) and torch.equal(_bits(r_o), _bits(r_u)))
            y_1, _ = detcomm.all_reduce_residual_rmsnorm(x[:1].contiguous(), res[:1].contiguous(), w, eps=EPS,
                                                         site=fused_site)
            flags = torch.tensor([0 if same else 1, int((_bits(y_1) != _bits(y_f[:1])).sum())], device=dev)
            dist.all_reduce(flags)
            # The kernel the site's automatic choice takes for these rows (none: the site composes, not fused).
            debug.record(ws)
            fused()
            auto = sorted(v for c, _, v in ws.variants_run or () if c == "all_reduce_rmsnorm") or ["composition"]
            rec: dict[str, object] = {"hidden": h, "rows": n, "world_size": world, "dtype": dtype_name,
                                      "fused_equals_unfused": int(flags[0]) == 0,
                                      "fused_row0_changed": int(flags[1]), "fused_kernel": ",".join(auto)}
            for name, fn in (("fused", fused), ("fused_one_shot", fused_one_shot), ("unfused", unfused),
                             ("nccl_torch", nccl_torch)):
                rec[name] = _graph_us(fn, calls_per_graph=calls_per_graph, iters=iters, barrier=dist.barrier)
            out.append(rec)
            if rank == 0:
                print("  ".join(_fused_cells(rec)), file=sys.stderr, flush=True)  # progress; the table comes at the end
    routes = str(detcomm.routes())
    detcomm.shutdown()
    return [{"routes": routes}, *out] if rank == 0 else out


_FUSED_HEAD = ("hidden", "rows", "fused kernel", *[f"{c} us" for c in _FUSED_COLS], "fused/unfused",
               "fused/fused_one_shot", "fused/nccl_torch", "fused == unfused", "fused row0 changed")


def _fused_cells(rec: dict[str, object]) -> list[str]:
    med = {c: rec[c]["median_us"] for c in _FUSED_COLS}  # type: ignore[index]
    cells = [str(rec["hidden"]), str(rec["rows"]), str(rec["fused_kernel"]), *[f"{med[c]:.2f}" for c in _FUSED_COLS],
             f"{med['fused'] / med['unfused']:.2f}", f"{med['fused'] / med['fused_one_shot']:.2f}",
             f"{med['fused'] / med['nccl_torch']:.2f}",
             "yes" if rec["fused_equals_unfused"] else "NO", str(rec["fused_row0_changed"])]
    return cells


def _main_fused(args: argparse.Namespace) -> int:
    from detcomm.envelope import envelope_environment  # noqa: PLC0415

    nproc = args.nproc or torch.cuda.device_count()
    # NCCL reads NCCL_ALGO/NCCL_PROTO when the ranks' communicator is created: rl-bitwise's environment first.
    with LocalCluster(nproc, backend="nccl", pg_timeout_s=300, env=envelope_environment("rl-bitwise")) as cluster:
        got = cluster.run(_fused_job, args.rows, args.hidden, args.dtype, args.calls_per_graph, args.iters,
                          timeout_s=1800)[0]
    routes, recs = got[0]["routes"], got[1:]
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    (args.out / "fused.json").write_text(json.dumps({"device": device, "torch": torch.__version__, "world_size": nproc,
                                                     "routes": routes, "records": recs}, indent=1))
    md = (f"device: {nproc}x {device}, torch {torch.__version__}, W={nproc} (one rank per GPU), {args.dtype}, "
          f"numerics=rl-bitwise, CUDA graphs, rank 0's median of {args.iters} replays of {args.calls_per_graph} "
          f"calls\n\n" + format_table(_FUSED_HEAD, [_fused_cells(r) for r in recs], markdown=True, align="l" * len(_FUSED_HEAD)) + "\n")
    (args.out / "fused.md").write_text(md + "\n" + routes + "\n")
    print(md)
    print(routes)
    bad = [r for r in recs if not r["fused_equals_unfused"] or r["fused_row0_changed"]]
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/norm.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-results-norm"))
    p.add_argument("--rows", type=lambda t: tuple(int(v) for v in t.split(",")), default=ROWS)
    p.add_argument("--hidden", type=lambda t: tuple(int(v) for v in t.split(",")), default=HIDDEN)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--calls-per-graph", type=int, default=20)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--fused", action="store_true", help="time the fused all-reduce + residual + RMSNorm on W ranks")
    p.add_argument("--nproc", type=int, help="--fused: ranks, one per GPU (default: every GPU)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the bench times the GPU kernel against torch's)")
    if args.fused:
        return _main_fused(args)
    recs = run(rows=args.rows, hidden=args.hidden, dtype=getattr(torch, args.dtype),
               calls_per_graph=args.calls_per_graph, iters=args.iters)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    (args.out / "norm.json").write_text(json.dumps({"device": device, "torch": torch.__version__,
                                                    "records": recs}, indent=1))
    md = f"device: {device}, torch {torch.__version__}, {args.dtype}, CUDA graphs, median of {args.iters} replays " \
         f"of {args.calls_per_graph} calls\n\n" + format_table(_HEAD, [_cells(r) for r in recs], markdown=True, align="l" * len(_HEAD)) + "\n"
    (args.out / "norm.md").write_text(md)
    print(md)
    bad = [r for r in recs if not r["kernel_equals_torch_impl"] or r["detcomm_row0_changed"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
