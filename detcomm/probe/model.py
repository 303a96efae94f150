"""A small tensor-parallel decoder whose local compute is batch-invariant by construction.

Megatron-style sharding over the W ranks of the default group: the embedding is replicated; each rank holds
heads/W attention heads (column-parallel Q, K, V) and the matching rows of o_proj (row-parallel, partial sums
reduced by ``detcomm.all_reduce(site="o_proj")``), ffn/W columns of the SwiGLU gate/up projections and the
matching rows of down_proj (``site="down_proj"``), and vocab/W rows of the LM head (vocabulary-parallel:
``detcomm.argmax`` for greedy, ``detcomm.all_gather`` of the fp32 logit shards for the logprobs). Weights are
drawn from a fixed seed in full and sliced, so every rank agrees on the model.

Why the local compute cannot move a row's bits (docs/spec.md §7 (row-count mapper)): a CPU or GPU GEMM picks its blocking, split-K and
vector path from the row count it is handed, so the same row computed among 3 or among 9 rows can differ in
the last bits. Here every activation matrix lives in a buffer of a fixed T_pad rows for the whole forward;
every GEMM, norm and elementwise op runs on that fixed shape (the real rows first, filler after, rows never
mix), so one kernel configuration serves every batch. Attention is one call per layer over every real row
(``detcomm.numerics.attention.paged_attention``, the HF engine's too), against a paged KV cache: each row over
its own request's actual context in KV-block order, at fixed GEMM shapes. The only place where the batch's
real row count reaches the arithmetic is the all-reduce of the row-parallel projections: that is detcomm's
job, and what the probe measures. ``pad=False`` runs the GEMMs at the real row count instead (to show that
the probe also catches local non-invariance).

The layers come from ``detcomm.tp``. ``layout="fold"`` is the plain sharding above. ``layout="virtual"`` (V
virtual shards) and ``layout="full_k"`` also make the bits independent of W (docs/spec.md §9.1 "TP-size
invariance: layouts"): column blocks and vocabulary blocks of fixed size, a vocabulary-parallel
embedding and a fixed-block logprob head. Because a decode row and a teacher-forced row run the same
computation, ``forward_all`` (one forward over whole sequences, the training path) reproduces the
sampling-time logprobs (``python -m detcomm.probe align``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

import detcomm
from detcomm.numerics import sampling
from detcomm.numerics.attention import PagedKV, StepKV
from detcomm.numerics.step_graph import StepGraphs, StepInputs
from detcomm.tp import (
    LAYOUTS,
    ColumnParallelLinear,
    Layout,
    RowParallelLinear,
    Segment,
    VocabParallelEmbedding,
    VocabParallelHead,
    check_divides,
    pack_segments,
    stage_segments,
)

__all__ = ["ModelConfig", "TPTransformer", "SITE_NAMES"]

SITE_NAMES = {"o_proj": "o_proj", "down_proj": "down_proj", "argmax": "lm_head.argmax", "gather": "lm_head.gather",
              "embed": "embed.gather"}
# Under a bitwise envelope each layer boundary of the fold and tree layouts is one fused call: the row-parallel
# all-reduce, the residual add and the next RMSNorm (detcomm.all_reduce_residual_rmsnorm, docs/spec.md §9.2).
FUSED_SITE_NAMES = {"o_proj": "o_proj.add_norm", "down_proj": "down_proj.add_norm"}


@dataclass(frozen=True)
class ModelConfig:
    """Model and serving geometry. ``heads``, ``ffn`` and ``vocab`` must divide by the world size
    (the defaults divide by 1..8 except 5 and 7 for heads). ``blocks``: the number of fixed blocks the
    TP-size-invariant layouts cut each dimension into (column blocks, vocabulary blocks, full-K output blocks);
    they hold for every W dividing it. ``block_size`` and ``num_blocks``: the paged KV cache (block_size is part
    of the attention's arithmetic; num_blocks bounds the tokens all live requests hold at once).
    ``attention_impl``: "torch" or "triton" (None: triton on CUDA, torch elsewhere; part of the arithmetic)."""

    vocab: int = 1680
    hidden: int = 128
    heads: int = 24
    head_dim: int = 8
    ffn: int = 384
    layers: int = 2
    max_context: int = 64
    t_pad: int = 32
    dtype: torch.dtype = torch.float32
    seed: int = 1234
    eps: float = 1e-6
    blocks: int = 8
    block_size: int = 16
    num_blocks: int = 256
    attention_impl: str | None = None

    def check(self, world: int, *, layout: Layout = "fold", virtual_shards: int | None = None) -> None:
        for name in ("heads", "ffn", "vocab"):
            if getattr(self, name) % world:
                raise ValueError(f"model {name}={getattr(self, name)} does not divide by the world size {world}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype}")
        if layout == "fold":
            return
        for name in ("heads", "ffn", "vocab", "hidden"):
            check_divides(f"model {name}", getattr(self, name), self.blocks, world)
        if layout == "virtual":
            assert virtual_shards is not None
            for name, k in (("heads * head_dim", self.heads * self.head_dim), ("ffn", self.ffn)):
                check_divides(f"--virtual-shards for {name}", k, virtual_shards, world)


def _rand(g: torch.Generator, *shape: int, fan_in: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32) / math.sqrt(fan_in)


class TPTransformer:
    """The decoder's shard on this rank. Call ``declare_sites`` once after ``detcomm.init`` (collective),
    then ``forward`` on every rank with the same segments.

    ``layout`` (docs/spec.md "TP-size invariance: layouts"): "fold" is the plain Megatron layer (one GEMM over
    the rank's columns, the canonical all-reduce of the W partials: invariant to the batch at one W, not
    across W); "virtual" (``virtual_shards`` V) and "full_k" give the same bits at every W dividing V and
    ``cfg.blocks``: fixed column blocks, a vocabulary-parallel embedding and a
    fixed-block vocabulary head.

    ``cuda_graphs`` (detcomm.hf.ServingConfig's option, decided when ``declare_sites`` has declared the sites):
    False (the default here: the probes' steps stay eager), "auto" (the steps on static buffers, captured per real
    row count where every site and the attention impl capture; ``graphs_reason`` says why not) or True (required:
    ValueError otherwise). The same bits either way.

    ``shard_weights`` (virtual layout): "fp32" (default) or "model": how the virtual shards are stored
    (detcomm.tp.RowParallelLinear); on CUDA "model" halves the bytes the shard kernel streams and gives other GPU bits
    than "fp32" (the same at every W either way); on CPU the bits are the same."""

    def __init__(self, cfg: ModelConfig, *, pad: bool = True, device: torch.device | str = "cpu",
                 layout: Layout = "fold", virtual_shards: int | None = None, shard_fold: str = "order",
                 cuda_graphs: bool | str = False, shard_weights: Literal["fp32", "model"] = "fp32") -> None:
        if cuda_graphs not in ("auto", True, False) or not isinstance(cuda_graphs, (bool, str)):
            raise ValueError(f"cuda_graphs must be 'auto', True or False, got {cuda_graphs!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if (virtual_shards is not None) != (layout == "virtual"):
            raise ValueError("virtual_shards is given exactly for layout='virtual'")
        self.cfg = cfg
        self.device = dev = torch.device(device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cfg.check(self.world, layout=layout, virtual_shards=virtual_shards)
        self.pad, self.layout, self.virtual_shards, self.shard_fold = pad, layout, virtual_shards, shard_fold
        self.invariant = layout != "fold"
        self.fuse = False  # declare_sites decides (fused layer boundaries under a bitwise envelope)
        self.heads_local = cfg.heads // self.world
        self.vocab_local = cfg.vocab // self.world
        self.vocab_start = self.rank * self.vocab_local
        g = torch.Generator().manual_seed(cfg.seed)
        H, A, F, V = cfg.hidden, cfg.heads * cfg.head_dim, cfg.ffn, cfg.vocab
        dt, blocks = cfg.dtype, (cfg.blocks if self.invariant else None)

        # Drawn on the CPU in full (same numbers on every platform and W), then sharded by detcomm.tp.
        def col(m: torch.Tensor) -> ColumnParallelLinear:
            return ColumnParallelLinear(m, blocks=blocks, dtype=dt, device=dev)

        def row(m: torch.Tensor, site: str) -> RowParallelLinear:
            return RowParallelLinear(m, site=site, layout=layout, max_rows=cfg.t_pad, virtual_shards=virtual_shards,
                                     blocks=blocks if layout == "full_k" else None, dtype=dt, device=dev,
                                     shard_fold=shard_fold, shard_weights=shard_weights)

        def vec(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dt).to(dev)

        embed = torch.randn(V, H, generator=g)
        # Replicated in the plain layout; vocabulary-parallel (one row's owner supplies it) in the invariant ones.
        self.embed = None if self.invariant else embed.to(dt).to(dev)
        self.embedding = (VocabParallelEmbedding(embed, site=SITE_NAMES["embed"], max_rows=cfg.t_pad, dtype=dt,
                                                 device=dev) if self.invariant else None)
        self.layers: list[dict] = []
        for _ in range(cfg.layers):
            wq, wk, wv = (_rand(g, H, A, fan_in=H) for _ in range(3))
            wo = _rand(g, A, H, fan_in=A)
            wg, wu = _rand(g, H, F, fan_in=H), _rand(g, H, F, fan_in=H)
            wd = _rand(g, F, H, fan_in=F)
            self.layers.append({
                "attn_norm": vec(H),
                "mlp_norm": vec(H),
                # Q, K, V column-parallel by heads; o_proj row-parallel over them.
                "q": col(wq), "k": col(wk), "v": col(wv),
                "o": row(wo, SITE_NAMES["o_proj"]),
                "gate": col(wg), "up": col(wu),
                "down": row(wd, SITE_NAMES["down_proj"]),
            })
        self.final_norm = vec(H)
        # LM head: every vocabulary entry has a near-twin half a vocabulary away (the same column times
        # 1 + ~2^-21 noise), so the top logit always has a rival a few ulps away. A reduction whose order
        # moves then flips greedy tokens, not only logprob bits: the negative control bites on token ids.
        base = _rand(g, H, V // 2, fan_in=H) * 4.0
        twin = base * (1.0 + 2.0**-21 * torch.randn(H, V // 2, generator=g))
        head = torch.cat([base, twin], dim=1)
        self.lm_head = (None if self.invariant else
                        head[:, self.vocab_start : self.vocab_start + self.vocab_local].contiguous().to(dt).to(dev))
        self.head = (VocabParallelHead(head, blocks=cfg.blocks, t_pad=cfg.t_pad, site="lm_head", dtype=dt, device=dev)
                     if self.invariant else None)
        # Rotary table for every position, computed once in float64: per-call cos/sin could take a vector or a
        # scalar path depending on the tensor's length and round differently.
        inv = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        ang = torch.arange(cfg.max_context, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos, self.sin = torch.cos(ang).to(dt).to(dev), torch.sin(ang).to(dt).to(dev)
        # Every request's keys and values; the impl is named once (a trainer reproducing these bits uses it too).
        self.kv = PagedKV(layers=cfg.layers, kv_heads=self.heads_local, head_dim=cfg.head_dim,
                          block_size=cfg.block_size, num_blocks=cfg.num_blocks, max_context=cfg.max_context,
                          dtype=dt, device=dev, impl=cfg.attention_impl)
        self.attention_impl: str = self.kv.impl
        self._graph_mode = cuda_graphs
        self._inputs: StepInputs | None = None
        self._graphs: StepGraphs[torch.Tensor] | None = None
        self.cuda_graphs: bool = False
        self.graphs_reason: str | None = "sites not declared yet (declare_sites decides)"
        #: whether next_tokens captures the head with the step; head_graphs_reason: why not
        self.head_graphs: bool = False
        self.head_graphs_reason: str | None = self.graphs_reason

    # -- sites -----------------------------------------------------------------------------------------
    def declare_sites(self, *, route: str | None = None) -> None:
        """Declare the model's call sites (collective). ``route`` forces the route of the two row-parallel
        all-reduces (the probe's negative control uses "native"; the full-K layout has no all-reduce)."""
        cfg = self.cfg
        if self.embedding is not None:
            self.embedding.declare()
        for L in self.layers[:1]:  # every layer calls the same two sites
            for lin in (L["o"], L["down"]):
                lin.route = route
                lin.declare()
        # Under a bitwise envelope the boundaries are fused (the norm is then detcomm's canonical RMSNorm
        # everywhere): in the fold layout with no route forced (a forced route is the negative control: the plain
        # all-reduce + the model's own norm), and in the tree layout whatever route the sums take (a bitwise
        # envelope only forces canonical routes there, which give the tree's bits; the boundary site takes the same
        # route, and runs the tree all-reduce, then the canonical norm: docs/spec.md §9.2 "Tree sites"). The
        # shard-order and full-K layouts keep their own row-parallel layers (no fused kernel folds the shard order;
        # full-K has no sum).
        tree = self.layout == "virtual" and self.shard_fold == "tree"
        self.fuse = (route is None and not self.invariant or tree) and detcomm.get_communicator().resolved.bitwise
        if self.fuse:
            for name in ("o_proj", "down_proj"):
                detcomm.site(FUSED_SITE_NAMES[name], collective="all_reduce_rmsnorm", dtype=cfg.dtype,
                             shape=(cfg.hidden,), max_rows=cfg.t_pad, route=route if tree else None,
                             virtual_shards=self.virtual_shards if tree else None,
                             shard_fold="tree" if tree else "order")
        if self.head is not None:
            self.head.declare()
        else:
            detcomm.site(SITE_NAMES["argmax"], collective="argmax", dtype=torch.float32, shape=(self.vocab_local,),
                         max_rows=cfg.t_pad)
            detcomm.site(SITE_NAMES["gather"], collective="all_gather", dtype=torch.float32,
                         shape=(self.vocab_local,), max_rows=cfg.t_pad)
        self._setup_graphs()

    # -- CUDA graphs (detcomm.numerics.step_graph; as detcomm.hf's engine) -------------------------------------
    def step_sites(self) -> list[str]:
        """The detcomm sites one step calls (the head's sampling sites are outside the step)."""
        sites = [] if self.embedding is None else [self.embedding.site]
        for L in self.layers:
            for lin, name in ((L["o"], "o_proj"), (L["down"], "down_proj")):
                if self.fuse:
                    sites.append(FUSED_SITE_NAMES[name])
                elif lin.layout == "full_k":
                    sites += [f"{lin.site}.gather_in", f"{lin.site}.gather_out"]
                else:
                    sites.append(lin.site)
        return sites

    def _setup_graphs(self) -> None:
        """The static buffers and graphs (after the sites: the decision reads their routes; the same on every rank)."""
        mode = self._graph_mode
        self._inputs, self._graphs = None, None
        if mode is False:
            self.cuda_graphs, self.graphs_reason = False, "cuda_graphs=False"
            self.head_graphs, self.head_graphs_reason = False, self.graphs_reason
            return
        reason: str | None = None
        if self.device.type != "cuda":
            reason = f"the model runs on {self.device}: CUDA graphs need a CUDA device"
        elif self.attention_impl != "triton":
            reason = (f"attention_impl={self.attention_impl!r} reads each row tile's KV block range back to the host, "
                      "which a CUDA graph cannot hold: use attention_impl='triton' (CUDA's default)")
        else:
            comm = detcomm.get_communicator()
            reason = next((why for site in self.step_sites()
                           if (why := comm.capture_refusal(site, library=mode is True)) is not None), None)
        if mode is True and reason is not None:
            raise ValueError(f"cuda_graphs=True: this model's step cannot be captured in a CUDA graph: {reason}. Fix "
                             "that, or pass cuda_graphs='auto' (eager where capture cannot run) or cuda_graphs=False")
        c = self.cfg
        self._inputs = StepInputs({"ids": (c.t_pad,), "pos": (c.t_pad,), "last": (c.t_pad,), "keys": (c.t_pad,),
                                   "temps": (c.t_pad,), **self.kv.step_shapes(segments=c.t_pad, rows=c.t_pad)}, device=self.device)
        self.cuda_graphs, self.graphs_reason = reason is None, reason
        # The head's sites decide separately (detcomm.hf's engine: the step stays one graph, the head eager after it).
        if reason is None:
            comm = detcomm.get_communicator()
            reason = next((why for site in self.head_sites()
                           if (why := comm.capture_refusal(site, library=mode is True)) is not None), None)
        self.head_graphs, self.head_graphs_reason = reason is None, reason
        self._graphs = StepGraphs(self._static_body, device=self.device, capture=self.cuda_graphs)

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (one per real row count); 0 when the steps run eagerly."""
        return self._graphs.captures if self._graphs is not None and self.cuda_graphs else 0

    def release_graphs(self) -> None:
        """Drop the captured graphs (before detcomm.shutdown where one captured an NCCL call)."""
        if self._graphs is not None:
            self._graphs.release()

    def head_sites(self) -> list[str]:
        """The detcomm sites the head calls (``greedy``, ``logprobs``; ``next_tokens`` captures them with the step)."""
        if self.head is not None:
            p = self.head.site
            return [f"{p}.argmax", f"{p}.stats", f"{p}.logprobs"]
        return [SITE_NAMES["argmax"], SITE_NAMES["gather"]]

    def _static_body(self, key: object) -> torch.Tensor:
        """The graph body of a shape key: ``rows`` (every real row's logit shard) or ``(rows, S, sampled)`` (the step
        and its head: ``next_tokens``' packed [2, S] tokens and logprobs)."""
        assert self._inputs is not None
        dev = self._inputs.dev
        rows, n, sampled = key if isinstance(key, tuple) else (key, None, False)
        assert isinstance(rows, int)
        logits = self._logits(self._body(dev["ids"], dev["pos"], self.kv.static_step(dev, rows), rows), rows)
        if n is None:
            return logits
        assert isinstance(n, int) and n >= 1
        return self._head(logits[dev["last"][:n]], sampling.from_bits(dev["temps"][:n]), dev["keys"][:n],
                          sampled=bool(sampled))

    def _head(self, shard: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, *, sampled: bool) -> torch.Tensor:
        """The token choice on device tensors only (eager and captured alike): greedy (``greedy``) or seeded
        Gumbel-max over the logprobs (``sampling.pick``), and the chosen token's logprob (``logprobs``' bits),
        packed [2, S]. Collective."""
        lps = self.logprobs(shard)
        tok = sampling.pick(lps, temps, keys) if sampled else self.greedy(shard)
        return sampling.pack(tok, lps.gather(1, tok[:, None])[:, 0])

    def next_tokens(self, segments: Sequence[Segment], *, keys: Sequence[int] | None = None,
                    temperatures: Sequence[float] | None = None) -> sampling.StepTokens:
        """One step and its token choice (detcomm.hf.TPCausalLM.next_tokens' contract): each sampling segment's
        next token, its fp32 logprob (a CPU tensor [S]) and the segments' indices (``sampling.StepTokens``), read
        back in one device-to-host copy; greedy unless ``keys`` and ``temperatures`` (one per sampling segment) are given. On the static
        buffers one graph per (rows, S, sampled) where the model captures. Collective."""
        picks = [i for i, s in enumerate(segments) if s.sample]
        n = len(picks)
        smp = sampling.check_sampling(n, keys, temperatures)
        if not n:
            self.forward(segments)
            return sampling.StepTokens([], torch.zeros(0, dtype=torch.float32), picks)
        if self._inputs is None or self._graphs is None:
            shard, _ = self.forward(segments)
            temps = sampling.from_bits(torch.from_numpy(sampling.f32_bits(temperatures or [0.0] * n)).to(self.device))
            packed = self._head(shard, temps, torch.tensor(list(keys or [0] * n), dtype=torch.int64,
                                                           device=self.device), sampled=smp)
        else:
            host = self._stage(segments)
            host["keys"][:n] = np.asarray(list(keys), dtype=np.int64) if keys is not None else 0
            host["temps"][:n] = sampling.f32_bits(temperatures) if temperatures is not None else 0
            self._inputs.upload()
            rows = sum(len(s.tokens) for s in segments)
            if self.head_graphs or not self.cuda_graphs:  # one body: step + head (captured, or eager)
                packed = self._graphs((rows, n, smp))
            else:  # the captured step, then the head eagerly on its output and the static buffers
                dev = self._inputs.dev
                packed = self._head(self._graphs(rows)[dev["last"][:n]], sampling.from_bits(dev["temps"][:n]),
                                    dev["keys"][:n], sampled=smp)
        toks, lps = sampling.unpack(packed.cpu().numpy())  # the step's one device-to-host copy
        return sampling.StepTokens(toks, lps, picks)

    def new_cache(self) -> list[int]:
        """A new request's KV cache: an empty block table of the model's paged cache (``Segment.blocks``), grown
        by each step; hand it back with ``free_cache`` when the request is done."""
        return self.kv.new_table()

    def free_cache(self, blocks: list[int]) -> None:
        """Return a finished request's blocks to the cache (``blocks`` is emptied)."""
        self.kv.free(blocks)

    def local_gemm_weights(self) -> list[torch.Tensor]:
        """Every weight a local GEMM multiplies (for the row-position check of the probes)."""
        out = [w for L in self.layers for k in ("q", "k", "v", "gate", "up") for w in L[k].blocks]
        out += [w for L in self.layers for k in ("o", "down") for w in L[k].weights]
        if self.head is not None:
            return out + self.head.weights
        assert self.lm_head is not None
        return [*out, self.lm_head]

    # -- local compute at a fixed shape ----------------------------------------------------------------
    def _cols(self, lin: ColumnParallelLinear, x: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """A column-parallel layer's blocks on the [T_pad, K] buffer (``pad=False``: on the real rows only)."""
        if self.pad:
            return lin.forward_blocks(x)
        out = []
        for b in lin.forward_blocks(x[:rows]):
            full = torch.zeros(x.shape[0], b.shape[1], dtype=b.dtype, device=self.device)
            full[:rows] = b
            out.append(full)
        return out

    def _cols_cat(self, lin: ColumnParallelLinear, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The blocks of ``_cols`` side by side, [T_pad, N/W]. On CUDA (padded buffers) the layer's one launch
        (detcomm.numerics.shard_gemm.block_gemm) is already that tensor: no split and re-concatenation."""
        if self.pad and x.is_cuda:
            return lin(x)
        return torch.cat(self._cols(lin, x, rows), dim=1)

    def _rows(self, lin: RowParallelLinear, x: torch.Tensor, rows: int) -> torch.Tensor:
        """A row-parallel layer: the whole [rows, H] output on every rank. Collective."""
        return lin(x if self.pad else x[:rows], rows)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fuse:  # one norm everywhere: the canonical one the fused boundaries compute
            return detcomm.rms_norm(x, w, eps=self.cfg.eps)
        f = x.to(torch.float32)
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.cfg.eps)).to(x.dtype) * w

    def _boundary(self, lin: RowParallelLinear, inp: torch.Tensor, h: torch.Tensor, w: torch.Tensor, name: str,
                  rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A row-parallel projection of ``inp`` and the layer boundary after it: the residual stream h + the
        projection and its next norm (rows >= ``rows`` are filler). Fused (fold or tree layout, bitwise envelope): the
        layer's local partials (the fold layout's partial product, the tree layout's V/W fp32 shard partials), then
        one detcomm.all_reduce_residual_rmsnorm; else the layer's own reduction, the add, the model's norm.
        Collective."""
        h = h.clone()
        if not self.fuse:
            h[:rows] += self._rows(lin, inp, rows)
            return h, self._norm(h, w)
        part = lin.partials(inp if self.pad else inp[:rows], rows)
        y, r = detcomm.all_reduce_residual_rmsnorm(part, h[:rows], w, eps=self.cfg.eps,
                                                   site=FUSED_SITE_NAMES[name])
        h[:rows] = r
        normed = torch.zeros_like(h)  # filler rows stay filler: rows never mix in the fixed-shape GEMMs
        normed[:rows] = y
        return h, normed

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [T_pad, heads, head_dim], rotate-half convention; elementwise IEEE ops only (no shape dependence).
        half = x.shape[-1] // 2
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _attn_block(self, L: dict, li: int, x: torch.Tensor, pos: torch.Tensor, step: StepKV,
                    rows: int) -> torch.Tensor:
        """Attention of one layer on the normed [T_pad, H] input: o_proj's [T_pad, heads/W * head_dim] input. One
        paged_attention call over the real rows (rotary: elementwise IEEE ops only, no shape dependence)."""
        c, hl, hd = self.cfg, self.heads_local, self.cfg.head_dim
        q, k, v = (self._cols_cat(L[n], x, rows) for n in ("q", "k", "v"))
        q = self._rope(q.reshape(c.t_pad, hl, hd), pos)
        k = self._rope(k.reshape(c.t_pad, hl, hd), pos)
        v = v.reshape(c.t_pad, hl, hd)
        attn = torch.zeros(c.t_pad, hl * hd, dtype=c.dtype, device=self.device)
        attn[:rows] = self.kv.attend(li, q[:rows], k[:rows], v[:rows], step, scale=1.0 / math.sqrt(hd),
                                     window=None).reshape(rows, hl * hd)
        return attn

    def _mlp_block(self, L: dict, x: torch.Tensor, rows: int) -> torch.Tensor:
        """SwiGLU of one layer on the normed [T_pad, H] input: down_proj's [T_pad, F/W] input. The activation runs
        per column block (each its own [T_pad, F/blocks] tensor at every W) on CPU, where torch's vectorized loops
        could treat a wider tensor's tail otherwise; on CUDA an elementwise op computes each element alike whatever
        the tensor's width, so it runs once over the layer's one-launch output."""
        if self.pad and x.is_cuda:
            return torch.nn.functional.silu(L["gate"](x)) * L["up"](x)
        act = [torch.nn.functional.silu(gb) * ub for gb, ub in zip(self._cols(L["gate"], x, rows),
                                                                     self._cols(L["up"], x, rows))]
        return act[0] if len(act) == 1 else torch.cat(act, dim=1)

    # -- one forward step ------------------------------------------------------------------------------
    def hidden(self, segments: Sequence[Segment]) -> tuple[torch.Tensor, list[int], int]:
        """Run the layers over the segments' rows, packed in order, on fresh tensors. Collective. Returns the
        final-normed [T_pad, H] buffer, each segment's first row and the real row count."""
        c = self.cfg
        ids, pos, offsets, rows = pack_segments(segments, t_pad=c.t_pad, max_context=c.max_context, device=self.device)
        step = self.kv.step([s.blocks for s in segments], [(s.start, len(s.tokens)) for s in segments])
        return self._body(ids, pos, step, rows), offsets, rows

    def _body(self, ids: torch.Tensor, pos: torch.Tensor, step: StepKV, rows: int) -> torch.Tensor:
        """The layers on device tensors only (the one code path of fresh, static and captured steps)."""
        if self.embedding is not None:
            h = self.embedding(ids)  # rows >= `rows` are filler
        else:
            assert self.embed is not None
            h = self.embed[ids]
        normed = self._norm(h, self.layers[0]["attn_norm"] if self.layers else self.final_norm)
        for li, L in enumerate(self.layers):
            attn = self._attn_block(L, li, normed, pos, step, rows)
            h, normed = self._boundary(L["o"], attn, h, L["mlp_norm"], "o_proj", rows)
            act = self._mlp_block(L, normed, rows)
            nxt = self.layers[li + 1]["attn_norm"] if li + 1 < len(self.layers) else self.final_norm
            h, normed = self._boundary(L["down"], act, h, nxt, "down_proj", rows)
        return normed

    def _step_logits(self, segments: Sequence[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every real row's logit shard [rows, vocab/W] and the sampling rows (the last row of every segment with
        ``sample``): on the static buffers (captured per row count where the model captures) unless
        cuda_graphs=False. Collective."""
        picks = [i for i, s in enumerate(segments) if s.sample]
        if self._inputs is None or self._graphs is None:
            x, offsets, rows = self.hidden(segments)
            last = torch.tensor([offsets[i] + len(segments[i].tokens) - 1 for i in picks], dtype=torch.long,
                                device=self.device)
            return self._logits(x, rows), last
        self._stage(segments)
        self._inputs.upload()
        logits = self._graphs(sum(len(s.tokens) for s in segments))
        # A graph's output is overwritten by its next replay, the buffers by the next step: the caller's copies.
        return (logits.clone() if self.cuda_graphs else logits), self._inputs.dev["last"][: len(picks)].clone()

    def _stage(self, segments: Sequence[Segment]) -> dict[str, np.ndarray]:
        """Write a step's integers into the static buffers' host views (the caller adds the head's and uploads)."""
        c = self.cfg
        assert self._inputs is not None
        if len(segments) > c.t_pad:
            raise ValueError(f"a step carries at most T_pad={c.t_pad} segments, got {len(segments)}")
        host = self._inputs.begin()
        offsets, _ = stage_segments(segments, host["ids"], host["pos"], max_context=c.max_context)
        self.kv.stage(host, [s.blocks for s in segments], [(s.start, len(s.tokens)) for s in segments])
        picks = [i for i, s in enumerate(segments) if s.sample]
        host["last"][: len(picks)] = [offsets[i] + len(segments[i].tokens) - 1 for i in picks]
        return host

    def _logits(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        if self.head is not None:
            return self.head.logits(x if self.pad else x[:rows])[:rows]
        w = self.lm_head
        assert w is not None
        return (torch.matmul(x, w) if self.pad else torch.matmul(x[:rows], w)).to(torch.float32)[:rows]

    def forward(self, segments: Sequence[Segment]) -> tuple[torch.Tensor, list[int]]:
        """Run one step over the segments' rows, packed in order. Collective.

        Returns this rank's fp32 logit shard [S, vocab/W] of the sampling rows (the last row of every segment
        with ``sample``) and the index of each such segment.
        """
        logits, last = self._step_logits(segments)
        return logits[last], [i for i, s in enumerate(segments) if s.sample]

    def forward_all(self, segments: Sequence[Segment]) -> torch.Tensor:
        """The logit shard [rows, vocab/W] of every real row (teacher forcing: the training code path's one
        forward over whole sequences). Collective."""
        return self._step_logits(segments)[0]

    # -- vocabulary-parallel head ------------------------------------------------------------------------
    def greedy(self, shard: torch.Tensor) -> torch.Tensor:
        """Global argmax per row (lowest index on exact ties) over the vocabulary shards. Collective."""
        if self.head is not None:
            return self.head.greedy(shard)
        return detcomm.argmax(shard, site=SITE_NAMES["argmax"], vocab_start=self.vocab_start)

    def logprobs(self, shard: torch.Tensor) -> torch.Tensor:
        """fp32 log-softmax over the whole vocabulary, [S, vocab], identical bits on every rank. Collective.

        Invariant layouts: ``detcomm.tp.VocabParallelHead`` (fixed vocabulary blocks: the same bits at every
        W). Plain layout: the shards are gathered (data movement: no arithmetic, so no order to move) and each
        row's log-softmax runs row-locally on a fixed [T_pad, vocab] buffer, so neither the number of rows nor
        a row's place among them reaches its arithmetic."""
        if self.head is not None:
            return self.head.logprobs(shard)
        c = self.cfg
        n = shard.shape[0]
        full = detcomm.all_gather(shard.contiguous(), site=SITE_NAMES["gather"])  # [W * n, V/W], rank order
        full = full.view(self.world, n, self.vocab_local).transpose(0, 1).reshape(n, c.vocab)
        buf = torch.zeros(c.t_pad, c.vocab, dtype=torch.float32, device=self.device)
        buf[:n] = full
        return torch.log_softmax(buf, dim=-1)[:n]
