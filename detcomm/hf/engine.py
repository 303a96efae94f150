"""A transformers causal LM served tensor-parallel over detcomm at one fixed step shape (docs/hf.md).

``TPCausalLM`` shards the loaded ``nn.Module`` tree (``detcomm.hf.shard``: only the Linear and Embedding modules, so
transformers' norms, rotary embedding and activations stay; not transformers' ``tp_plan``, whose DTensor reductions
cannot be given detcomm sites) and runs its own step loop (``forward``, ``generate``), because transformers'
attention takes one cache position for the whole batch. Local compute is batch-invariant by construction:

* every step runs at one padded width ``T_pad`` (``ServingConfig.t_pad``): the real rows (prefill chunks and
  decode rows of any number of requests, packed) first, filler rows after, so every GEMM, norm and elementwise op
  sees one shape; T_pad and max_context are multiples of 64 (no CPU scalar tail);
* attention is ONE ``detcomm.numerics.attention.paged_attention`` call per layer over every real row of the step,
  against the engine's paged KV cache (``ServingConfig.block_size`` / ``num_blocks``; a request's cache is its
  block table): each row over its own request's actual context, in KV-block order, the same bits whether it is
  computed alone, packed, in a prefill chunk of any size or a decode step, at every W (one kv head at a time);
  ``attention_impl`` names the impl (torch on CPU, triton on CUDA). The bits differ from transformers' eager
  attention (fp32 online softmax, docs/design/hf-engine.md), and from this engine's before issue 42;
* the real row count reaches the arithmetic only at the row-parallel all-reduces (o_proj, down_proj, the
  vocabulary-parallel embedding): detcomm sites declared with ``max_rows = T_pad``;
* the LM head is vocabulary-parallel: fp32 logits, greedy through ``detcomm.argmax``, an exact
  vocabulary-parallel log-softmax combined in rank order.

``layout="virtual"`` (``virtual_shards=V``, ``shard_fold``) or ``"full_k"`` make the bits TP-size invariant
(docs/spec.md §9.1): fixed column blocks and vocabulary blocks. Under a bitwise envelope the fold and tree layouts
fuse each layer boundary into one ``detcomm.all_reduce_residual_rmsnorm`` call (docs/spec.md §9.2), and every
decoder RMSNorm is detcomm's canonical norm with the module's weight and eps.

Each step pays T_pad rows of GEMM and each row's attention over its actual context. ``ServingConfig.cuda_graphs``
runs the steps on static buffers, captured in a CUDA graph per real row count where every site and op of the step
captures (the same bits). The costs, the shape keys, the boundaries' rules: docs/design/hf-engine.md.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import detcomm

from ..numerics import sampling
from ..numerics.attention import KVStore, PagedKV, StepKV, check_paged_geometry
from ..numerics.sampling import StepTokens
from ..numerics.step_graph import StepGraphs, StepInputs
from ..rl import regions
from ..tp import Segment, pack_segments, stage_segments
from .agree import agreed
from .layers import StepRows
from .moe_block import EPConfig, EPMoEBlock
from .shard import Shards, add_norm_site, declare_sites, fuse_boundaries, shard_model
from .sliced import Checkpoint, fill

__all__ = ["ServingConfig", "StepLogits", "StepTokens", "TPCausalLM", "ROW_ALIGN", "GRAPH_MODES", "Sampler"]

# generate's token choice: (request index, the token's position, its fp32 logprobs [vocab]) -> the token id
Sampler = Callable[[int, int, torch.Tensor], int]

# T_pad and max_context are multiples of these (see the module docstring).
ROW_ALIGN = 64

# ServingConfig.cuda_graphs
GRAPH_MODES: tuple[bool | str, ...] = ("auto", True, False)

_log = logging.getLogger("detcomm")


@dataclass(frozen=True)
class ServingConfig:
    """The fixed step geometry: ``t_pad`` rows per step (the ``max_rows`` of every site), ``max_context`` the
    most tokens a request may cache, and the engine's paged KV cache: ``num_blocks`` blocks of ``block_size``
    positions per layer, shared by every live request (``block_size`` is part of the attention's arithmetic,
    detcomm.numerics.attention; ``num_blocks`` only bounds how many tokens all live requests hold at once).
    ``attention_impl``: "torch" or "triton" (None: triton on CUDA, torch elsewhere); part of the arithmetic too
    (e.g. "torch" on CUDA for a trainer that needs autograd through the attention and the server's bits).
    ``cuda_graphs`` (keyword-only), not part of the arithmetic (the same bits either way): "auto" runs the engine's
    steps on static buffers and captures them in CUDA graphs where every route and op of the step can be captured,
    eagerly otherwise (``TPCausalLM.graphs_reason`` says why, logged once); True requires the capture (ValueError
    naming what cannot be captured and the fix); False runs today's eager step on fresh tensors."""

    t_pad: int = 64
    max_context: int = 128
    block_size: int = 16
    num_blocks: int = 256
    attention_impl: str | None = None
    cuda_graphs: bool | str = field(default="auto", kw_only=True)

    def check(self) -> None:
        if self.t_pad < 1 or self.t_pad % ROW_ALIGN:
            raise ValueError(f"t_pad must be a positive multiple of {ROW_ALIGN}, got {self.t_pad}")
        if self.max_context < 1 or self.max_context % ROW_ALIGN:
            raise ValueError(f"max_context must be a positive multiple of {ROW_ALIGN}, got {self.max_context}")
        check_paged_geometry(block_size=self.block_size, num_blocks=self.num_blocks, max_context=self.max_context,
                             impl=self.attention_impl)
        if self.cuda_graphs not in GRAPH_MODES or not isinstance(self.cuda_graphs, (bool, str)):
            raise ValueError(f"cuda_graphs must be 'auto', True or False, got {self.cuda_graphs!r}")


def _partial_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A row-parallel module's local product, without its all-reduce."""
    return lambda x: F.linear(x, weight)


@dataclass
class StepLogits:
    """One step's vocabulary shard: ``buf`` the fp32 [T_pad, shard] logits of every row, ``rows`` the buffer
    rows that sample (one per sampling segment, in segment order)."""

    buf: torch.Tensor
    rows: torch.Tensor

    def __len__(self) -> int:
        return int(self.rows.shape[0])


class TPCausalLM:
    """This rank's shard of a transformers causal LM and the fixed-width step loop around it.

    Construct on every rank after ``detcomm.init`` with the same whole model, or with the same meta-device model
    (``detcomm.hf.sliced.meta_model``) and its ``checkpoint`` (each rank then reads only its slices; fold layout)
    (collective: declares the sites); then call ``forward``/``greedy``/``logprobs`` on every rank with the same
    arguments. The model is sharded in place and moved to the communicator's device.
    """

    def __init__(self, model: Any, serving: ServingConfig | None = None, *, route: str | None = None,
                 ep: EPConfig | None = None, layout: str = "fold", virtual_shards: int | None = None,
                 checkpoint: Checkpoint | None = None, shard_fold: str = "order") -> None:
        serving = serving or ServingConfig()
        serving.check()
        if layout not in ("fold", "virtual", "full_k"):
            raise ValueError(f"layout must be fold, virtual or full_k, got {layout!r}")
        if (virtual_shards is not None) != (layout == "virtual"):
            raise ValueError("virtual_shards is given exactly for layout='virtual'")
        if checkpoint is not None and layout != "fold":
            raise ValueError(f"layout={layout!r}: sliced loading cuts the fold layout (the invariant layouts' blocks are "
                             "built from a whole weight); pass the whole model (detcomm.hf.load_causal_lm) instead")
        comm = detcomm.get_communicator()
        self.cfg = serving
        self.device = comm.device
        self.rank, self.world = comm.rank, comm.world_size  # the communicator's group (detcomm.rl.colocate)
        self.step_rows = StepRows()

        def local() -> Shards:  # everything before the first collective (the sites' declarations)
            shards = shard_model(model, rank=self.rank, world=self.world, step=self.step_rows, ep=ep, layout=layout,
                                 virtual_shards=virtual_shards, max_rows=serving.t_pad, shard_fold=shard_fold)
            if checkpoint is not None:  # a meta-device model: read this rank's slices (detcomm.hf.sliced)
                fill(model, shards, checkpoint, dtype=next(model.parameters()).dtype)
            model.to(self.device)
            return shards

        # One verdict for the group (detcomm.hf.agree): a rank whose slice of the checkpoint is refused must not
        # leave its peers waiting in the first collective until the deadline.
        what = ("detcomm.hf: reading each rank's slices of the checkpoint" if checkpoint is not None
                else "detcomm.hf: sharding the model")
        self.shards: Shards = agreed(what, local)
        self.model: Any = model.eval()
        self.config: Any = model.config
        self.dtype = next(model.parameters()).dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype}")
        self.layers: list[Any] = list(model.model.layers)
        # Fused layer boundaries and canonical norms (module docstring): the fold and tree layouts under a bitwise
        # envelope with no forced route; which layouts fuse, and why the shard-order and full-K ones do not, is
        # shard.fused_layout's rule.
        self.fuse = fuse_boundaries(route, layout=layout, shard_fold=shard_fold)
        declare_sites(self.shards, hidden=self.config.hidden_size, dtype=self.dtype, max_rows=serving.t_pad,
                      route=route, fuse=self.fuse)
        # The invariant layouts' detcomm.tp layers declare their own sites. Their attention needs no head groups:
        # paged_attention runs one kv head at a time at fixed GEMM shapes, the same at every W.
        self.invariant = layout != "fold"
        if self.invariant:
            for layer in self.layers:
                layer.self_attn.o_proj.layer.declare()
                if layer.mlp not in self.shards.moe_blocks:  # an MoE block's sites: declare_sites
                    layer.mlp.down_proj.layer.declare()
            model.lm_head.head.declare()
            detcomm.site(self.shards.head_sites["gather"], collective="all_gather", dtype=torch.float32,
                         shape=(self.shards.vocab_width,), max_rows=serving.t_pad)
        modeling = sys.modules[type(self.layers[0].self_attn).__module__]
        self._apply_rope = modeling.apply_rotary_pos_emb
        # Rotary cos/sin for every position, computed once by the model's own rotary module and then indexed:
        # a per-step call would put a position's cos/sin in a different vector lane with every batch.
        L = serving.max_context
        with torch.no_grad():
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = model.model.rotary_emb(probe, torch.arange(L, device=self.device)[None])
        self.cos, self.sin = cos[0], sin[0]  # [L, head_dim]
        self._layer_window = [self._window(layer.self_attn) for layer in self.layers]
        s = self.shards
        self.kv = PagedKV(layers=len(self.layers), kv_heads=s.kv_heads, head_dim=s.head_dim,
                          block_size=serving.block_size, num_blocks=serving.num_blocks,
                          max_context=serving.max_context, dtype=self.dtype, device=self.device,
                          impl=serving.attention_impl)
        # Named once (default: torch on CPU, triton on CUDA): a trainer reproducing this engine's bits uses it too.
        self.attention_impl: str = self.kv.impl
        self._setup_graphs(serving.cuda_graphs)

    # -- CUDA graphs (ServingConfig.cuda_graphs; detcomm.numerics.step_graph) ------------------------------
    def _setup_graphs(self, mode: bool | str) -> None:
        """The static step buffers and the graphs over them. The decision is one of static facts, the same on every
        rank (the device, the attention impl, the model's blocks, the route table): a rank that captured while its
        peers ran eagerly would issue its collectives twice (warm-up, replay) against their once."""
        self._graphs: StepGraphs[torch.Tensor] | None = None
        self._inputs: StepInputs | None = None
        #: whether the engine's steps are captured and replayed; graphs_reason: why not (None when they are)
        self.cuda_graphs: bool = False
        self.graphs_reason: str | None = None
        #: whether next_tokens captures the head (token choice) with the step; head_graphs_reason: why not
        self.head_graphs: bool = False
        self.head_graphs_reason: str | None = None
        if mode is False:
            self.cuda_graphs, self.graphs_reason = False, "cuda_graphs=False"
            self.head_graphs_reason = self.graphs_reason
            return
        reason = self._graph_refusal(library=mode is True)
        if mode is True and reason is not None:
            raise ValueError(f"cuda_graphs=True: this engine's step cannot be captured in a CUDA graph: {reason}. "
                             "Fix that, or pass ServingConfig(cuda_graphs='auto') (eager where capture cannot run) "
                             "or cuda_graphs=False")
        if reason is not None:
            _log.info("detcomm.hf: CUDA graphs off, the steps run eagerly on static buffers: %s", reason)
        c = self.cfg
        # keys / temps: each sampling row's key and temperature (fp32 bits): the head's step inputs (next_tokens).
        shapes = {"ids": (c.t_pad,), "pos": (c.t_pad,), "last": (c.t_pad,), "keys": (c.t_pad,), "temps": (c.t_pad,),
                  **self.kv.step_shapes(segments=c.t_pad, rows=c.t_pad)}
        self._inputs = StepInputs(shapes, device=self.device)
        self.cuda_graphs, self.graphs_reason = reason is None, reason
        # The head's sites decide separately: where they cannot be captured (a host-staged group; NCCL gathers
        # under "auto" at W > 1) the step is still one graph and the head runs eagerly after it on the static
        # buffers (the same bits), rather than the whole step running eagerly.
        head = reason or self._sites_refusal(self.head_sites(), library=mode is True)
        self.head_graphs, self.head_graphs_reason = head is None, head
        if self.cuda_graphs and head is not None:
            _log.info("detcomm.hf: the head runs eagerly after the captured step: %s", head)
        self._graphs = StepGraphs(self._static_body, device=self.device, capture=self.cuda_graphs)

    def _sites_refusal(self, sites: list[str], *, library: bool) -> str | None:
        comm = detcomm.get_communicator()
        return next((why for site in sites if (why := comm.capture_refusal(site, library=library)) is not None), None)

    def _graph_refusal(self, *, library: bool = False) -> str | None:
        """Why this engine's step cannot be captured (None: it can), from static facts; the first reason found.
        ``library``: NCCL calls may be captured (cuda_graphs=True: the caller releases the graphs before shutdown)."""
        if self.device.type != "cuda":
            return f"the engine runs on {self.device}: CUDA graphs need a CUDA device"
        if self.attention_impl != "triton":
            return (f"attention_impl={self.attention_impl!r} reads each row tile's KV block range back to the host "
                    "(a data-dependent loop), which a CUDA graph cannot hold: serve with attention_impl='triton' "
                    "(CUDA's default)")
        if self.shards.moe_blocks:
            return (f"the expert-parallel MoE blocks ({self.shards.moe_blocks[0].name} and the others, "
                    "detcomm.hf.moe_block) read each step's routing back to the host (the all-to-all splits, the "
                    "experts' row counts): MoE models run their steps eagerly")
        return self._sites_refusal(self.step_sites(), library=library)

    def head_sites(self) -> list[str]:
        """The detcomm sites the head calls (``greedy``, ``logprobs``; ``next_tokens`` captures them with the step)."""
        if self.invariant:
            p = self.model.lm_head.head.site
            return [f"{p}.argmax", f"{p}.stats", f"{p}.logprobs"]
        s = self.shards.head_sites
        return [s["argmax"], s["stats"], s["logprobs"]]

    def step_sites(self) -> list[str]:
        """The detcomm sites one step calls, in call order (the head's sampling sites are outside the step: greedy,
        logprobs): the embedding's, then per layer its boundaries' (the fused add + norm site, or the projection's
        own: the fold layout's all-reduce, the invariant layouts' virtual all-reduce or full-K all-gathers), an MoE
        block's in between."""
        sites = [self.shards.embed_site]

        def proj_sites(proj: Any) -> list[str]:
            if self.fuse and proj.bias is None:
                return [add_norm_site(proj.site)]
            if not self.invariant:
                return [proj.site]
            layer = proj.layer
            return [layer.site] if layer.layout == "virtual" else [f"{layer.site}.gather_in", f"{layer.site}.gather_out"]

        for layer in self.layers:
            sites += proj_sites(layer.self_attn.o_proj)
            if isinstance(layer.mlp, EPMoEBlock):
                m = layer.mlp.name  # detcomm.moe.moe_site's names, then the block's gather
                sites += [f"{m}.dispatch", f"{m}.combine", layer.mlp.sites_gather]
            else:
                sites += proj_sites(layer.mlp.down_proj)
        return sites

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (one per step shape: the real row count); 0 when the steps run eagerly."""
        return 0 if self._graphs is None or not self.cuda_graphs else self._graphs.captures

    def release_graphs(self) -> None:
        """Drop the captured graphs (later steps capture again). A graph that captured an NCCL call must be dropped
        before ``detcomm.shutdown`` (docs/hf.md)."""
        if self._graphs is not None:
            self._graphs.release()

    # -- geometry --------------------------------------------------------------------------------------
    def _window(self, attn: Any) -> int | None:
        if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3: per layer, None for full attention
            return attn.sliding_window
        cfg = self.config
        types = getattr(cfg, "layer_types", None)
        if types is not None:  # Qwen2-MoE: the module has the attribute only on its sliding layers
            return cfg.sliding_window if types[attn.layer_idx] == "sliding_attention" else None
        if not getattr(cfg, "use_sliding_window", True):  # the window is off (its size may still be set)
            return None
        return getattr(cfg, "sliding_window", None)  # Mistral, Mixtral: model-wide; Llama: none

    def new_cache(self) -> list[int]:
        """A new request's KV cache: an empty block table of the engine's paged cache (``Segment.blocks``); each
        step grows it to cover the request's rows. Hand it back with ``free_cache`` when the request is done."""
        return self.kv.new_table()

    def free_cache(self, blocks: list[int]) -> None:
        """Return a finished request's blocks to the engine's cache (``blocks`` is emptied)."""
        self.kv.free(blocks)

    def local_ops(self) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
        """Every local GEMM of a step as (op on a [rows, K] input, K), without communication: what the probe
        checks for row-offset invariance at T_pad rows."""
        ops: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            ops += [(lin, lin.in_features) for lin in (a.q_proj, a.k_proj, a.v_proj)]
            ops.append((_partial_linear(a.o_proj.weight), a.o_proj.in_features))
            if isinstance(m, EPMoEBlock):  # router and shared expert (its experts run at their own block shape)
                ops += m.local_ops()
                continue
            ops += [(lin, lin.in_features) for lin in (m.gate_proj, m.up_proj)]
            ops.append((_partial_linear(m.down_proj.weight), m.down_proj.in_features))
        head = self.model.lm_head
        ops.append((head.shard_logits, head.weight.shape[1]))
        return ops

    # -- fused layer boundaries (module docstring) --------------------------------------------------------
    def _canonical_norm(self, norm: Any, h: torch.Tensor, rows: int) -> torch.Tensor:
        """detcomm's canonical RMSNorm of the real rows with the HF module's weight and eps (filler rows: zero)."""
        x = torch.zeros_like(h)
        x[:rows] = regions.norm(h[:rows], norm.weight, eps=norm.variance_epsilon)
        return x

    def _add_norm(self, x: torch.Tensor, h: torch.Tensor, norm: Any, rows: int, *,
                  site: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, normed) after one boundary on the real rows (filler rows of the normed output: zero).
        ``x`` holds the real rows only. ``site``: x is this rank's part of the sum, reduced there by
        ``detcomm.all_reduce_residual_rmsnorm`` (collective): the fold layout's partial product [rows, H], or the
        tree layout's V/W fp32 shard partials [V/W, rows, H]; None: x is already the whole sum [rows, H]
        (the local ``add_rms_norm``). Both go through ``detcomm.rl.regions.add_norm``: the same forward, and a
        trainer's backward all-reduces the normed output's gradient, which feeds column-parallel compute."""
        w, eps = norm.weight, norm.variance_epsilon
        y, r = regions.add_norm(x, h[:rows], w, eps=eps, site=site)
        h = h.clone()
        h[:rows] = r
        normed = torch.zeros_like(h)  # rows never mix, so the filler's values do not matter: zero is the cheapest
        normed[:rows] = y
        return h, normed

    def _boundary(self, proj: Any, inp: torch.Tensor, h: torch.Tensor, norm: Any,
                  rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The boundary after row-parallel ``proj`` (o_proj, down_proj) of ``inp`` ([T_pad, K/W]). Bias-free: its
        local part of the sum goes to the fused site (fold layout: the partial product; tree layout: the
        ``detcomm.tp.RowParallelLinear`` layer's V/W fp32 shard partials), every GEMM on the whole T_pad-row buffer;
        with a bias: the projection's own all-reduce + bias, then the add and norm. Collective."""
        if proj.bias is None:
            part = proj.layer.partials(inp, rows) if self.invariant else F.linear(inp, proj.weight)[:rows]
            return self._add_norm(part, h, norm, rows, site=add_norm_site(proj.site))
        return self._add_norm(proj(inp)[:rows], h, norm, rows, site=None)

    def forward(self, segments: Sequence[Segment], *, grad: bool = False,
                kv: KVStore | None = None) -> tuple[StepLogits, list[int]]:
        """Run one step over the segments' rows, packed in order. Collective.

        Returns the step's logits (``StepLogits``: this rank's vocabulary shard of every row, and the rows
        of the segments with ``sample``) and the index of each sampling segment. ``grad=True`` (the trainer,
        detcomm.rl): the same step with autograd, its collectives ``detcomm.rl.regions``' functions, whose
        forward is the same call: the same bits. ``kv``: the KV store the segments' tables belong to (default the
        engine's paged cache; the trainer passes its own, whose writes autograd can follow)."""
        with torch.set_grad_enabled(grad):
            if kv is None and not grad and self._inputs is not None:
                return self._static_step(segments)
            return self._step(segments, self.kv if kv is None else kv)

    def _step(self, segments: Sequence[Segment], kv: KVStore) -> tuple[StepLogits, list[int]]:
        """A step on fresh tensors: any KV store (the trainer's), autograd, or cuda_graphs=False."""
        c = self.cfg
        ids, pos, offsets, rows = pack_segments(segments, t_pad=c.t_pad, max_context=c.max_context, device=self.device)
        step = kv.step([seg.blocks for seg in segments], [(seg.start, len(seg.tokens)) for seg in segments])
        logits = self._body(ids, pos, step, kv, rows)
        picks = [i for i, seg in enumerate(segments) if seg.sample]
        last = torch.tensor([offsets[i] + len(segments[i].tokens) - 1 for i in picks], dtype=torch.long,
                            device=self.device)
        return StepLogits(logits, last), picks

    def _static_step(self, segments: Sequence[Segment]) -> tuple[StepLogits, list[int]]:
        """A step of the engine's own cache on the static buffers: the host writes the step's integers (ids,
        positions, block tables, each row's request and position, the sampling rows) and copies them once; the
        body runs on the buffers, captured per row count where the engine captures (ServingConfig.cuda_graphs)."""
        assert self._inputs is not None and self._graphs is not None
        self._stage(segments)
        picks = [i for i, seg in enumerate(segments) if seg.sample]
        self._inputs.upload()
        rows = sum(len(seg.tokens) for seg in segments)
        logits = self._graphs(rows)  # the shape key: the real row count (the reductions', the attention's)
        # A graph's output is overwritten by the next replay of its row count, and the buffers by the next step:
        # the caller gets its own tensors, as from a step on fresh tensors.
        buf = logits.clone() if self.cuda_graphs else logits
        return StepLogits(buf, self._inputs.dev["last"][: len(picks)].clone()), picks

    def _stage(self, segments: Sequence[Segment]) -> dict[str, Any]:
        """Write a step's integers into the static buffers' host views (ids, positions, block tables, each row's
        request and position, the sampling rows); the caller adds the head's and uploads."""
        c = self.cfg
        assert self._inputs is not None
        if len(segments) > c.t_pad:
            raise ValueError(f"a step carries at most T_pad={c.t_pad} segments, got {len(segments)}: drop the empty "
                             "ones")
        host = self._inputs.begin()
        offsets, _ = stage_segments(segments, host["ids"], host["pos"], max_context=c.max_context)
        self.kv.stage(host, [seg.blocks for seg in segments], [(seg.start, len(seg.tokens)) for seg in segments])
        picks = [i for i, seg in enumerate(segments) if seg.sample]
        host["last"][: len(picks)] = [offsets[i] + len(segments[i].tokens) - 1 for i in picks]
        return host

    def _static_body(self, key: object) -> torch.Tensor:
        """The graph body of a shape key: ``rows`` (the step's logits) or ``(rows, S, sampled)`` (the step and its
        head: ``next_tokens``' packed [2, S] tokens and logprobs)."""
        assert self._inputs is not None
        dev = self._inputs.dev
        rows, n, sampled = key if isinstance(key, tuple) else (key, None, False)
        assert isinstance(rows, int)
        logits = self._body(dev["ids"], dev["pos"], self.kv.static_step(dev, rows), self.kv, rows)
        if n is None:
            return logits
        assert isinstance(n, int) and n >= 1
        return self._head(StepLogits(logits, dev["last"][:n]), sampling.from_bits(dev["temps"][:n]),
                          dev["keys"][:n], sampled=bool(sampled))

    def _head(self, logits: StepLogits, temps: torch.Tensor, keys: torch.Tensor, *, sampled: bool) -> torch.Tensor:
        """The token choice on device tensors only (the one code path of eager and captured heads): greedy (the
        vocabulary-parallel argmax of the logits, ``greedy``) or seeded Gumbel-max over the logprobs
        (``sampling.pick``), and the chosen token's logprob (``logprobs``' bits), packed [2, S]. Collective."""
        lps = self.logprobs(logits)
        tok = sampling.pick(lps, temps, keys) if sampled else self.greedy(logits)
        return sampling.pack(tok, lps.gather(1, tok[:, None])[:, 0])

    def next_tokens(self, segments: Sequence[Segment], *, keys: Sequence[int] | None = None,
                    temperatures: Sequence[float] | None = None) -> StepTokens:
        """One step and its token choice: each sampling segment's next token and its fp32 logprob, read back in one
        device-to-host copy. Greedy (``greedy``'s tokens) unless ``keys`` and ``temperatures`` are given, one per
        sampling segment in order: then the token is the argmax of ``logprobs / T + noise(key)`` (T = 0: of the
        logprobs; detcomm.numerics.sampling, ``sample_key`` names a key). On the static buffers the step and its
        head are one graph per (rows, S, sampled) where the engine captures; the keys and temperatures are step
        inputs, so the same graph serves any of them. The bits are those of ``forward`` + ``greedy`` /
        ``logprobs`` on fresh tensors. Collective (same arguments on every rank)."""
        picks = [i for i, seg in enumerate(segments) if seg.sample]
        n = len(picks)
        sampled = sampling.check_sampling(n, keys, temperatures)
        if self._inputs is None or self._graphs is None or not n:
            logits, _ = self.forward(segments)
            if not n:
                return StepTokens([], torch.zeros(0, dtype=torch.float32), picks)
            temps_t = torch.from_numpy(sampling.f32_bits(temperatures or [0.0] * n)).to(self.device)
            keys_t = torch.tensor(list(keys or [0] * n), dtype=torch.int64, device=self.device)
            with torch.no_grad():
                packed = self._head(logits, sampling.from_bits(temps_t), keys_t, sampled=sampled)
        else:
            host = self._stage(segments)
            host["keys"][:n] = list(keys) if keys is not None else 0
            host["temps"][:n] = sampling.f32_bits(temperatures) if temperatures is not None else 0
            self._inputs.upload()
            rows = sum(len(seg.tokens) for seg in segments)
            with torch.no_grad():
                if self.head_graphs or not self.cuda_graphs:  # one body: step + head (captured, or eager)
                    packed = self._graphs((rows, n, sampled))
                else:  # the captured step, then the head eagerly on its output and the static buffers
                    dev = self._inputs.dev
                    packed = self._head(StepLogits(self._graphs(rows), dev["last"][:n]),
                                        sampling.from_bits(dev["temps"][:n]), dev["keys"][:n], sampled=sampled)
        toks, lps = sampling.unpack(packed.cpu().numpy())  # the step's one device-to-host copy
        return StepTokens(toks, lps, picks)

    def _body(self, ids: torch.Tensor, pos: torch.Tensor, step: StepKV, kv: KVStore, rows: int) -> torch.Tensor:
        """The step itself, on device tensors only: this rank's fp32 logits [T_pad, shard] of every row. The one
        code path of every step (fresh tensors, static buffers, a CUDA graph's capture): nothing in it reads back to
        the host, and its launch shapes follow ``rows`` alone."""
        c, s = self.cfg, self.shards
        cos, sin = self.cos[pos][None], self.sin[pos][None]  # [1, T_pad, hd]
        hd = s.head_dim
        self.step_rows.rows = rows
        try:
            h = self.model.model.embed_tokens(ids)  # [T_pad, hidden]
            first = self.layers[0].input_layernorm
            x = self._canonical_norm(first, h, rows) if self.fuse else first(h)
            for li, layer in enumerate(self.layers):
                attn = layer.self_attn
                q = attn.q_proj(x).view(c.t_pad, s.heads, hd)
                k = attn.k_proj(x).view(c.t_pad, s.kv_heads, hd)
                v = attn.v_proj(x).view(c.t_pad, s.kv_heads, hd)
                if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = self._apply_rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
                q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # [T_pad, heads, hd]
                # One paged_attention call over the step's real rows (every segment's, packed in order).
                mixed = torch.zeros(c.t_pad, s.heads * hd, dtype=self.dtype, device=self.device)
                mixed[:rows] = kv.attend(li, q[:rows], k[:rows], v[:rows], step, scale=attn.scaling,
                                         window=self._layer_window[li]).reshape(rows, s.heads * hd)
                nxt = self.layers[li + 1].input_layernorm if li + 1 < len(self.layers) else self.model.model.norm
                if not self.fuse:  # transformers' residual adds and norm modules
                    h = h + attn.o_proj(mixed)
                    h = h + layer.mlp(layer.post_attention_layernorm(h))
                    x = nxt(h)
                    continue
                h, x = self._boundary(attn.o_proj, mixed, h, layer.post_attention_layernorm, rows)
                mlp = layer.mlp
                if isinstance(mlp, EPMoEBlock):  # its output is already the whole row: nothing to reduce
                    h, x = self._add_norm(mlp(x)[:rows], h, nxt, rows, site=None)
                else:  # transformers' MLP, its down_proj's partial product handed to the fused boundary
                    h, x = self._boundary(mlp.down_proj, mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x), h, nxt, rows)
            logits: torch.Tensor = self.model.lm_head.shard_logits(x)  # [T_pad, shard] fp32
        finally:
            self.step_rows.rows = None
        return logits

    # -- vocabulary-parallel head ------------------------------------------------------------------------
    def greedy(self, logits: StepLogits) -> torch.Tensor:
        """Global argmax of each sampling row's logits (lowest index on exact ties). Collective."""
        shard = logits.buf[logits.rows].contiguous()
        if self.invariant:
            return self.model.lm_head.head.greedy(shard)
        return detcomm.argmax(shard, site=self.shards.head_sites["argmax"], vocab_start=self.rank * self.shards.vocab_width)

    def logprobs(self, logits: StepLogits) -> torch.Tensor:
        """fp32 log-softmax over the whole vocabulary of each sampling row, [S, vocab], identical bits on
        every rank and whatever the batch. Collective (two all-gathers: the per-rank (max, sum of exp)
        pairs, then the log-probability shards)."""
        buf, rows, s = logits.buf, logits.rows, self.shards
        if self.invariant:  # fixed vocabulary blocks (docs/spec.md §9.1): the same bits at every W
            return self.model.lm_head.head.logprobs(buf[rows].contiguous())
        t_pad, n = buf.shape[0], len(logits)
        m = buf.amax(dim=-1)
        e = torch.exp(buf - m[:, None]).sum(dim=-1)  # each rank's sum of exp over its shard, row-local
        pairs = torch.stack([m, e], dim=-1)[rows].contiguous()  # [S, 2]
        got = detcomm.all_gather(pairs, site=s.head_sites["stats"]).view(self.world, n, 2)
        # Combine on fixed [W, T_pad] buffers (rows 0..S-1 real): no element's exp depends on S.
        part = torch.zeros(self.world, t_pad, 2, dtype=torch.float32, device=self.device)
        part[:, :n] = got
        big = part[..., 0].amax(dim=0)  # [T_pad], exact
        total = torch.zeros(t_pad, dtype=torch.float32, device=self.device)
        for r in range(self.world):  # canonical order: ranks 0..W-1, fp32, from +0.0
            total = total + part[r, :, 1] * torch.exp(part[r, :, 0] - big)
        lse_rows = (big + torch.log(total))[:n]
        lse = torch.zeros(t_pad, dtype=torch.float32, device=self.device)
        lse[rows] = lse_rows
        shard = (buf - lse[:, None])[rows].contiguous()  # [S, shard]
        full = detcomm.all_gather(shard, site=s.head_sites["logprobs"])
        full = full.view(self.world, n, s.vocab_width).transpose(0, 1).reshape(n, self.world * s.vocab_width)
        return full[:, : s.vocab]

    # -- a plain greedy scheduler ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampler: Sampler | None = None,
                 temperature: float | Sequence[float] | None = None,
                 seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
        """Continuation of every prompt by ``max_new_tokens`` tokens, all requests packed into shared steps (decode
        rows first, then prefill chunks, up to T_pad rows a step). Returns per prompt the new token ids and their
        fp32 logprobs; the bits do not depend on which prompts share the call. ``sampler(request, position,
        logprobs)``: the token at ``position`` of request ``request`` from its fp32 logprobs over the whole
        vocabulary (identical on every rank, so it must be a function of its arguments alone:
        ``detcomm.rl.rollout.sample`` passes a seeded Gumbel-max); None: greedy (``greedy``, lowest index on exact
        ties). ``temperature`` (a float, or one per prompt; instead of ``sampler``): seeded Gumbel-max sampling
        inside the step (``next_tokens``: the request's key ``sampling.sample_key(seed, request, position)``, the
        head captured with the step where the engine captures; T = 0: the argmax of the logprobs). Without a
        ``sampler`` every step is one ``next_tokens`` call: one graph replay and one device-to-host copy.
        Collective (same arguments on every rank)."""
        c = self.cfg
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        temps: list[float] | None = None
        if temperature is not None:
            if sampler is not None:
                raise ValueError("generate takes sampler= (a host callback) or temperature= (sampling inside the "
                                 "step), not both")
            temps = ([float(temperature)] * len(prompts) if isinstance(temperature, (int, float))
                     else [float(t) for t in temperature])
            if len(temps) != len(prompts):
                raise ValueError(f"temperature: one per prompt ({len(prompts)}), got {len(temps)}")
            sampling.check_sampling(len(temps), [0] * len(temps), temps)
        for p in prompts:
            if not 1 <= len(p) or len(p) + max_new_tokens > c.max_context:
                raise ValueError(f"a prompt of {len(p)} tokens plus {max_new_tokens} new ones must fit "
                                 f"max_context={c.max_context} (ServingConfig)")
        # Every request is live at once: their whole caches must fit (the last new token is never cached).
        need = sum(self.kv.blocks_for(len(p) + max_new_tokens - 1) for p in prompts)
        if need > self.kv.allocator.available:
            raise ValueError(f"{len(prompts)} requests need {need} KV blocks of {c.block_size}, "
                             f"{self.kv.allocator.available} are free: raise ServingConfig.num_blocks or pass fewer "
                             "prompts a call")
        caches = [self.new_cache() for _ in prompts]
        try:
            return self._generate(prompts, caches, max_new_tokens=max_new_tokens, sampler=sampler, temps=temps,
                                  seed=seed)
        finally:
            for cache in caches:
                self.free_cache(cache)

    def _generate(self, prompts: Sequence[Sequence[int]], caches: list[list[int]], *, max_new_tokens: int,
                  sampler: Sampler | None, temps: list[float] | None,
                  seed: int) -> list[tuple[list[int], torch.Tensor]]:
        c = self.cfg
        fed = [0] * len(prompts)
        out: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in prompts]
        while any(len(o[0]) < max_new_tokens for o in out):
            work: list[tuple[int, Segment]] = []
            budget = c.t_pad
            for i, p in enumerate(prompts):  # decode rows
                if fed[i] == len(p) and 0 < len(out[i][0]) < max_new_tokens and budget:
                    work.append((i, Segment(caches[i], [out[i][0][-1]], len(p) + len(out[i][0]) - 1)))
                    budget -= 1
            for i, p in enumerate(prompts):  # prefill chunks
                if fed[i] < len(p) and budget:
                    n = min(budget, len(p) - fed[i])
                    work.append((i, Segment(caches[i], list(p[fed[i] : fed[i] + n]), fed[i], sample=fed[i] + n == len(p))))
                    fed[i] += n
                    budget -= n
            if sampler is None:  # the head inside the step: one call, one copy back
                reqs = [work[k][0] for k, (_, seg) in enumerate(work) if seg.sample]
                keys = None if temps is None else [
                    sampling.sample_key(seed, i, len(prompts[i]) + len(out[i][0])) for i in reqs]
                got = self.next_tokens([seg for _, seg in work], keys=keys,
                                       temperatures=None if temps is None else [temps[i] for i in reqs])
                for i, tok, lp in zip(reqs, got.tokens, got.logprobs):
                    out[i][0].append(tok)
                    out[i][1].append(lp)
                    if len(out[i][0]) == max_new_tokens:  # done: its blocks serve the requests still running
                        self.free_cache(caches[i])
                continue
            logits, picks = self.forward([seg for _, seg in work])
            if not picks:
                continue
            lps = self.logprobs(logits)  # a host callback chooses: the head's logprobs come back whole
            for j, k in enumerate(picks):
                i = work[k][0]
                tok = sampler(i, len(prompts[i]) + len(out[i][0]), lps[j])
                out[i][0].append(tok)
                out[i][1].append(lps[j, tok].cpu())
                if len(out[i][0]) == max_new_tokens:  # done: its blocks serve the requests still running
                    self.free_cache(caches[i])
        return [(t, torch.stack(l)) for t, l in out]
