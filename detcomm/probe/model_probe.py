"""Model probe: the same requests generated alone, packed with random co-batches, and again (docs/spec.md §7).

A prompt set (half greedy, half temperature 1 with a per-request sampling stream keyed by (seed, position))
runs through the small tensor-parallel decoder of ``detcomm.probe.model``:

  alone      every request by itself at batch 1, its prompt in one prefill step, then one row per step;
  packed #1  all requests with random arrival, random prefill chunking and a random row budget per step,
             so a request's rows share steps with other requests' prefill chunks and decode rows, at
             varying offsets;
  packed #2  the same with another scheduling seed;
  rerun      packed #1 again from empty caches (run-to-run).

Token ids and fp32 logprobs are compared with torch.equal; the table gives, per comparison and sampling
mode, the requests that diverged and the first divergent position. Under a bitwise envelope nothing may
diverge (exit 1 otherwise). ``--route native`` under ``--numerics auto`` is the negative control: at W >= 3
the native all-reduce's order follows the message size and the row's offset, and the probe must catch it
(``--expect-divergence`` turns that into the exit status). A bitwise envelope refuses ``--route native`` before
the group starts, with the command to run instead.

    detcomm-launch --nproc 4 --numerics rl-bitwise -m detcomm.probe model
    detcomm-launch --nproc 4 --numerics auto -m detcomm.probe model --route native --expect-divergence
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

import detcomm
from detcomm.invariance import bits
from detcomm.tp import Layout, Segment

from ..tables import format_table
from .envelope import ROUTE_CHOICES, probe_numerics
from .model import SITE_NAMES, ModelConfig, TPTransformer
from .table import emit

__all__ = ["Request", "Result", "StepModel", "make_requests", "generate", "first_divergence", "compare_runs",
           "position_invariant", "ranks_agree", "summary", "request_records", "layout_from_args", "TABLE_HEADERS",
           "main"]

_MASK64 = (1 << 64) - 1

TABLE_HEADERS = ["comparison", "sampling", "diverged", "tokens equal", "logprobs equal", "first divergence",
                 "first token change"]


class StepModel(Protocol):
    """What ``generate`` drives: the probe's decoder (``TPTransformer``) or ``detcomm.hf.TPCausalLM``.
    ``forward`` returns an opaque logits object that ``logprobs`` ([S, vocab] fp32, full vocabulary) and
    ``greedy`` ([S] token ids) consume, and the indices of the sampling segments."""

    cfg: Any  # has .t_pad

    def new_cache(self) -> list[int]: ...

    def free_cache(self, blocks: list[int]) -> None: ...

    def forward(self, segments: Sequence[Segment]) -> tuple[Any, list[int]]: ...

    def logprobs(self, logits: Any) -> torch.Tensor: ...

    def greedy(self, logits: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class Request:
    """A prompt to continue by ``new_tokens`` tokens; temperature 0 is greedy."""

    rid: int
    prompt: tuple[int, ...]
    new_tokens: int
    temperature: float
    seed: int


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)

    def token_tensor(self) -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long)

    def logprob_tensor(self) -> torch.Tensor:
        return torch.stack(self.logprobs) if self.logprobs else torch.zeros(0)


def sampling_key(seed: int, position: int) -> int:
    """The per-request stream's key at ``position`` (splitmix64 of the pair): the noise a token sees
    depends on nothing but the request's seed and the token's position."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E5) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def sample(logprobs: torch.Tensor, *, temperature: float, seed: int, position: int) -> int:
    """Gumbel-max over fp32 logprobs / temperature with noise from ``sampling_key(seed, position)``."""
    g = torch.Generator().manual_seed(sampling_key(seed, position))
    u = torch.rand(logprobs.shape[0], generator=g, dtype=torch.float32).clamp_min(1e-30).to(logprobs.device)
    return int(torch.argmax(logprobs / temperature - torch.log(-torch.log(u))))


