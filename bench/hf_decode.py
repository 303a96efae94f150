"""Decode throughput of a transformers model served through ``detcomm.hf``: fold routes vs native, same run.

    detcomm-launch --nproc 8 --numerics rl-bitwise bench/hf_decode.py                 # 8 GPUs, NCCL
    detcomm-launch --nproc 2 --numerics rl-bitwise bench/hf_decode.py --backend gloo --device cuda:0
    python bench/hf_decode.py --help

A collective program (every rank runs it). It builds the probe's model family at a realistic width (Llama
architecture, default hidden 4096, 8 layers, 32 heads / 8 KV heads, FFN 14336, vocabulary 32000, bf16; seeded
random weights, built on the device, no checkpoint written; ``--model DIR`` loads a real one instead), shards it
with ``detcomm.hf`` and times greedy decode steps at each concurrency (default 1..64 requests, one row each,
every step at the fixed width T_pad = 64): phase "fold" under rl-bitwise (o_proj / down_proj / embedding on the
canonical-fold routes), then phase "native" under auto with those sites forced native, in the same process
and the same process group. Rank 0 prints tokens/s per concurrency and the ratio native / fold (the goal is
fold within 5%: ratio <= 1.05), and writes ``--json``.

Which numbers mean what:
* one rank per GPU over NCCL (``--backend nccl``, the default with CUDA): the fold-vs-native cost on that
  machine. This needs W GPUs; it is the number docs/performance.md asks for.
* W ranks sharing one GPU over gloo (``--backend gloo --device cuda:0``): the collectives stage through host
  memory and the ranks time-share the GPU, so tokens/s and the ratio say nothing about NCCL deployments;
  use it to check that the run works, and W = 1 for the local compute alone.
* the NCCL environment is the launch's: under ``--numerics rl-bitwise`` NCCL runs Ring/Simple for both
  phases (NCCL reads it when the communicator is created). ``--phases native`` under a launch with
  ``--numerics auto`` measures native with NCCL's own algorithm choice.
* every decode step is one ``next_tokens`` call (the step and its head: greedy token and logprob; one graph replay
  where the engine captures, one device-to-host copy); prefill tokens/s (one T_pad-token prompt a step) is printed
  under the table.
* ``--graphs``: each phase twice in the same run, its steps eager on fresh tensors (``cuda_graphs=False``) and
  replayed from CUDA graphs (``cuda_graphs="auto"``: captured once per row count; where the step cannot be captured
  it runs eagerly and the title says why), with the ratio graphs / eager. Without it every step runs eagerly.
Decode steps run the engine's one paged-attention call per layer over every row (see detcomm/hf/engine.py for what
the fixed width costs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["build_parser", "main", "add_decode_arguments", "time_decode", "profile_decode", "time_prefill",
           "copy_rate", "hf_generate_baseline", "HF_GENERATE_VARIANTS"]


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("expected positive integers")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/hf_decode.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--model", metavar="DIR", help="a local checkpoint instead of the seeded Llama-shaped model")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    add_decode_arguments(p, prompt=16, steps=16, warmup=3)
    p.add_argument("--phases", default="fold,native", help="which phases, in order: fold, native or both")
    p.add_argument("--graphs", action="store_true",
                   help="each phase eager and with CUDA graphs, same run (tokens/s of both and graphs / eager)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="process group backend when none exists (default: nccl with CUDA, else gloo)")
    p.add_argument("--device", default=None, help="tensor device (default: cuda:LOCAL_RANK for nccl, cpu for gloo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results as JSON")
    return p


def _build(ns: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    from detcomm.hf.checkpoints import load_causal_lm

    if ns.model:
        return load_causal_lm(ns.model, dtype=dtype)
    cfg = transformers.LlamaConfig(vocab_size=ns.vocab, hidden_size=ns.hidden, intermediate_size=ns.ffn,
                                   num_hidden_layers=ns.layers, num_attention_heads=ns.heads,
                                   num_key_value_heads=ns.kv_heads, max_position_embeddings=4096,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(ns.seed)  # the same weights on every rank (same device type, same seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode_step(lm: Any, caches: list[list[int]], toks: list[int], pos: int, *, logprobs: bool) -> int:
    """One greedy decode step of every request (one row each, at position ``pos``); updates ``toks`` in place
    and returns the next position. Collective. ``next_tokens``: the step and its head (greedy token and its
    logprob) in one call, one graph replay where the engine captures, one device-to-host copy; ``logprobs`` also
    computes the whole [S, vocab] logprobs after it (the head's logprob is computed either way)."""
    from detcomm.tp import Segment

    segs = [Segment(cache, [tok], pos) for cache, tok in zip(caches, toks)]
    toks[:] = lm.next_tokens(segs).tokens
    if logprobs:  # the whole distribution too, as a caller that keeps it would (eager, outside the step)
        logits, _ = lm.forward(segs)
        lm.logprobs(logits)
    return pos + 1


def add_decode_arguments(p: argparse.ArgumentParser, *, prompt: int, steps: int, warmup: int) -> None:
    """The decode-timing options this bench shares with bench/tp_decode.py (``time_decode`` reads them)."""
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16, 32, 64],
                   help="comma-separated numbers of concurrent decoding requests (each <= --t-pad)")
    p.add_argument("--t-pad", type=int, default=64)
    p.add_argument("--prompt", type=int, default=prompt, help="prompt tokens per request (prefilled, not timed)")
    p.add_argument("--steps", type=int, default=steps, help="timed decode steps per concurrency")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed decode steps first")
    p.add_argument("--logprobs", action="store_true", help="also compute the fp32 logprobs every step")


