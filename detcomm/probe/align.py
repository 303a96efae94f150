"""Trainer alignment probe: a trainer's teacher-forced logprobs equal a server's sampling-time logprobs, bit for
bit, at another tensor-parallel width (docs/spec.md "TP-size invariance: layouts").

Two launches of the probe's decoder (``detcomm.probe.model``) in one layout:

  serve   at W_s ranks (a rollout server): generates the requests (half greedy, half temperature 1 with
          per-request seeded sampling) over the KV cache, packed with random co-batches and prefill chunks,
          and writes every request's prompt, token ids and sampling-time logprob bits to ``--out``;
  train   at W_t ranks (a trainer), a separate launch whose process group is created with the detcomm
          torch.distributed backend: for every request ONE forward over the whole sequence (prompt + generated
          tokens, teacher forcing: the training code path, no KV-cache decode), the log-softmax of every row,
          and the logprob of each generated token; compared bit for bit with the server's.

In a TP-size-invariant layout (``--virtual-shards V`` or ``--full-k`` on serve; train takes the server's
layout and model from its file) every token must match (PASS, exit 0); in the plain fold layout the widths'
reduction trees differ and the trainer must FAIL (the negative control: ``train --expect-fail``).

    detcomm-launch --nproc 4 -m detcomm.probe align serve --virtual-shards 8 --out rollout.json
    detcomm-launch --nproc 1 -m detcomm.probe align train --server rollout.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import detcomm
from detcomm.envelope import DEFAULT_NUMERICS
from detcomm.invariance import ulp_distance
from detcomm.tp import Segment

from ..tables import format_table
from .model import ModelConfig, TPTransformer
from .model_probe import generate, layout_from_args, layout_label, make_requests, request_records
from .table import emit

__all__ = ["serve", "teacher_forced_logprobs", "compare", "main", "TABLE_HEADERS"]

TABLE_HEADERS = ["sampling", "requests", "tokens", "logprob bits equal", "max ulps", "first mismatch"]


def _config(spec: dict[str, Any]) -> ModelConfig:
    return ModelConfig(layers=spec["layers"], t_pad=spec["t_pad"], seed=spec["seed"],
                       dtype=torch.float32 if spec["dtype"] == "float32" else torch.bfloat16,
                       max_context=spec["max_context"], num_blocks=spec["num_blocks"])


def serve(ns: argparse.Namespace) -> int:
    """The server's side (run on every rank; rank 0 writes ``--out``). Collective."""
    layout = layout_from_args(ns)
    if ns.max_prompt + ns.new_tokens - 1 > ns.t_pad:
        raise ValueError(f"a teacher-forced sequence (--max-prompt + --new-tokens - 1 = "
                         f"{ns.max_prompt + ns.new_tokens - 1} tokens) must fit one forward of --t-pad {ns.t_pad} rows")
    spec = {"layers": ns.layers, "t_pad": ns.t_pad, "seed": 1234 + ns.seed, "dtype": ns.dtype,
            "max_context": max(64, ns.max_prompt + ns.new_tokens), "layout": layout,
            # every request may be live at once (the packed schedule)
            "num_blocks": ns.requests * -(-max(64, ns.max_prompt + ns.new_tokens) // ModelConfig.block_size),
            "virtual_shards": ns.virtual_shards, "shard_fold": ns.shard_fold}
    torch.set_num_threads(1)
    comm = detcomm.init(numerics=ns.numerics or os.environ.get("DETCOMM_NUMERICS") or DEFAULT_NUMERICS)
    try:
        model = TPTransformer(_config(spec), device=comm.device, layout=layout, virtual_shards=ns.virtual_shards,
                              shard_fold=ns.shard_fold)
        model.declare_sites()
        reqs = make_requests(ns.requests, vocab=model.cfg.vocab, new_tokens=ns.new_tokens, max_prompt=ns.max_prompt,
                             seed=ns.seed)
        # Random co-batches and prefill chunks: the server's rows share steps the trainer never sees.
        results = generate(model, reqs, schedule=1000 + ns.seed)
        numerics, rank, world, device = comm.resolved.numerics, dist.get_rank(), dist.get_world_size(), comm.device
    finally:
        detcomm.shutdown()
    if rank == 0:
        with open(ns.out, "w") as f:
            json.dump({"world_size": world, "numerics": numerics, "device_type": device.type, "model": spec,
                       "requests": request_records(reqs, results)}, f, indent=2)
        emit(f"align serve: W={world} layout={layout_label(layout, ns.virtual_shards, ns.shard_fold)} numerics={numerics} "
             f"requests={len(reqs)} new_tokens={ns.new_tokens}: wrote {ns.out}")
    return 0


def teacher_forced_logprobs(model: TPTransformer, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """The fp32 logprob of each generated token from ONE forward over ``prompt + tokens[:-1]`` from an empty
    cache (row p predicts position p + 1). Collective."""
    seq = list(prompt) + list(tokens[:-1])
    cache = model.new_cache()
    shard = model.forward_all([Segment(cache, seq, 0)])
    model.free_cache(cache)
    lps = model.logprobs(shard)  # [len(seq), vocab]
    rows = torch.arange(len(prompt) - 1, len(seq), device=lps.device)
    return lps[rows, torch.tensor(list(tokens), dtype=torch.long, device=lps.device)].cpu()


def _from_hex(words: Sequence[str]) -> torch.Tensor:
    ints = [int(w, 16) for w in words]
    return torch.tensor([i - (1 << 32) if i >= 1 << 31 else i for i in ints], dtype=torch.int32).view(torch.float32)


def compare(server: dict[str, Any], trained: dict[int, torch.Tensor]) -> tuple[list[list[str]], int, int]:
    """Table rows per sampling mode, the number of tokens compared and the number whose bits differ."""
    rows, total, bad_total = [], 0, 0
    for mode, temp in (("greedy", 0.0), ("temperature 1", 1.0)):
        sel = [r for r in server["requests"] if r["temperature"] == temp]
        n = bad = 0
        worst, first = 0.0, "-"
        for r in sel:
            want, got = _from_hex(r["logprob_bits"]), trained[r["rid"]]
            d = ulp_distance(got, want)
            n += len(want)
            bad += int((d != 0).sum())
            worst = max(worst, float(d.max())) if len(d) else worst
            if first == "-" and bool((d != 0).any()):
                i = int((d != 0).nonzero()[0])
                first = f"req {r['rid']} token {i}: {float(got[i])!r} vs {float(want[i])!r}"
        rows.append([mode, str(len(sel)), str(n), f"{n - bad}/{n}", f"{worst:g}", first])
        total, bad_total = total + n, bad_total + bad
    return rows, total, bad_total


def train(ns: argparse.Namespace) -> int:
    """The trainer's side (run on every rank; rank 0 prints). Collective."""
    with open(ns.server) as f:
        server = json.load(f)
    spec = server["model"]
    # The training code path's process group: the detcomm torch.distributed backend (plain dist collectives fold).
    import detcomm.dist_backend  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    # The same kind of device as the server: exp, log and the GEMMs round the same only on the same platform.
    device = torch.device("cpu")
    if server.get("device_type", "cpu") == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{ns.server} was generated on CUDA devices: run the trainer on CUDA devices too")
        # More ranks than GPUs share them (detcomm.rendezvous_plan); the "detcomm" group then carries their CUDA
        # tensors through host memory (docs/trainers.md, "Ranks sharing one GPU").
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("detcomm", init_method="env://")
    t0 = time.monotonic()
    try:
        comm = detcomm.init(numerics=ns.numerics or os.environ.get("DETCOMM_NUMERICS") or server["numerics"],
                            device=device)
        try:
            model = TPTransformer(_config(spec), device=comm.device, layout=spec["layout"],
                                  virtual_shards=spec["virtual_shards"], shard_fold=spec.get("shard_fold", "order"))
            model.declare_sites()
            trained = {r["rid"]: teacher_forced_logprobs(model, r["prompt"], r["tokens"]) for r in server["requests"]}
        finally:
            detcomm.shutdown()
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
    finally:
        dist.destroy_process_group()
    rows, total, bad = compare(server, trained)
    passed = bad == 0
    if rank == 0:
        title = (f"trainer alignment: server W={server['world_size']} (KV-cache decode, packed) vs trainer W={world} "
                 f"(teacher forcing, one forward per sequence, process group backend={backend}, device={device.type}); "
                 f"layout={layout_label(spec['layout'], spec['virtual_shards'], spec.get('shard_fold', 'order'))} "
                 f"dtype={spec['dtype']} "
                 f"T_pad={spec['t_pad']}")
        verdict = (f"PASS: all {total} trainer logprobs equal the server's sampling-time logprobs bit for bit"
                   if passed else f"FAIL: {bad}/{total} trainer logprobs differ from the server's")
        if ns.expect_fail:
            verdict += " (negative control: FAIL expected)"
        emit(format_table(TABLE_HEADERS, rows, title=title), f"{verdict}; {time.monotonic() - t0:.1f} s")
    if ns.expect_fail:
        return 0 if not passed else 1
    return 0 if passed else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m detcomm.probe align", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("serve", help="generate at this launch's W and write the sampling-time logprobs")
    s.add_argument("--out", required=True, metavar="PATH", help="where rank 0 writes the rollout (JSON)")
    s.add_argument("--virtual-shards", type=int, default=None, metavar="V", help="virtual-shard layout (W | V)")
    s.add_argument("--shard-fold", choices=("order", "tree"), default="order",
                   help="with --virtual-shards: the shard-order fold or the fixed balanced tree (V, W powers of two)")
    s.add_argument("--full-k", action="store_true", help="full-K layout")
    s.add_argument("--requests", type=int, default=8)
    s.add_argument("--new-tokens", type=int, default=12)
    s.add_argument("--max-prompt", type=int, default=20)
    s.add_argument("--layers", type=int, default=2)
    s.add_argument("--t-pad", type=int, default=32)
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--numerics", default=None, help="numerics envelope (default: $DETCOMM_NUMERICS, else rl-bitwise)")
    t = sub.add_parser("train", help="recompute the server's logprobs by teacher forcing at this launch's W")
    t.add_argument("--server", required=True, metavar="PATH", help="the rollout `align serve` wrote")
    t.add_argument("--numerics", default=None, help="numerics envelope (default: $DETCOMM_NUMERICS, else the server's)")
    t.add_argument("--expect-fail", action="store_true",
                   help="negative control: exit 0 only if some logprob differs (e.g. the plain fold layout)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.role == "serve":
        if ns.requests < 1 or ns.new_tokens < 1 or ns.max_prompt < 2:
            raise ValueError("--requests and --new-tokens must be >= 1, --max-prompt >= 2")
        return serve(ns)
    return train(ns)


if __name__ == "__main__":
    sys.exit(main())
