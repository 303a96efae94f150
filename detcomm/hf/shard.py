"""Shard a transformers causal LM in place over the W ranks of the detcomm group (Megatron layout).

Per decoder layer: q/k/v_proj and gate/up_proj keep this rank's output columns (column-parallel, whole
attention and KV heads, whole FFN slices); o_proj and down_proj become ``RowParallelLinear`` over the matching
input columns, their partial sums reduced by ``detcomm.all_reduce`` at the site named after the module's
qualified name (``model.layers.3.self_attn.o_proj``). The embedding and the LM head become vocabulary-parallel
(``model.embed_tokens``, ``lm_head.*`` sites). Everything else (norms, rotary tables, activations, Qwen3's
per-head q/k norms) stays transformers' own module, replicated.

Under a bitwise envelope (and no forced route: ``fuse_boundaries``), in the fold layout and the tree-order
virtual layout (``fused_layout``), every layer boundary after a bias-free row-parallel projection is one
``detcomm.all_reduce_residual_rmsnorm`` call, declared as collective ``all_reduce_rmsnorm`` at
``<projection site>.add_norm`` (``model.layers.3.self_attn.o_proj.add_norm``; in the tree layout with the
projection's ``virtual_shards=V, shard_fold="tree"``); the plain all-reduce sites stay declared for transformers'
own forward.

Grouped-query models run at more ranks than KV heads: when W is a multiple of num_key_value_heads, each KV
head is replicated over W / num_key_value_heads ranks (rank r holds KV head r // (W / num_key_value_heads) and
the query heads that attend to it), as vLLM, SGLang and TensorRT-LLM do. The shapes are checked before anything
is cut: a head count or FFN width that W does not divide, or a KV head count that W neither divides nor is a
multiple of, is refused with the world sizes that would work (``world_sizes``).

``shard_model`` also runs on a model built on the meta device: it records where each cut parameter lies in
the checkpoint (``Shards.cuts``), and ``detcomm.hf.sliced`` then reads just those slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import detcomm

from .layers import (
    BlockColumnLinear,
    BlockVocabHead,
    InvariantRowLinear,
    RowParallelLinear,
    StepRows,
    VocabParallelEmbedding,
    VocabParallelHead,
    column_shard,
    vocab_shard_width,
)
from .moe_block import MOE_FAMILIES, EPConfig, EPMoEBlock, dense_ffn_width, moe_block_of

__all__ = ["SUPPORTED_FAMILIES", "Shards", "Cut", "check_divisible", "world_sizes", "kv_head_of", "kv_fits",
           "invariant_blocks", "shard_model", "declare_sites", "add_norm_site", "fused_layout", "fuse_boundaries"]

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", *MOE_FAMILIES)


@dataclass(frozen=True)
class Cut:
    """Where one parameter of a rank's shard lies in the checkpoint tensor of the same name: rows (``dim`` 0)
    or columns (``dim`` 1) [start, stop). Rows past the tensor's end are zeros (the padded vocabulary shards).
    ``full``: the whole (unsharded) parameter's shape, which the stored tensor must have (a slice alone would let
    a tensor stored larger than the config load, detcomm.hf.sliced checks it)."""

    dim: int
    start: int
    stop: int
    full: tuple[int, ...] = ()


@dataclass(frozen=True)
class Shards:
    """What this rank holds after ``shard_model``."""

    rank: int
    world: int
    heads: int  # attention heads on this rank
    kv_heads: int  # KV heads on this rank
    head_dim: int
    ffn: int  # FFN columns on this rank
    vocab: int  # real vocabulary size
    vocab_width: int  # embedding / LM-head rows per rank (padded)
    row_sites: tuple[str, ...]  # o_proj / down_proj sites in layer order
    embed_site: str
    head_sites: dict[str, str]  # gather, argmax, stats, logprobs
    moe_blocks: tuple[EPMoEBlock, ...] = ()  # expert-parallel MoE blocks in layer order (detcomm.hf.moe_block)
    layout: str = "fold"  # "fold", "virtual" or "full_k"
    blocks: int = 1  # fixed blocks of the invariant layouts (heads, KV heads, FFN, hidden, vocabulary)
    # fused layer-boundary sites of the bias-free row-parallel projections (the layouts of fused_layout)
    norm_sites: tuple[str, ...] = ()
    virtual_shards: int | None = None  # layout "virtual": V, and the order its V partials are summed in
    shard_fold: str = "order"
    # fold layout: the cut parameters (name -> Cut); every other parameter is its checkpoint tensor, whole,
    # except the expert-parallel blocks' (EPMoEBlock). What detcomm.hf.sliced reads.
    cuts: dict[str, Cut] = field(default_factory=dict)


def add_norm_site(row_site: str) -> str:
    """The fused all-reduce + residual add + RMSNorm site of a row-parallel projection's site (the model
    probe's naming: ``<site>.add_norm``)."""
    return f"{row_site}.add_norm"


