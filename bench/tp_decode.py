"""Decode tokens/s of the probe's tensor-parallel decoder in each TP layout: fold, virtual shards, full-K, native.

    detcomm-launch --nproc 4 --numerics rl-bitwise bench/tp_decode.py                     # CPU, gloo
    detcomm-launch --nproc 2 --numerics rl-bitwise bench/tp_decode.py --hidden 2048 --heads 16 \\
        --head-dim 128 --ffn 8192 --vocab 32000 --layers 4 --dtype bfloat16 --t-pad 64              # GPUs, NCCL

A collective program (every rank runs it). It builds ``detcomm.probe.model.TPTransformer`` (seeded weights) once
per phase and times greedy decode steps at each concurrency (one row per request, every step at the fixed
width T_pad; prompts prefilled untimed):

  fold     the plain Megatron layers, o_proj / down_proj on the canonical fold routes (rl-bitwise): batch-
           invariant at one W, not across W;
  virtual  virtual shards (``--virtual-shards V``, default 8): the same bits at every W dividing V;
  tree     virtual shards in the tree order (``shard_fold="tree"``): one fp32 partial per rank on the wire;
  full_k   full-K GEMMs on fixed column blocks and all-gathers: the same bits at every W dividing the blocks;
  native   the plain layers with o_proj / down_proj forced onto the library's all-reduce (numerics auto).

Rank 0 prints tokens/s per concurrency and layout and each layout's cost against fold, and writes ``--json``.
``--graphs``: each layout also with its steps captured in CUDA graphs (``cuda_graphs="auto"``, one graph per row
count), same run: columns "<layout> graphs" with the ratio to that layout's eager steps (and why a layout ran
eagerly, if one did, under the table).
The invariant layouts also run their local compute in fixed blocks (column blocks, vocabulary
blocks: docs/spec.md §9.1), which costs kernel launches at small widths: the numbers include that.

Every decode step is one ``next_tokens`` call: the step and its head (the greedy token and its logprob), one
graph replay where the layout captures, one device-to-host copy. On a CUDA device the same run also prints the
peers the issue's goals name (issue 42):
  * the device limit: the HBM copy rate (a 1 GiB device-to-device copy, CUDA events, median), and per layout and
    concurrency the step's weight + KV streaming time at that rate (this rank's local weights once, each
    request's K and V over its mean context) and step time / streaming time (goal: within 3x);
  * prefill tokens/s: one request's T_pad-token prompt in one step (median);
  * ``--hf-generate static+compile,static,eager``: transformers' own ``generate`` on a LlamaConfig of the same
    width (hidden, heads x head_dim, FFN, vocab, layers, dtype; random weights, no hub) at the same
    concurrencies, each variant guarded (one that raises prints its error; the table says which ran);
  * ``--profile``: the device-busy % of a decode step (torch.profiler: summed device-operation time / wall).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hf_decode import add_decode_arguments, copy_rate, hf_generate_baseline, profile_decode, time_decode, time_prefill

__all__ = ["build_parser", "main", "PHASES"]

PHASES = ("fold", "virtual", "tree", "full_k", "native")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/tp_decode.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--layouts", default=",".join(PHASES), help=f"comma-separated phases, in order, from {PHASES}")
    p.add_argument("--virtual-shards", type=int, default=8, metavar="V")
    p.add_argument("--shard-weights", choices=("fp32", "model"), default="fp32",
                   help="the virtual/tree layouts' shard storage (detcomm.tp.RowParallelLinear shard_weights): 'model' "
                        "keeps bf16 shards (half the bytes the CUDA shard kernel streams)")
    p.add_argument("--blocks", type=int, default=8, help="fixed blocks of the invariant layouts (W must divide it)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--ffn", type=int, default=384)
    p.add_argument("--vocab", type=int, default=1680)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_decode_arguments(p, prompt=8, steps=8, warmup=2)
    p.add_argument("--repeats", type=int, default=3, help="timed blocks of --steps steps; the fastest counts")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="process group backend when none exists (default: nccl with CUDA, else gloo)")
    p.add_argument("--device", default=None, help="tensor device (default: cuda:LOCAL_RANK for nccl, cpu for gloo)")
    p.add_argument("--profile", action="store_true",
                   help="GPU only: also profile --steps steps per concurrency and layout (device operations per "
                        "step, their device time, the step's wall time: how launch-bound each layout is)")
    p.add_argument("--graphs", action="store_true",
                   help="each layout eager and with CUDA graphs, same run (tokens/s of both and graphs / eager)")
    p.add_argument("--hf-generate", default="", metavar="VARIANTS",
                   help="also time transformers' own generate at the same width on rank 0, comma-separated variants "
                        "in order from static+compile, static, eager (CUDA only; default none)")
    p.add_argument("--no-limit", action="store_true", help="skip the HBM copy rate and the streaming ratios")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results as JSON")
    return p


def _stream_bytes(model: Any, cfg: Any, ns: argparse.Namespace) -> dict[int, float]:
    """Bytes one decode step must read at each concurrency: this rank's local GEMM weights once (the step's
    floor), and each request's K and V of every layer over its mean context in the timed blocks (the paged
    attention reads the actual context, whole KV blocks)."""
    weights = sum(w.numel() * w.element_size() for w in model.local_gemm_weights())
    ctx = ns.prompt + ns.warmup + (ns.repeats * ns.steps) / 2
    ctx = -(-ctx // cfg.block_size) * cfg.block_size
    per_req = cfg.layers * ctx * model.heads_local * cfg.head_dim * 2 * (2 if cfg.dtype == torch.bfloat16 else 4)
    return {c: float(weights + c * per_req) for c in ns.concurrency}


def _tf_version() -> str:
    import transformers

    return str(transformers.__version__)


def _hf_generate(cfg: Any, ns: argparse.Namespace, device: torch.device, names: list[str]) -> dict[str, Any]:
    """transformers' own generate on a LlamaConfig of the probe's width (MHA: kv heads = heads), random weights."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    lc = transformers.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                                  num_key_value_heads=cfg.heads, head_dim=cfg.head_dim,
                                  max_position_embeddings=max(4096, cfg.max_context), tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(lc)
    model = model.to(cfg.dtype).eval()
    try:
        return hf_generate_baseline(model, ns.concurrency, prompt=ns.prompt, new_tokens=ns.steps, vocab=cfg.vocab,
                                    variants=names)
    finally:
        del model
        torch.cuda.empty_cache()