def make_requests(n: int, *, vocab: int, new_tokens: int, max_prompt: int, seed: int) -> list[Request]:
    """``n`` requests, alternately greedy and temperature 1, with random prompts of 2..max_prompt tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(2, max_prompt)
        out.append(Request(i, tuple(rng.randrange(vocab) for _ in range(length)), new_tokens,
                           0.0 if i % 2 == 0 else 1.0, rng.randrange(1 << 31)))
    return out


@dataclass
class _Live:
    req: Request
    cache: list[int]  # the request's block table in the model's paged KV cache
    fed: int = 0  # prompt tokens already in the cache
    result: Result = field(default_factory=Result)

    @property
    def done(self) -> bool:
        return len(self.result.tokens) >= self.req.new_tokens

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.req.prompt)


def _step(model: StepModel, work: list[tuple[_Live, Segment]]) -> None:
    shard, picks = model.forward([seg for _, seg in work])
    if not picks:
        return
    lps = model.logprobs(shard)
    greedy = model.greedy(shard)
    for j, i in enumerate(picks):
        live = work[i][0]
        position = len(live.req.prompt) + len(live.result.tokens)
        if live.req.temperature == 0.0:
            tok = int(greedy[j])
        else:
            tok = sample(lps[j], temperature=live.req.temperature, seed=live.req.seed, position=position)
        live.result.tokens.append(tok)
        live.result.logprobs.append(lps[j, tok].cpu())
        if live.done:  # its KV blocks serve the requests still running
            model.free_cache(live.cache)


def _segment(live: _Live, n: int) -> Segment:
    if live.prefilling:
        toks = live.req.prompt[live.fed : live.fed + n]
        seg = Segment(live.cache, toks, live.fed, sample=live.fed + n == len(live.req.prompt))
        live.fed += n
        return seg
    start = len(live.req.prompt) + len(live.result.tokens) - 1
    return Segment(live.cache, [live.result.tokens[-1]], start, sample=True)


def generate(model: StepModel, requests: Sequence[Request], *, schedule: int | None) -> dict[int, Result]:
    """Generate every request. ``schedule=None``: each alone at batch 1 (prompt in one step). Otherwise a
    random packed schedule from that seed. Same calls on every rank. Collective."""
    t_pad = model.cfg.t_pad
    if schedule is None:
        out = {}
        for req in requests:
            live = _Live(req, model.new_cache())
            while not live.done:
                _step(model, [(live, _segment(live, len(req.prompt) if live.prefilling else 1))])
            out[req.rid] = live.result
        return out

    rng = random.Random(schedule)
    lives = [_Live(r, model.new_cache()) for r in requests]
    arrival = {l.req.rid: rng.randrange(len(requests) + 1) for l in lives}
    step = 0
    while not all(l.done for l in lives):
        active = [l for l in lives if arrival[l.req.rid] <= step and not l.done]
        rng.shuffle(active)
        budget = rng.randint(1, t_pad)  # a random row budget: co-batches of every size
        work = []
        for live in active:
            if budget == 0:
                break
            n = rng.randint(1, min(budget, len(live.req.prompt) - live.fed)) if live.prefilling else 1
            work.append((live, _segment(live, n)))
            budget -= n
        if work:
            _step(model, work)
        step += 1
    return {l.req.rid: l.result for l in lives}


def first_divergence(a: Result, b: Result) -> tuple[int, str] | None:
    """First generated index where the token or the logprob's bits differ, and what differed."""
    for i, (ta, tb) in enumerate(zip(a.tokens, b.tokens)):
        if ta != tb:
            return i, "token"
        if not torch.equal(bits(a.logprobs[i]), bits(b.logprobs[i])):
            return i, "logprob"
    if len(a.tokens) != len(b.tokens):
        return min(len(a.tokens), len(b.tokens)), "length"
    return None


def _first_token_change(a: Result, b: Result) -> int | None:
    for i, (ta, tb) in enumerate(zip(a.tokens, b.tokens)):
        if ta != tb:
            return i
    return None