def fused_layout(layout: str, shard_fold: str = "order") -> bool:
    """Whether a layout's layer boundaries can be one ``detcomm.all_reduce_residual_rmsnorm`` call each: the fold
    layout (this rank's partial product at a plain ``all_reduce_rmsnorm`` site, docs/spec.md §9.2) and the
    tree-order virtual layout (this rank's V/W fp32 shard partials, ``detcomm.tp.RowParallelLinear.partials``, at a
    site declared with ``virtual_shards=V, shard_fold="tree"``: §9.2 "Tree sites"; the workspace serves it with the
    fused tree kernels, every other route with the same bits). Not the shard-order virtual layout: no fused kernel
    folds the shard order (its boundary would only ever be the composition), so it keeps the layer's own sum and
    transformers' residual add and norms; nor full_k, which has no cross-rank sum to fuse. The one place this rule
    lives (``fuse_boundaries``, the sites of ``shard_model``). Local."""
    return layout == "fold" or (layout == "virtual" and shard_fold == "tree")


def fuse_boundaries(route: str | None, *, layout: str = "fold", shard_fold: str = "order") -> bool:
    """Whether the layer boundaries run fused (``detcomm.all_reduce_residual_rmsnorm`` and the canonical norm):
    in a layout that fuses (``fused_layout``: fold, or virtual with ``shard_fold="tree"``), under a bitwise
    envelope, when no route is forced (a forced route, e.g. the native negative control, keeps the plain all-reduce
    and transformers' norms), as in the model probe's fold layout. Local."""
    return fused_layout(layout, shard_fold) and route is None and detcomm.get_communicator().resolved.bitwise


def kv_fits(kv: int, world: int) -> bool:
    """Whether ``world`` ranks can hold ``kv`` KV heads: whole heads each (W divides kv), or each head
    replicated over W / kv ranks (W a multiple of kv)."""
    return kv % world == 0 or world % kv == 0