def main(argv: Sequence[str] | None = None) -> int:
    """Run on every rank; rank 0 prints and writes --json."""
    ns = build_parser().parse_args(argv)
    import detcomm
    from detcomm.probe.model import ModelConfig, TPTransformer
    from detcomm.probe.table import emit
    from detcomm.tables import format_table

    phases = [p.strip() for p in ns.layouts.split(",") if p.strip()]
    if not phases or any(p not in PHASES for p in phases):
        raise ValueError(f"--layouts takes {', '.join(PHASES)}, got {ns.layouts!r}")
    if not 1 <= ns.prompt <= ns.t_pad or ns.steps < 1 or ns.warmup < 0 or ns.repeats < 1:
        raise ValueError(f"--prompt must be 1..--t-pad ({ns.t_pad}), --steps and --repeats >= 1, --warmup >= 0")
    if max(ns.concurrency) > ns.t_pad:
        raise ValueError(f"--concurrency {max(ns.concurrency)} exceeds --t-pad {ns.t_pad} rows per step")
    max_context = -(-(ns.prompt + ns.warmup + ns.repeats * ns.steps + 1) // 64) * 64
    cfg = ModelConfig(vocab=ns.vocab, hidden=ns.hidden, heads=ns.heads, head_dim=ns.head_dim, ffn=ns.ffn,
                      layers=ns.layers, t_pad=ns.t_pad, blocks=ns.blocks, max_context=max_context,
                      # one concurrency's requests at a time (time_decode frees them before the next)
                      num_blocks=max(ns.concurrency) * -(-max_context // ModelConfig.block_size),
                      dtype=torch.float32 if ns.dtype == "float32" else torch.bfloat16)
    backend = ns.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    device = torch.device(ns.device or (f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"))
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if not dist.is_initialized():  # created here so that every phase shares it (detcomm.shutdown keeps it)
        dist.init_process_group(backend=backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    if ns.profile and device.type != "cuda":
        raise ValueError("--profile counts device work: it needs a CUDA device")
    results: dict[str, dict[int, float]] = {}
    prefill: dict[str, float] = {}
    stream_bytes: dict[str, dict[int, float]] = {}  # per variant and concurrency: bytes one decode step streams
    profiles: dict[str, dict[int, dict[str, float]]] = {}
    graphs_off: dict[str, str] = {}
    head_off: dict[str, str] = {}  # captured steps whose head runs eagerly after the graph, and why
    variants: list[tuple[str, bool | str]] = [("", False)] + ([(" graphs", "auto")] if ns.graphs else [])
    for phase in phases:
        detcomm.init(numerics="auto" if phase == "native" else "rl-bitwise", device=device)
        try:
            layout = "fold" if phase == "native" else "virtual" if phase == "tree" else phase
            for suffix, mode in variants:
                name = phase + suffix
                model = TPTransformer(cfg, device=device, layout=layout,  # type: ignore[arg-type]
                                      virtual_shards=ns.virtual_shards if layout == "virtual" else None,
                                      shard_fold="tree" if phase == "tree" else "order", cuda_graphs=mode,
                                      shard_weights=ns.shard_weights if layout == "virtual" else "fp32")
                model.declare_sites(route="native" if phase == "native" else None)
                if mode and not model.cuda_graphs:
                    graphs_off[name] = str(model.graphs_reason)
                elif mode and not model.head_graphs:
                    head_off[name] = str(model.head_graphs_reason)
                # An untimed pass first: a process's first steps pay one-time costs (allocator, kernel caches).
                time_decode(model, [1], ns, vocab=cfg.vocab)
                results[name] = time_decode(model, ns.concurrency, ns, vocab=cfg.vocab, repeats=ns.repeats)
                prefill[name] = time_prefill(model, ns, vocab=cfg.vocab)
                stream_bytes[name] = _stream_bytes(model, cfg, ns)
                if ns.profile:
                    profiles[name] = profile_decode(model, ns.concurrency, ns, vocab=cfg.vocab)
                model.release_graphs()  # before shutdown: a graph holding an NCCL call would block it
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            detcomm.shutdown()
    rate = copy_rate(device) if device.type == "cuda" and not ns.no_limit else None
    phases = [phase + suffix for phase in phases for suffix, _ in variants]
    if rank == 0:
        rows: list[list[object]] = []
        for c in ns.concurrency:
            fold = results.get("fold", {}).get(c)
            row: list[object] = [c]
            for p in phases:
                v = results[p][c]
                if p.endswith(" graphs"):  # against the same layout's eager steps
                    row.append(f"{v:.1f} ({v / results[p[: -len(' graphs')]][c]:.2f}x eager)")
                else:
                    row.append(f"{v:.1f}" + ("" if fold is None or p == "fold" else f" ({v / fold:.2f}x)"))
            rows.append(row)
        title = (f"probe decoder decode tokens/s: W={world} backend={backend} device={device} dtype={ns.dtype} "
                 f"hidden={cfg.hidden} layers={cfg.layers} heads={cfg.heads}x{cfg.head_dim} ffn={cfg.ffn} "
                 f"vocab={cfg.vocab} T_pad={cfg.t_pad} V={ns.virtual_shards} blocks={cfg.blocks} "
                 f"best of {ns.repeats}x{ns.steps} steps "
                 f"logprobs={'yes' if ns.logprobs else 'no'}; (x) = tokens/s relative to fold")
        emit(format_table(["concurrency", *phases], rows, title=title))
        for name, why in graphs_off.items():
            emit(f"{name}: CUDA graphs off, eager: {why}")
        for name, why in head_off.items():
            emit(f"{name}: the step captured, its head eager after the graph: {why}")
        if ns.graphs:
            emit("graphs: " + ", ".join(f"{p} {'step + head in one graph' if p not in graphs_off and p not in head_off else 'see above'}"
                                        for p in phases if p.endswith(' graphs')))
        emit(format_table(["layout", "prefill tokens/s"], [[p, f"{prefill[p]:.0f}"] for p in phases],
                          title=f"prefill: one request's {ns.t_pad}-token prompt in one T_pad-row step (median of 5)"))
        if rate is not None:
            lrows = [[c, *(f"{c / results[p][c] * 1e3:.3f} / {stream_bytes[p][c] / rate * 1e3:.3f} / "
                           f"{c / results[p][c] / (stream_bytes[p][c] / rate):.1f}x" for p in phases)]
                     for c in ns.concurrency]
            emit(format_table(["concurrency", *phases], lrows,
                              title=f"device limit: HBM copy rate {rate / 1e12:.2f} TB/s (1 GiB device-to-device "
                                    "copy, read + write, median of 10); per decode step: step ms / weight + KV "
                                    "streaming ms at that rate / ratio (goal <= 3x)"))
        if profiles:
            prow = [[c, *(f"{profiles[p][c]['kernels']:.0f} / {profiles[p][c]['busy_ms']:.2f} / "
                          f"{profiles[p][c]['wall_ms']:.2f} / {profiles[p][c]['busy_pct']:.0f}%" for p in phases)]
                    for c in ns.concurrency]
            emit(format_table(["concurrency", *phases], prow,
                              title=f"rank 0, per decode step (torch.profiler, {ns.steps} steps): device operations / "
                                    "their device ms / wall ms / device busy % (goal >= 60 %; busy far below wall: "
                                    "launch-bound)"))

    def dump(hf_gen: dict[str, Any]) -> None:
        if not ns.json:
            return
        with open(ns.json, "w") as f:
            json.dump({"world_size": world, "backend": backend, "device": str(device),
                       "args": {k: v for k, v in vars(ns).items() if k != "json"},
                       "tokens_per_s": {p: {str(c): v for c, v in r.items()} for p, r in results.items()},
                       "graphs_off": graphs_off, "head_eager": head_off, "prefill_tokens_per_s": prefill,
                       "hbm_copy_bytes_per_s": rate, "hf_generate": hf_gen,
                       "stream_bytes": {p: {str(c): v for c, v in r.items()} for p, r in stream_bytes.items()},
                       "profile": {p: {str(c): v for c, v in r.items()} for p, r in profiles.items()}},
                      f, indent=2)

    # transformers' generate last, after the tables above are out (and the JSON written): a compile that outlasts
    # the stage's limit loses only its own numbers.
    if rank == 0:
        dump({})
    hf_gen: dict[str, Any] = {}
    hf_names = [v.strip() for v in ns.hf_generate.split(",") if v.strip()]
    if hf_names and rank == 0:
        if device.type != "cuda":
            raise ValueError("--hf-generate times transformers' generate on a CUDA device")
        hf_gen = _hf_generate(cfg, ns, device, hf_names)
    if rank == 0:
        if hf_gen:
            names = list(hf_gen)
            hrows = [[c, *(hf_gen[n].get(str(c), "-") if "error" not in hf_gen[n] else "failed" for n in names)]
                     for c in ns.concurrency]
            hrows = [[r[0], *(f"{v:.1f}" if isinstance(v, float) else v for v in r[1:])] for r in hrows]
            emit(format_table(["concurrency", *(f"transformers generate {n}" for n in names)], hrows,
                              title=f"transformers {_tf_version()} generate tokens/s on rank 0 alone, LlamaConfig at the "
                                    f"same width, {ns.dtype}, greedy, {ns.prompt}-token prompts, {ns.steps} new "
                                    "tokens (the prompt's prefill included)"))
            for n in names:
                if "error" in hf_gen[n]:
                    emit(f"transformers generate {n}: did not run: {hf_gen[n]['error']}")
            if "fold graphs" in results or "fold" in results:
                ref = "fold graphs" if "fold graphs" in results else "fold"
                ran = [n for n in names if "error" not in hf_gen[n]]
                for c in ns.concurrency:
                    emit(f"{ref} vs transformers at {c} requests: "
                         + ", ".join(f"{results[ref][c] / hf_gen[n][str(c)]:.2f}x {n}" for n in ran))
        dump(hf_gen)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