def position_invariant(ops: Sequence[tuple[Callable[[torch.Tensor], torch.Tensor], int]], *, t_pad: int,
                       dtype: torch.dtype, device: torch.device) -> bool:
    """Does each op (a row-wise local GEMM, with its input width) give a row the same bits at every offset of
    a fixed ``t_pad``-row buffer? (The fixed-width models' premise; checked so that a divergence is never
    blamed on the wrong part.)"""
    g = torch.Generator().manual_seed(7)
    for op, width in ops:
        x = torch.randn(t_pad, width, generator=g).to(dtype).to(device)
        want = op(x)[0]
        for off in range(1, t_pad):
            y = x.clone()
            y[[0, off]] = y[[off, 0]]
            if not torch.equal(bits(op(y)[off]), bits(want)):
                return False
    return True


def local_rows_invariant(model: TPTransformer) -> bool:
    """``position_invariant`` over every local GEMM of the model probe's decoder."""
    ops = [(lambda x, w=w: torch.matmul(x.to(w.dtype), w), w.shape[0]) for w in model.local_gemm_weights()]
    return position_invariant(ops, t_pad=model.cfg.t_pad, dtype=model.cfg.dtype, device=model.device)


def compare_runs(reqs: Sequence[Request], alone: dict[int, Result], packed1: dict[int, Result],
                 packed2: dict[int, Result], rerun: dict[int, Result]) -> tuple[list[list[str]], list[dict], bool]:
    """The probe table's rows (per comparison and sampling mode), their JSON records, and whether anything
    diverged."""
    comparisons = (("packed #1 vs alone", packed1, alone), ("packed #2 vs alone", packed2, alone),
                   ("rerun vs packed #1", rerun, packed1))
    rows, records, diverged_any = [], [], False
    for label, got, ref in comparisons:
        for mode, temp in (("greedy", 0.0), ("temperature 1", 1.0)):
            sel = [r for r in reqs if r.temperature == temp]
            divs = {r.rid: first_divergence(got[r.rid], ref[r.rid]) for r in sel}
            bad = {rid: d for rid, d in divs.items() if d is not None}
            diverged_any |= bool(bad)
            tok_eq = all(torch.equal(got[r.rid].token_tensor(), ref[r.rid].token_tensor()) for r in sel)
            lp_eq = all(torch.equal(bits(got[r.rid].logprob_tensor()), bits(ref[r.rid].logprob_tensor()))
                        for r in sel if got[r.rid].tokens == ref[r.rid].tokens)
            first = flip = "-"
            if bad:
                rid, (idx, what) = min(bad.items(), key=lambda kv: (kv[1][0], kv[0]))
                first = f"req {rid} token {idx} (position {len(reqs[rid].prompt) + idx}): {what}"
            flips = {r.rid: _first_token_change(got[r.rid], ref[r.rid]) for r in sel}
            changed = {k: v for k, v in flips.items() if v is not None}
            if changed:
                rid, idx = min(changed.items(), key=lambda kv: (kv[1], kv[0]))
                flip = f"req {rid} token {idx}"
            rows.append([label, mode, f"{len(bad)}/{len(sel)}", "yes" if tok_eq else "NO",
                         "yes" if lp_eq and tok_eq else "NO", first, flip])
            records.append({"comparison": label, "sampling": mode, "requests": len(sel),
                            "diverged": {str(k): {"token_index": v[0], "what": v[1]} for k, v in bad.items()}})
    return rows, records, diverged_any


def summary(*, passed: bool, numerics: str, local_ok: bool, agree: bool, seconds: float,
            expect_divergence: bool) -> str:
    """The two lines under a generation probe's table: its premises, then the verdict."""
    verdict = "PASS: bitwise identical alone, packed and rerun" if passed else "DIVERGED"
    if not passed and numerics not in detcomm.BITWISE_ENVELOPES:
        verdict += f" (numerics={numerics} makes no bitwise claim; the contract is checked with --numerics rl-bitwise)"
    return (f"local GEMMs row-position invariant at the padded width: {'yes' if local_ok else 'NO'}; "
            f"all ranks hold identical tokens and logprobs: {'yes' if agree else 'NO'}; {seconds:.1f} s\n"
            + verdict + (" (negative control: divergence expected)" if expect_divergence else ""))


