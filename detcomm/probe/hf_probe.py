"""HF probe: a transformers causal LM, sharded over detcomm, generating the same requests alone, packed and rerun
(docs/spec.md §7).

The model is a local checkpoint (``--model DIR``, Llama / Mistral / Qwen2 / Qwen3, and the MoE families Mixtral /
Qwen2-MoE / Qwen3-MoE) or a tiny real config (``--config llama-tiny|...|qwen3-moe-tiny``) whose seeded random weights
are written with ``save_pretrained`` into a temporary directory and loaded back with ``from_pretrained``. The model
is loaded sliced (``detcomm.hf.sliced``: built on the meta device, each rank reading only its slices of the
safetensors files; ``--full-load``: transformers' ``from_pretrained`` of the whole model, then cut; the
TP-size-invariant layouts always load whole). It runs through ``detcomm.hf`` (fixed-width steps, static KV caches,
row-parallel o_proj/down_proj sites, vocabulary-parallel head). The requests, schedules and table are the model
probe's: alone at batch 1, packed twice with random co-batches and prefill chunking, and packed #1 rerun; half
greedy, half temperature 1 with per-request seeds. Under a bitwise envelope every row must read 0 (exit 1 otherwise);
``--route native --expect-divergence`` under ``--numerics auto`` is the negative control (the native all-reduce at
W >= 3 must be caught; a bitwise envelope refuses ``--route native`` before the group starts).

MoE models run their sparse blocks expert-parallel (``detcomm.hf.moe_block``): every expert on every rank by default;
``--ep`` spreads them (round-robin, or ``--placement-seed N``: a random placement with up to ``--max-replicas``
replicas per expert). Two placement seeds must give identical ``--json`` bits (``--compare A.json B.json`` checks, in
one process); ``--combine-order rank`` (numerics auto) is the negative control: the engines' rank-order sum of
per-rank partials moves bits with the replica chosen for a row, so with the batch, and with the placement.

    detcomm-launch --nproc 4 --numerics rl-bitwise -m detcomm.probe hf --config llama-tiny
    detcomm-launch --nproc 4 --numerics auto -m detcomm.probe hf --config llama-tiny --route native --expect-divergence
    detcomm-launch --nproc 4 --numerics rl-bitwise -m detcomm.probe hf --model /models/Qwen3-0.6B --dtype bfloat16
    detcomm-launch --nproc 4 -m detcomm.probe hf --config qwen3-moe-tiny --ep --placement-seed 1 --json a.json
    detcomm-launch --nproc 4 -m detcomm.probe hf --config qwen3-moe-tiny --ep --placement-seed 2 --json b.json
    python -m detcomm.probe hf --compare a.json b.json
    detcomm-launch --nproc 4 --numerics auto -m detcomm.probe hf --config qwen3-moe-tiny --ep --placement-seed 1 \
        --combine-order rank --expect-divergence
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import detcomm
from detcomm.moe import COMBINE_ORDERS, Placement

from ..dtypes import from_name
from ..hf.checkpoints import DTYPE_NAMES
from ..tables import format_table
from .bits import bits
from .envelope import ROUTE_CHOICES, probe_numerics
from .model_probe import (
    TABLE_HEADERS,
    Result,
    compare_runs,
    generate,
    layout_from_args,
    layout_label,
    make_requests,
    position_invariant,
    ranks_agree,
    summary,
)
from .table import emit

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from ..hf.checkpoints import TINY_CONFIGS

    p = argparse.ArgumentParser(prog="python -m detcomm.probe hf", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="local checkpoint directory (config.json + weights)")
    src.add_argument("--config", choices=sorted(TINY_CONFIGS), default=None,
                     help="tiny real config with seeded random weights (default llama-tiny when --model is not given)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    p.add_argument("--full-load", action="store_true",
                   help="load the whole model with from_pretrained, then cut it (default: each rank reads its slices)")
    p.add_argument("--numerics", default=None,
                   help="numerics envelope (default: $DETCOMM_NUMERICS, which detcomm-launch exports, else rl-bitwise)")
    p.add_argument("--route", default=None, choices=ROUTE_CHOICES,
                   help="force the route of the sum sites (native, under numerics auto: the negative control)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="create the process group with this backend (default: detcomm.init's, NCCL with CUDA, else gloo)")
    p.add_argument("--device", default=None,
                   help="tensor device (default: the communicator's); --backend gloo --device cuda:0 lets W ranks share one GPU")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=20)
    p.add_argument("--t-pad", type=int, default=64, help="fixed padded rows per step (a multiple of 64)")
    p.add_argument("--block-size", type=int, default=16,
                   help="positions per block of the paged KV cache (a power of two; part of the attention's arithmetic)")
    p.add_argument("--max-context", type=int, default=128, help="most tokens a request may cache (a multiple of 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--virtual-shards", type=int, default=None, metavar="V",
                   help="TP-size-invariant layout: o_proj/down_proj fold V fixed virtual shards (W must divide V)")
    p.add_argument("--shard-fold", choices=("order", "tree"), default="order",
                   help="with --virtual-shards: sum the V partials in shard order (any W dividing V) or by the fixed "
                        "balanced tree (V and W powers of two; one fp32 partial per rank on the wire)")
    p.add_argument("--full-k", action="store_true",
                   help="TP-size-invariant layout: o_proj/down_proj as full-K GEMMs on fixed column blocks")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes per request the token ids and logprob bits (hex)")
    p.add_argument("--expect-divergence", action="store_true",
                   help="negative control: exit 0 only if the probe caught a divergence")
    moe = p.add_argument_group("MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE)")
    moe.add_argument("--ep", action="store_true",
                     help="spread the experts over the ranks (default: every expert on every rank)")
    moe.add_argument("--placement-seed", type=int, default=None,
                     help="with --ep: a random placement from this seed (default: round-robin)")
    moe.add_argument("--max-replicas", type=int, default=2, help="with --placement-seed: replicas per expert, at most")
    moe.add_argument("--expert-block", type=int, default=64, help="rows per expert GEMM (the fixed shape)")
    moe.add_argument("--combine-order", choices=COMBINE_ORDERS, default="slot",
                     help="rank: the engines' rank-order sum (negative control, numerics auto only)")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="no model: compare two --json outputs' token ids and logprob bits (exit 1 if they differ)")
    return p


def compare_json(a_path: str, b_path: str) -> tuple[list[list[str]], bool]:
    """Table rows (per run label) comparing two ``--json`` files request by request, and whether any token id or
    logprob bit differs. Requests are matched by id; their prompts must be the same."""
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    ra, rb = ({r["rid"]: r for r in x["requests"]} for x in (a, b))
    if ra.keys() != rb.keys() or any(ra[i]["prompt"] != rb[i]["prompt"] for i in ra):
        raise ValueError(f"{a_path} and {b_path} hold different requests: run both with the same --seed/--requests")
    rows, differ = [], False
    for label in ra[min(ra)]["runs"]:
        bad = [i for i in sorted(ra) if ra[i]["runs"][label] != rb[i]["runs"][label]]
        first = ""
        if bad:
            x, y = ra[bad[0]]["runs"][label], rb[bad[0]]["runs"][label]
            pos = next((k for k, (p, q) in enumerate(zip(x["tokens"], y["tokens"])) if p != q), None)
            if pos is None:
                pos = next(k for k, (p, q) in enumerate(zip(x["logprob_bits"], y["logprob_bits"])) if p != q)
            first = f"request {bad[0]}, token {pos}"
        differ |= bool(bad)
        rows.append([label, f"{len(bad)}/{len(ra)}", first or "-"])
    return rows, differ


def _hex_bits(r: Result) -> list[str]:
    return [f"0x{int(b) & 0xFFFFFFFF:08x}" for b in bits(r.logprob_tensor()).tolist()]


def main(argv: Sequence[str] | None = None) -> int:
    """Run on every rank; rank 0 prints. Exit 1 on any divergence (inverted by --expect-divergence)."""
    ns = build_parser().parse_args(argv)
    if ns.compare:
        rows, differ = compare_json(*ns.compare)
        verdict = "DIFFER" if differ else "IDENTICAL"
        print(format_table(["run", "requests differing", "first difference"], rows,
                           title=f"{ns.compare[0]} vs {ns.compare[1]}: token ids and logprob bits") + f"\n{verdict}")
        return (0 if differ else 1) if ns.expect_divergence else (1 if differ else 0)
    layout = layout_from_args(ns)
    import transformers

    from ..hf import (
        Checkpoint,
        EPConfig,
        ServingConfig,
        TPCausalLM,
        checkpoint_config,
        load_causal_lm,
        meta_model,
        write_tiny_checkpoint,
    )
    from ..hf.moe_block import MOE_FAMILIES, num_experts

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if ns.requests < 1 or ns.new_tokens < 1 or ns.max_prompt < 2:
        raise ValueError("--requests and --new-tokens must be >= 1, --max-prompt >= 2")
    if ns.max_prompt > ns.t_pad:
        raise ValueError(f"--max-prompt {ns.max_prompt} must fit one step at batch 1 (--t-pad {ns.t_pad})")
    if ns.max_prompt + ns.new_tokens > ns.max_context:
        raise ValueError(f"--max-prompt + --new-tokens must fit --max-context {ns.max_context}")
    # every request may be live at once (packed schedules): the cache holds them all at max_context
    serving = ServingConfig(t_pad=ns.t_pad, max_context=ns.max_context, block_size=ns.block_size,
                            num_blocks=ns.requests * -(-ns.max_context // ns.block_size))
    serving.check()
    dtype = from_name(ns.dtype)
    numerics = probe_numerics(ns.numerics, route=ns.route, command="hf")
    torch.set_num_threads(1)  # W ranks share the cores; one thread each also keeps kernels single-path
    name = ns.model or (ns.config or "llama-tiny")
    t0 = time.monotonic()
    full_load = ns.full_load or layout != "fold"  # the invariant layouts' blocks are built from whole weights
    tmp = None
    if ns.model:
        directory = ns.model
    else:  # written before the process group exists: transformers saves on rank 0 only once a group is up, and
        # each rank (each node) writes and reads its own temporary copy
        tmp = tempfile.TemporaryDirectory(prefix="detcomm-hf-")
        directory = write_tiny_checkpoint(name, tmp.name, seed=1234 + ns.seed)
    hf_config: Any = checkpoint_config(directory, dtype=dtype)
    moe = hf_config.model_type in MOE_FAMILIES
    if (ns.ep or ns.placement_seed is not None or ns.combine_order != "slot") and not moe:
        raise ValueError(f"--ep/--placement-seed/--combine-order are for MoE models ({', '.join(MOE_FAMILIES)}); "
                         f"{name} is {hf_config.model_type!r}")
    if ns.placement_seed is not None and not ns.ep:
        raise ValueError("--placement-seed places the experts of --ep: pass --ep too")
    own_group = ns.backend is not None and not dist.is_initialized()
    if own_group:
        if ns.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group(backend=ns.backend, init_method="env://")
    comm = detcomm.init(numerics=numerics, **({} if ns.device is None else {"device": ns.device}))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        ep = None
        if moe:
            ep = EPConfig(placement=_placement(ns, num_experts(hf_config), world), block=ns.expert_block,
                          combine_order=ns.combine_order)
        if full_load:
            model = TPCausalLM(load_causal_lm(directory, dtype=dtype), serving, route=ns.route, ep=ep, layout=layout,
                               virtual_shards=ns.virtual_shards, shard_fold=ns.shard_fold)
        else:
            model = TPCausalLM(meta_model(hf_config, dtype=dtype), serving, route=ns.route, ep=ep,
                               checkpoint=Checkpoint(directory))
        if tmp is not None:
            tmp.cleanup()
        table = detcomm.routes()
        local_ok = position_invariant(model.local_ops(), t_pad=serving.t_pad, dtype=model.dtype, device=model.device)
        for block in model.shards.moe_blocks:  # each hosted expert at its own fixed shape
            local_ok &= position_invariant(block.expert_ops(), t_pad=ns.expert_block, dtype=model.dtype,
                                           device=model.device)
        reqs = make_requests(ns.requests, vocab=model.shards.vocab, new_tokens=ns.new_tokens,
                             max_prompt=ns.max_prompt, seed=ns.seed)
        runs = {"alone": generate(model, reqs, schedule=None),
                "packed #1": generate(model, reqs, schedule=1000 + ns.seed),
                "packed #2": generate(model, reqs, schedule=2000 + ns.seed),
                "rerun": generate(model, reqs, schedule=1000 + ns.seed)}
        agree = all(ranks_agree(r, comm.device) for r in runs.values())
    finally:
        detcomm.shutdown()
        if own_group:
            dist.destroy_process_group()
    elapsed = time.monotonic() - t0

    rows, records, diverged_any = compare_runs(reqs, runs["alone"], runs["packed #1"], runs["packed #2"], runs["rerun"])
    routes = {e["site"]: e["route"] for e in table.as_dicts()}
    row_routes = sorted({str(routes.get(s, "-")) for s in model.shards.row_sites})
    passed = not diverged_any and agree
    if rank == 0:
        cfg = model.config
        title = (
            f"HF probe: {cfg.model_type} ({name}) W={world} backend={table.backend} numerics={table.numerics} "
            f"layout={layout_label(layout, ns.virtual_shards, ns.shard_fold)} o_proj/down_proj route={'/'.join(row_routes)} "
            f"dtype={ns.dtype} load={'full' if full_load else 'sliced'} device={model.device} "
            f"T_pad={serving.t_pad} block_size={serving.block_size} max_context={serving.max_context} "
            f"layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} heads={cfg.num_attention_heads}/"
            f"kv {getattr(cfg, 'num_key_value_heads', None) or cfg.num_attention_heads} vocab={model.shards.vocab} "
            f"({model.shards.vocab_width}/rank) requests={len(reqs)} new_tokens={ns.new_tokens}"
            + (_moe_title(model, ns) if moe else "")
        )
        emit(str(table), format_table(TABLE_HEADERS, rows, title=title) + "\n"
             + summary(passed=passed, numerics=table.numerics, local_ok=local_ok, agree=agree, seconds=elapsed,
                       expect_divergence=ns.expect_divergence))
        if ns.json:
            per_request = [{"rid": r.rid, "prompt": list(r.prompt), "temperature": r.temperature, "seed": r.seed,
                            "runs": {label: {"tokens": res[r.rid].tokens, "logprob_bits": _hex_bits(res[r.rid])}
                                     for label, res in runs.items()}} for r in reqs]
            with open(ns.json, "w") as f:
                json.dump({"model": name, "model_type": model.config.model_type, "world_size": world,
                           "backend": table.backend, "numerics": table.numerics, "routes": routes,
                           "dtype": ns.dtype, "load": "full" if full_load else "sliced", "t_pad": serving.t_pad,
                           "block_size": serving.block_size,
                           "max_context": serving.max_context, "local_rows_invariant": local_ok,
                           "ranks_agree": agree, "passed": passed, "comparisons": records,
                           "experts": _moe_record(model, ns) if moe else None,
                           "requests": per_request, "seconds": elapsed, "layout": layout,
                           "virtual_shards": ns.virtual_shards, "shard_fold": ns.shard_fold}, f, indent=2)
    if ns.expect_divergence:
        return 0 if diverged_any else 1
    return 0 if passed else 1


def _placement(ns: argparse.Namespace, experts: int, world: int) -> Placement | None:
    if not ns.ep:
        return None  # every expert on every rank
    if ns.placement_seed is None:
        return Placement.round_robin(experts, world)
    return Placement.random(experts, world, seed=ns.placement_seed, max_replicas=min(ns.max_replicas, world))


def _moe_title(model: Any, ns: argparse.Namespace) -> str:
    b = model.shards.moe_blocks[0]
    where = ("every expert on every rank" if not ns.ep else "round-robin" if ns.placement_seed is None
             else f"random placement seed {ns.placement_seed} (<= {min(ns.max_replicas, model.world)} replicas)")
    return (f"\nMoE: {len(model.shards.moe_blocks)} expert-parallel blocks, {b.placement.num_experts} experts top-{b.top_k} "
            f"(renormalized={b.renormalize}), {where}, hosts {list(b.placement.hosts)}, expert block={b.block}, "
            f"combine={b.combine_order}")


def _moe_record(model: Any, ns: argparse.Namespace) -> dict[str, Any]:
    b = model.shards.moe_blocks[0]
    return {"ep": ns.ep, "placement_seed": ns.placement_seed, "hosts": [list(h) for h in b.placement.hosts],
            "top_k": b.top_k, "renormalize": b.renormalize, "block": b.block, "combine_order": b.combine_order,
            "blocks": [m.name for m in model.shards.moe_blocks]}


if __name__ == "__main__":
    sys.exit(main())