def world_sizes(config: Any) -> list[int]:
    """Every W at which ``config`` shards (whole attention heads and FFN slices per rank, KV heads whole or
    replicated), up to its attention head count."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    ffn = dense_ffn_width(config)
    return [w for w in range(1, heads + 1)
            if heads % w == 0 and (ffn is None or ffn % w == 0) and kv_fits(kv, w)]


def kv_head_of(rank: int, world: int, kv: int) -> tuple[int, int]:
    """The KV heads [first, first + count) that ``rank`` holds: kv / W of them, or the one head
    rank // (W / kv) when W > kv (each replicated over W / kv ranks). Local."""
    if world > kv:
        return rank // (world // kv), 1
    return rank * (kv // world), kv // world


def check_divisible(config: Any, world: int) -> None:
    """Raise ValueError when W does not divide the attention heads or the FFN width, W neither divides the KV
    heads nor is a multiple of them, or the family is not supported. Local (no communication)."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported by detcomm.hf; supported: {', '.join(SUPPORTED_FAMILIES)}")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    ffn = dense_ffn_width(config)  # None: every MLP is an expert-parallel MoE block (no FFN split)
    bad = [f"num_attention_heads={heads} does not divide by {world}"] if heads % world else []
    if ffn is not None and ffn % world:
        bad.append(f"intermediate_size={ffn} does not divide by {world}")
    if not kv_fits(kv, world):
        bad.append(f"num_key_value_heads={kv} is neither a multiple of {world} nor a divisor of it (with W a "
                   f"multiple of {kv}, each KV head is replicated over W / {kv} ranks)")
    if bad:
        raise ValueError(
            f"tensor parallelism over {world} ranks needs whole attention heads and FFN slices per rank, and "
            f"whole or replicated KV heads, but {'; '.join(bad)}: run with a world size in {world_sizes(config)} "
            f"(--nproc)"
        )


def invariant_blocks(config: Any) -> int:
    """The fixed block count of the TP-size-invariant layouts for ``config``: the largest of 8, 4, 2 that
    divides the attention heads, the KV heads, the FFN width, the hidden size and the vocabulary."""
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dims = (config.num_attention_heads, kv, config.intermediate_size, config.hidden_size, config.vocab_size)
    return next((b for b in (8, 4, 2) if all(d % b == 0 for d in dims)), 1)


def shard_model(model: Any, *, rank: int, world: int, step: StepRows, ep: EPConfig | None = None,
                layout: str = "fold", virtual_shards: int | None = None, max_rows: int = 0,
                shard_fold: str = "order") -> Shards:
    """Cut ``model`` (a transformers *ForCausalLM of a supported family, still whole) to this rank's shard,
    in place. A sparse MoE block becomes an ``EPMoEBlock`` with this rank's experts of ``ep.placement``
    (default ``EPConfig()``: every expert on every rank). Local; the sites it names must then be declared with
    ``declare_sites`` (collective).

    ``layout``: "fold" (the plain Megatron layout), or "virtual" (``virtual_shards`` V) / "full_k": the
    TP-size-invariant layouts (docs/spec.md §9.1): column-parallel projections in
    ``invariant_blocks`` fixed blocks, o_proj / down_proj through ``detcomm.tp.RowParallelLinear``, the LM head in
    fixed vocabulary blocks; ``max_rows`` is then the step width. ``shard_fold``: the virtual shards' order
    ("order" or "tree", docs/spec.md §9.1 "The tree order")."""
    config = model.config
    check_divisible(config, world)
    if ep is not None:
        if config.model_type not in MOE_FAMILIES:
            raise ValueError(f"ep= places the experts of an MoE model ({', '.join(MOE_FAMILIES)}); "
                             f"{config.model_type!r} has none: leave ep out")
        ep.check()
    blocks = 1
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if layout != "fold":
        if kv % world:
            ok = [w for w in world_sizes(config) if kv % w == 0]
            raise ValueError(f"layout={layout!r} at W={world}: the TP-size-invariant layouts cut q/k/v into fixed "
                             f"column blocks that each hold whole KV heads, so W must divide num_key_value_heads={kv}; "
                             f"replicated KV heads (W > {kv}) serve layout='fold' only. Run this layout at W in {ok}")
        blocks = invariant_blocks(config)
        from detcomm.tp import check_divides

        check_divides("model blocks", blocks, blocks, world)
        if layout == "virtual":
            assert virtual_shards is not None
            for k in (config.num_attention_heads * model.model.layers[0].self_attn.head_dim, config.intermediate_size):
                check_divides("--virtual-shards", k, virtual_shards, world)
    decoder = model.model
    ffn = dense_ffn_width(config) or 0
    kv_first, kvl = kv_head_of(rank, world, kv)
    hl, fl = heads // world, ffn // world
    head_dim = decoder.layers[0].self_attn.head_dim
    names = {id(m): n for n, m in model.named_modules()}
    row_sites: list[str] = []
    norm_sites: list[str] = []  # a projection with a bias keeps its plain site (the bias is added after the sum)
    moe_blocks: list[EPMoEBlock] = []
    cuts: dict[str, Cut] = {}

    def cut(module: Any, dim: int, start: int, stop: int) -> None:  # record where the module's shard lies
        name = names[id(module)]
        cuts[f"{name}.weight"] = Cut(dim, start, stop, tuple(module.weight.shape))
        if module.bias is not None and dim == 0:  # a row-parallel bias is whole (added once, after the sum)
            cuts[f"{name}.bias"] = Cut(0, start, stop, tuple(module.bias.shape))

    # The invariant layouts' row-parallel options, the same for every layer.
    row = dict(step=step, layout=layout, virtual_shards=virtual_shards, shard_fold=shard_fold,
               blocks=blocks if layout == "full_k" else None, max_rows=max_rows, rank=rank, world=world)
    for layer in decoder.layers:
        attn = layer.self_attn
        q0, k0 = rank * hl * head_dim, kv_first * head_dim
        o_site = names[id(attn.o_proj)]
        # This rank's query heads over its KV heads: the heads / kv of the model, or heads / W when each KV head is
        # replicated (W > kv); transformers' eager attention repeats each KV head this many times.
        attn.num_key_value_groups = hl // kvl
        if layout == "fold":
            for proj, start, stop in ((attn.q_proj, q0, q0 + hl * head_dim), (attn.k_proj, k0, k0 + kvl * head_dim),
                                      (attn.v_proj, k0, k0 + kvl * head_dim)):
                cut(proj, 0, start, stop)
                column_shard(proj, start, stop)
            cut(attn.o_proj, 1, q0, q0 + hl * head_dim)
            attn.o_proj = RowParallelLinear(attn.o_proj, q0, q0 + hl * head_dim, site=o_site, step=step)
        else:
            qb, kb = heads // blocks * head_dim, kv // blocks * head_dim
            attn.q_proj = BlockColumnLinear(attn.q_proj, q0, q0 + hl * head_dim, block=qb)
            attn.k_proj = BlockColumnLinear(attn.k_proj, k0, k0 + kvl * head_dim, block=kb)
            attn.v_proj = BlockColumnLinear(attn.v_proj, k0, k0 + kvl * head_dim, block=kb)
            attn.o_proj = InvariantRowLinear(attn.o_proj, q0, q0 + hl * head_dim, site=o_site, **row)  # type: ignore[arg-type]
        row_sites.append(o_site)
        if fused_layout(layout, shard_fold) and attn.o_proj.bias is None:
            norm_sites.append(add_norm_site(o_site))
        sparse = moe_block_of(layer)
        if sparse is not None:  # expert-parallel instead of an FFN split; the engine calls layer.mlp
            attr, block = sparse
            ep_block = EPMoEBlock(block, name=names[id(block)], family=config.model_type, ep=ep or EPConfig(),
                                  rank=rank, world=world, step=step)
            setattr(layer, attr, ep_block)
            layer.mlp = ep_block
            moe_blocks.append(ep_block)
            continue
        mlp = layer.mlp
        d_site = names[id(mlp.down_proj)]
        if layout == "fold":
            for proj in (mlp.gate_proj, mlp.up_proj):
                cut(proj, 0, rank * fl, (rank + 1) * fl)
                column_shard(proj, rank * fl, (rank + 1) * fl)
            cut(mlp.down_proj, 1, rank * fl, (rank + 1) * fl)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, rank * fl, (rank + 1) * fl, site=d_site, step=step)
        else:
            fb = ffn // blocks
            mlp.gate_proj = BlockColumnLinear(mlp.gate_proj, rank * fl, (rank + 1) * fl, block=fb)
            mlp.up_proj = BlockColumnLinear(mlp.up_proj, rank * fl, (rank + 1) * fl, block=fb)
            mlp.down_proj = InvariantRowLinear(mlp.down_proj, rank * fl, (rank + 1) * fl, site=d_site, **row)  # type: ignore[arg-type]
        row_sites.append(d_site)
        if fused_layout(layout, shard_fold) and mlp.down_proj.bias is None:
            norm_sites.append(add_norm_site(d_site))
    vocab = config.vocab_size
    width = vocab_shard_width(vocab, world)
    embed_site = names[id(decoder.embed_tokens)]
    head_name = names[id(model.lm_head)]
    head_sites = {k: f"{head_name}.{k}" for k in ("gather", "argmax", "stats", "logprobs")}
    # The head first: with tied embeddings both modules share one weight, which the embedding swap drops.
    if layout == "fold":
        cuts[f"{head_name}.weight"] = Cut(0, rank * width, (rank + 1) * width, tuple(model.lm_head.weight.shape))
        cuts[f"{embed_site}.weight"] = Cut(0, rank * width, (rank + 1) * width,
                                           tuple(decoder.embed_tokens.weight.shape))
        model.lm_head = VocabParallelHead(model.lm_head, rank * width, width, vocab, gather_site=head_sites["gather"])
    else:
        width = vocab // world
        model.lm_head = BlockVocabHead(model.lm_head, blocks=blocks, t_pad=max_rows, site=head_name,
                                       gather_site=head_sites["gather"], rank=rank, world=world)
    decoder.embed_tokens = VocabParallelEmbedding(decoder.embed_tokens, rank * width, width, site=embed_site,
                                                  step=step)
    return Shards(rank=rank, world=world, heads=hl, kv_heads=kvl, head_dim=head_dim, ffn=fl, vocab=vocab,
                  vocab_width=width, row_sites=tuple(row_sites), embed_site=embed_site, head_sites=head_sites,
                  moe_blocks=tuple(moe_blocks), layout=layout, blocks=blocks, norm_sites=tuple(norm_sites),
                  virtual_shards=virtual_shards if layout == "virtual" else None,
                  shard_fold=shard_fold if layout == "virtual" else "order", cuts=cuts)


def declare_sites(shards: Shards, *, hidden: int, dtype: torch.dtype, max_rows: int, route: str | None = None,
                  fuse: bool = False) -> None:
    """Declare every site of the sharded model, in one order on every rank. Collective.

    ``max_rows``: the most rows one call carries (the serving config's padded step width). ``route`` forces
    the route of the sum sites (o_proj, down_proj, the embedding): "native" is the negative control. ``fuse``
    (``fuse_boundaries``) also declares the fused layer-boundary sites (``shards.norm_sites``): plain
    ``all_reduce_rmsnorm`` sites in the fold layout, tree sites (the projections' ``virtual_shards``,
    ``shard_fold="tree"``) in the tree layout. The invariant layouts' o_proj / down_proj / LM-head sites are
    declared by their ``detcomm.tp`` layers (``TPCausalLM``)."""

    def declare_norm_sites() -> None:
        for name in shards.norm_sites if fuse else ():
            detcomm.site(name, collective="all_reduce_rmsnorm", dtype=dtype, shape=(hidden,), max_rows=max_rows,
                         virtual_shards=shards.virtual_shards, shard_fold=shards.shard_fold)

    if shards.layout != "fold":
        detcomm.site(shards.embed_site, collective="all_reduce", dtype=dtype, shape=(hidden,), max_rows=max_rows,
                     route=route)
        declare_norm_sites()
        for block in shards.moe_blocks:
            block.declare(dtype=dtype, max_rows=max_rows)
        return
    for name in (shards.embed_site, *shards.row_sites):
        detcomm.site(name, collective="all_reduce", dtype=dtype, shape=(hidden,), max_rows=max_rows, route=route)
    declare_norm_sites()
    w = shards.vocab_width
    s = shards.head_sites
    detcomm.site(s["gather"], collective="all_gather", dtype=dtype, shape=(w,), max_rows=max_rows)
    detcomm.site(s["argmax"], collective="argmax", dtype=torch.float32, shape=(w,), max_rows=max_rows)
    detcomm.site(s["stats"], collective="all_gather", dtype=torch.float32, shape=(2,), max_rows=max_rows)
    detcomm.site(s["logprobs"], collective="all_gather", dtype=torch.float32, shape=(w,), max_rows=max_rows)
    for block in shards.moe_blocks:
        block.declare(dtype=dtype, max_rows=max_rows)