def ranks_agree(results: dict[int, Result], device: torch.device) -> bool:
    flat = torch.cat([torch.cat([r.token_tensor(), bits(r.logprob_tensor()).to(torch.long)]) for r in results.values()])
    flat = flat.to(device)
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def layout_from_args(ns: argparse.Namespace) -> Layout:
    """The TP layout the --virtual-shards / --full-k flags select (ValueError when both, or with --route on
    full-K, whose layers have no all-reduce to force)."""
    if ns.virtual_shards is not None and ns.full_k:
        raise ValueError("--virtual-shards and --full-k are two layouts: pass one")
    if ns.virtual_shards is not None and ns.virtual_shards < 1:
        raise ValueError(f"--virtual-shards must be >= 1, got {ns.virtual_shards}")
    if getattr(ns, "shard_fold", "order") != "order" and ns.virtual_shards is None:
        raise ValueError("--shard-fold orders the sum of virtual shards: pass --virtual-shards V too")
    if ns.full_k and getattr(ns, "route", None):
        raise ValueError("--route forces the o_proj/down_proj all-reduce; the full-K layout has none")
    return "virtual" if ns.virtual_shards is not None else "full_k" if ns.full_k else "fold"


def layout_label(layout: str, virtual_shards: int | None, shard_fold: str = "order") -> str:
    if layout != "virtual":
        return layout
    return f"virtual V={virtual_shards}" + (" tree" if shard_fold == "tree" else "")