def _prefill(lm: Any, c: int, ns: argparse.Namespace, *, vocab: int, seed: int) -> tuple[list[list[int]], list[int], int]:
    """``c`` requests' prompts (``ns.prompt`` random tokens each, drawn from ``seed + c``) prefilled in T_pad-row
    steps, then ``ns.warmup`` decode steps: the caches, each request's next token and the next position.
    Collective, untimed."""
    from detcomm.tp import Segment

    caches = [lm.new_cache() for _ in range(c)]
    gen = torch.Generator().manual_seed(seed + c)
    prompts = [torch.randint(0, vocab, (ns.prompt,), generator=gen).tolist() for _ in range(c)]
    toks = [0] * c
    per_step = max(1, ns.t_pad // ns.prompt)
    for i in range(0, c, per_step):
        group = list(range(i, min(c, i + per_step)))
        logits, _ = lm.forward([Segment(caches[j], prompts[j], 0) for j in group])
        for j, t in zip(group, lm.greedy(logits).tolist()):
            toks[j] = int(t)
    pos = ns.prompt
    for _ in range(ns.warmup):
        pos = _decode_step(lm, caches, toks, pos, logprobs=ns.logprobs)
    return caches, toks, pos


def time_decode(lm: Any, concurrency: Sequence[int], ns: argparse.Namespace, *, vocab: int, seed: int = 0,
                repeats: int = 1) -> dict[int, float]:
    """Greedy decode tokens/s of ``lm`` (a detcomm.hf engine or the probe decoder) at each concurrency: prompts
    of ``ns.prompt`` random tokens prefilled in T_pad-row steps and ``ns.warmup`` steps untimed, then the best of
    ``repeats`` timed blocks of ``ns.steps`` steps (other load on the host only slows one block), each timed as
    the slowest rank's. Collective."""
    out = {}
    for c in concurrency:
        caches, toks, pos = _prefill(lm, c, ns, vocab=vocab, seed=seed)
        best = float("inf")
        for _ in range(repeats):
            _sync(lm.device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(ns.steps):
                pos = _decode_step(lm, caches, toks, pos, logprobs=ns.logprobs)
            _sync(lm.device)
            # The slowest rank's time is the step time.
            worst = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                                 device=lm.device if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            best = min(best, float(worst))
        out[c] = c * ns.steps / best
        for cache in caches:
            lm.free_cache(cache)
    return out


def time_prefill(lm: Any, ns: argparse.Namespace, *, vocab: int, seed: int = 0, repeats: int = 5) -> float:
    """Prefill tokens/s: one request's ``ns.t_pad``-token prompt in one full T_pad-row step (its token chosen
    in the step, ``next_tokens``), the median of ``repeats`` timed steps after one untimed. Collective."""
    from detcomm.tp import Segment

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (ns.t_pad,), generator=gen).tolist()
    times = []
    for i in range(repeats + 1):
        cache = lm.new_cache()
        _sync(lm.device)
        dist.barrier()
        t0 = time.perf_counter()
        lm.next_tokens([Segment(cache, prompt, 0)])
        _sync(lm.device)
        if i:
            times.append(time.perf_counter() - t0)
        lm.free_cache(cache)
    times.sort()
    return ns.t_pad / times[len(times) // 2]


def copy_rate(device: torch.device, *, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """The device's memory rate, bytes/s (read + write) of one large device-to-device copy, the median of
    ``repeats`` copies timed with CUDA events: the streaming limit a decode step is compared with."""
    if device.type != "cuda":
        raise ValueError("copy_rate times device memory: it needs a CUDA device")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    del src, dst
    return 2 * nbytes / times[len(times) // 2]


# transformers' own generate, in the order tried: (name, generate kwargs). "static+compile": a static cache,
# whose forward transformers compiles itself (torch.compile, mode "reduce-overhead": CUDA graphs) where its
# auto-compile criteria hold; "static": the same cache, compile disabled; "eager": the default dynamic cache.
HF_GENERATE_VARIANTS: dict[str, dict[str, Any]] = {
    "static+compile": {"cache_implementation": "static"},
    "static": {"cache_implementation": "static", "disable_compile": True},
    "eager": {},
}


def hf_generate_baseline(model: Any, concurrency: Sequence[int], *, prompt: int, new_tokens: int, vocab: int,
                         variants: Sequence[str], seed: int = 0, repeats: int = 3) -> dict[str, Any]:
    """transformers' own greedy ``model.generate`` (the unsharded model, this rank alone) at each concurrency:
    ``concurrency`` prompts of ``prompt`` random tokens, ``new_tokens`` new tokens each (min = max: no early
    stop), tokens/s = requests x new tokens / the generate call's wall time (the best of ``repeats`` after one
    untimed call, which pays any compile: its prompt's prefill included). Each variant of
    ``HF_GENERATE_VARIANTS`` is tried; one that raises is reported with its error, not retried under another
    name. Local (no collective)."""
    out: dict[str, Any] = {}
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    for name in variants:
        if name not in HF_GENERATE_VARIANTS:
            raise ValueError(f"--hf-generate takes {', '.join(HF_GENERATE_VARIANTS)}, got {name!r}")
        kw = HF_GENERATE_VARIANTS[name]
        res: dict[str, Any] = {}
        try:
            for c in concurrency:
                ids = torch.randint(0, vocab, (c, prompt), generator=gen).to(device)
                mask = torch.ones_like(ids)
                best = float("inf")
                for i in range(repeats + 1):
                    _sync(device)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)
                    _sync(device)
                    if i:
                        best = min(best, time.perf_counter() - t0)
                res[str(c)] = c * new_tokens / best
            out[name] = res
        except Exception as e:  # noqa: BLE001 - reported in the table: which variant ran is the result
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def profile_decode(lm: Any, concurrency: Sequence[int], ns: argparse.Namespace, *, vocab: int,
                   seed: int = 0) -> dict[int, dict[str, float]]:
    """Where a decode step's time goes on a GPU, per concurrency, from torch.profiler over ``ns.steps`` steps
    (after the same prefill and warmup as ``time_decode``): ``kernels`` (device operations per step: kernels,
    copies, memsets), ``busy_ms`` (their summed device time per step) and ``wall_ms`` (the step's host time, the
    profiler's overhead included: compare it with busy_ms, not with time_decode's numbers). A step whose busy_ms
    is far below its wall_ms is launch-bound: the GPU waits for the host to issue work; ``busy_pct`` = busy_ms /
    wall_ms (the device-busy share of a step). One decode step before the profiled ones captures any graph of
    that shape outside the profile. Collective."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if lm.device.type != "cuda":
        raise ValueError("profile_decode counts device work: run it on a CUDA device")
    out = {}
    for c in concurrency:
        caches, toks, pos = _prefill(lm, c, ns, vocab=vocab, seed=seed)
        pos = _decode_step(lm, caches, toks, pos, logprobs=ns.logprobs)  # any capture of this shape: before
        _sync(lm.device)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(ns.steps):
                pos = _decode_step(lm, caches, toks, pos, logprobs=ns.logprobs)
            _sync(lm.device)
            wall = time.perf_counter() - t0
        for cache in caches:
            lm.free_cache(cache)
        device_ops = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in device_ops) / 1e3 / ns.steps
        out[c] = {"kernels": len(device_ops) / ns.steps, "busy_ms": busy, "wall_ms": wall * 1e3 / ns.steps,
                  "busy_pct": 100.0 * busy / (wall * 1e3 / ns.steps)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run on every rank; rank 0 prints and writes --json."""
    ns = build_parser().parse_args(argv)
    import transformers

    import detcomm
    from detcomm.dtypes import from_name
    from detcomm.hf import ServingConfig, TPCausalLM
    from detcomm.probe.table import emit
    from detcomm.tables import format_table

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    phases = [p.strip() for p in ns.phases.split(",") if p.strip()]
    if not phases or any(p not in ("fold", "native") for p in phases):
        raise ValueError(f"--phases takes fold and/or native, got {ns.phases!r}")
    if not 1 <= ns.prompt <= ns.t_pad or ns.steps < 1 or ns.warmup < 0:
        raise ValueError(f"--prompt must be 1..--t-pad ({ns.t_pad}), --steps >= 1, --warmup >= 0")
    if max(ns.concurrency) > ns.t_pad:
        raise ValueError(f"--concurrency {max(ns.concurrency)} exceeds --t-pad {ns.t_pad} rows per step")
    max_context = -(-(ns.prompt + ns.warmup + ns.steps + 1) // 64) * 64
    # one concurrency's requests at a time (time_decode frees them before the next)
    serving = ServingConfig(t_pad=ns.t_pad, max_context=max_context,
                            num_blocks=max(ns.concurrency) * -(-max_context // ServingConfig.block_size))
    serving.check()
    dtype = from_name(ns.dtype)
    backend = ns.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local % torch.cuda.device_count())
    device = torch.device(ns.device or (f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"))
    if not dist.is_initialized():  # created here so that both phases share it (detcomm.shutdown keeps it)
        dist.init_process_group(backend=backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict[int, float]] = {}
    prefill: dict[str, float] = {}
    routes: dict[str, Any] = {}
    graphs_off: dict[str, str] = {}  # variant -> why its steps ran eagerly although graphs were asked for
    variants: list[tuple[str, bool | str]] = [("", False)] + ([(" graphs", "auto")] if ns.graphs else [])
    for phase in phases:
        detcomm.init(numerics="rl-bitwise" if phase == "fold" else "auto", device=device)
        try:
            for suffix, mode in variants:
                lm = TPCausalLM(_build(ns, device, dtype), dataclasses.replace(serving, cuda_graphs=mode),
                                route=None if phase == "fold" else "native")
                routes[phase] = next(e["route"] for e in detcomm.routes().as_dicts()
                                     if e["site"] == lm.shards.row_sites[0])
                if mode and not lm.cuda_graphs:
                    graphs_off[phase + suffix] = str(lm.graphs_reason)
                results[phase + suffix] = time_decode(lm, ns.concurrency, ns, vocab=lm.shards.vocab, seed=ns.seed)
                prefill[phase + suffix] = time_prefill(lm, ns, vocab=lm.shards.vocab, seed=ns.seed)
                if mode and lm.cuda_graphs and not lm.head_graphs:
                    graphs_off[phase + suffix + " head"] = f"the step captured, its head eager: {lm.head_graphs_reason}"
                lm.release_graphs()  # before shutdown: a graph holding an NCCL call would block it
                del lm
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            detcomm.shutdown()
    if rank == 0:
        names = [phase + suffix for phase in phases for suffix, _ in variants]
        cols = ["concurrency", *(f"tokens/s {n}" for n in names)]
        if ns.graphs:
            cols += [f"{p} graphs/eager" for p in phases]
        if {"fold", "native"} <= set(phases):
            cols.append("native/fold")
        rows: list[list[object]] = []
        for c in ns.concurrency:
            got = {n: results.get(n, {}).get(c) for n in names}
            row: list[object] = [c, *("-" if got[n] is None else round(got[n], 1) for n in names)]  # type: ignore[arg-type]
            ratios = [(f"{p} graphs", p) for p in phases] if ns.graphs else []
            if {"fold", "native"} <= set(phases):
                ratios.append(("native", "fold"))
            for num, den in ratios:
                a, b = got.get(num), got.get(den)
                row.append("-" if a is None or b is None else round(a / b, 3))
            rows.append(row)
        title = (f"HF decode: W={world} backend={backend} device={device} dtype={ns.dtype} "
                 f"{'model=' + ns.model if ns.model else f'hidden={ns.hidden} layers={ns.layers} heads={ns.heads}/kv {ns.kv_heads} ffn={ns.ffn} vocab={ns.vocab}'} "
                 f"T_pad={ns.t_pad} steps={ns.steps} logprobs={'yes' if ns.logprobs else 'no'} "
                 f"routes: {', '.join(f'{k}={v}' for k, v in routes.items())}"
                 + "".join(f"\n{k}: CUDA graphs off, eager: {v}" for k, v in graphs_off.items()))
        emit(format_table(cols, rows, title=title))
        emit("prefill tokens/s (one request's T_pad-token prompt in one step, median of 5): "
             + ", ".join(f"{n} {v:.0f}" for n, v in prefill.items()))
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"world_size": world, "backend": backend, "device": str(device), "dtype": ns.dtype,
                           "args": {k: v for k, v in vars(ns).items() if k != "json"}, "routes": routes,
                           "graphs_off": graphs_off, "prefill_tokens_per_s": prefill,
                           "tokens_per_s": {p: {str(c): v for c, v in r.items()} for p, r in results.items()}},
                          f, indent=2)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