def request_records(reqs: Sequence[Request], results: dict[int, Result]) -> list[dict]:
    """Per request: its sampling setup, the generated token ids and every logprob's fp32 bit pattern in hex
    (comparable across runs and W by any tool)."""
    return [{"rid": r.rid, "temperature": r.temperature, "seed": r.seed, "prompt": list(r.prompt),
             "tokens": results[r.rid].tokens,
             "logprob_bits": [f"0x{int(b) & 0xFFFFFFFF:08x}" for b in bits(results[r.rid].logprob_tensor()).tolist()]}
            for r in reqs]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m detcomm.probe model", description=__doc__.split("\n\n")[0])
    p.add_argument("--numerics", default=None,
                   help="numerics envelope (default: $DETCOMM_NUMERICS, which detcomm-launch exports, else rl-bitwise)")
    p.add_argument("--route", default=None, choices=ROUTE_CHOICES,
                   help="force the o_proj/down_proj route (native, under numerics auto: the negative control)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--max-prompt", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--t-pad", type=int, default=32, help="fixed padded row width of the local GEMMs")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-pad", action="store_true",
                   help="run local GEMMs at the real row count (shows the probe catching local non-invariance)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--virtual-shards", type=int, default=None, metavar="V",
                   help="TP-size-invariant layout: o_proj/down_proj fold V fixed virtual shards (W must divide V)")
    p.add_argument("--shard-fold", choices=("order", "tree"), default="order",
                   help="with --virtual-shards: sum the V partials in shard order (any W dividing V) or by the fixed "
                        "balanced tree (V and W powers of two; one fp32 partial per rank on the wire)")
    p.add_argument("--full-k", action="store_true",
                   help="TP-size-invariant layout: o_proj/down_proj as full-K GEMMs on fixed column blocks")
    p.add_argument("--json", metavar="PATH",
                   help="rank 0 writes the results as JSON, with every request's token ids and logprob bits "
                        "(compare runs at different W with: python -m detcomm.probe tp-compare A.json B.json ...)")
    p.add_argument("--expect-divergence", action="store_true",
                   help="negative control: exit 0 only if the probe caught a divergence")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run on every rank; rank 0 prints. Exit 1 on any divergence (inverted by --expect-divergence)."""
    ns = build_parser().parse_args(argv)
    if ns.requests < 1 or ns.new_tokens < 1 or ns.max_prompt < 2:
        raise ValueError("--requests and --new-tokens must be >= 1, --max-prompt >= 2")
    if ns.max_prompt > ns.t_pad:
        raise ValueError(f"--max-prompt {ns.max_prompt} must fit one step at batch 1 (--t-pad {ns.t_pad})")
    layout = layout_from_args(ns)
    numerics = probe_numerics(ns.numerics, route=ns.route, command="model")
    torch.set_num_threads(1)  # W ranks share the cores; one thread each also keeps kernels single-path
    max_context = max(64, ns.max_prompt + ns.new_tokens)
    cfg = ModelConfig(layers=ns.layers, t_pad=ns.t_pad, seed=1234 + ns.seed,
                      dtype=torch.float32 if ns.dtype == "float32" else torch.bfloat16, max_context=max_context,
                      # every request may be live at once (packed schedules)
                      num_blocks=ns.requests * -(-max_context // ModelConfig.block_size))
    t0 = time.monotonic()
    comm = detcomm.init(numerics=numerics)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = TPTransformer(cfg, pad=not ns.no_pad, device=comm.device, layout=layout,
                              virtual_shards=ns.virtual_shards, shard_fold=ns.shard_fold)
        model.declare_sites(route=ns.route)
        table = detcomm.routes()
        local_ok = local_rows_invariant(model)
        reqs = make_requests(ns.requests, vocab=cfg.vocab, new_tokens=ns.new_tokens, max_prompt=ns.max_prompt,
                             seed=ns.seed)
        alone = generate(model, reqs, schedule=None)
        packed1 = generate(model, reqs, schedule=1000 + ns.seed)
        packed2 = generate(model, reqs, schedule=2000 + ns.seed)
        rerun = generate(model, reqs, schedule=1000 + ns.seed)
        agree = all(ranks_agree(r, comm.device) for r in (alone, packed1, packed2, rerun))
    finally:
        detcomm.shutdown()
    elapsed = time.monotonic() - t0

    rows, records, diverged_any = compare_runs(reqs, alone, packed1, packed2, rerun)
    routes = {e["site"]: e["route"] for e in table.as_dicts()}
    passed = not diverged_any and agree
    if rank == 0:
        title = (
            f"model probe: W={world} backend={table.backend} numerics={table.numerics} "
            f"layout={layout_label(layout, ns.virtual_shards, ns.shard_fold)} "
            f"o_proj/down_proj route={routes.get(SITE_NAMES['o_proj'], '-')}/{routes.get(SITE_NAMES['down_proj'], '-')} "
            f"dtype={ns.dtype} T_pad={'off' if ns.no_pad else cfg.t_pad} layers={cfg.layers} "
            f"hidden={cfg.hidden} vocab={cfg.vocab} ({cfg.vocab // world}/rank) requests={len(reqs)} "
            f"new_tokens={ns.new_tokens}"
        )
        emit(str(table), format_table(TABLE_HEADERS, rows, title=title) + "\n"
             + summary(passed=passed, numerics=table.numerics, local_ok=local_ok, agree=agree, seconds=elapsed,
                       expect_divergence=ns.expect_divergence))
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"world_size": world, "backend": table.backend, "numerics": table.numerics,
                           "routes": routes, "dtype": ns.dtype, "t_pad": None if ns.no_pad else cfg.t_pad,
                           "local_rows_invariant": local_ok, "ranks_agree": agree, "passed": passed,
                           "comparisons": records, "seconds": elapsed,
                           "layout": layout, "virtual_shards": ns.virtual_shards, "shard_fold": ns.shard_fold,
                           "requests": request_records(reqs, alone)}, f, indent=2)
    if ns.expect_divergence:
        return 0 if diverged_any else 1
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
