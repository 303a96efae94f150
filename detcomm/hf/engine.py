"""A transformers causal LM served tensor-parallel over detcomm at one fixed step shape (docs/hf.md).

``TPCausalLM`` shards the loaded ``nn.Module`` tree (``detcomm.hf.shard``: only the Linear and Embedding modules,
so transformers' norms, rotary embedding, activations and attention kernel stay; not transformers' ``tp_plan``,
whose DTensor reductions cannot be given detcomm sites) and runs its own step loop (``forward``, ``generate``),
because transformers' attention takes one cache position for the whole batch. Local compute is batch-invariant
by construction:

* every step runs at one padded width ``T_pad`` (``ServingConfig.t_pad``): the real rows (prefill chunks and
  decode rows of any number of requests, packed) first, filler rows after, so every GEMM, norm and elementwise op
  sees one shape; T_pad and max_context are multiples of 64 (no CPU scalar tail);
* attention runs per request, in blocks of ``q_block`` query rows, against a static KV cache of ``max_context``
  positions with an additive causal (and sliding-window) mask, through transformers' ``eager_attention_forward``;
* the real row count reaches the arithmetic only at the row-parallel all-reduces (o_proj, down_proj, the
  vocabulary-parallel embedding): detcomm sites declared with ``max_rows = T_pad``;
* the LM head is vocabulary-parallel: fp32 logits, greedy through ``detcomm.argmax``, an exact
  vocabulary-parallel log-softmax combined in rank order.

``layout="virtual"`` (``virtual_shards=V``, ``shard_fold``) or ``"full_k"`` make the bits TP-size invariant
(docs/spec.md §9.1): fixed column blocks, fixed head groups, fixed vocabulary blocks. Under a bitwise envelope
the fold and tree layouts fuse each layer boundary into one ``detcomm.all_reduce_residual_rmsnorm`` call
(docs/spec.md §9.2), and every decoder RMSNorm is detcomm's canonical norm with the module's weight and eps.

Each step pays T_pad rows of GEMM and each request ceil(n / q_block) attention blocks against max_context keys,
whatever its real size: the costs, the boundaries' rules and what differs from transformers' own arithmetic
are in docs/design/hf-engine.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import detcomm

from ..numerics.norm import add_rms_norm
from ..rl import regions
from ..tp import Segment, pack_segments
from .agree import agreed
from .layers import StepRows
from .moe_block import EPConfig, EPMoEBlock
from .shard import Shards, add_norm_site, declare_sites, fuse_boundaries, shard_model
from .sliced import Checkpoint, fill

__all__ = ["ServingConfig", "StepLogits", "TPCausalLM", "ROW_ALIGN"]

# T_pad, q_block and max_context are multiples of these (see the module docstring).
ROW_ALIGN = 64


@dataclass(frozen=True)
class ServingConfig:
    """The fixed step geometry: ``t_pad`` rows per step (the ``max_rows`` of every site), ``q_block`` query
    rows per attention block, ``max_context`` tokens of KV cache per request."""

    t_pad: int = 64
    q_block: int = 16
    max_context: int = 128

    def check(self) -> None:
        if self.t_pad < 1 or self.t_pad % ROW_ALIGN:
            raise ValueError(f"t_pad must be a positive multiple of {ROW_ALIGN}, got {self.t_pad}")
        if self.max_context < 1 or self.max_context % ROW_ALIGN:
            raise ValueError(f"max_context must be a positive multiple of {ROW_ALIGN}, got {self.max_context}")
        if self.q_block < 1 or self.t_pad % self.q_block:
            raise ValueError(f"q_block must divide t_pad={self.t_pad}, got {self.q_block}")


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
        # The invariant layouts: heads run in fixed groups (one Q column block and its KV heads); the
        # detcomm.tp layers declare their own sites.
        self.invariant = layout != "fold"
        b = self.shards.blocks if self.invariant else 1
        self.group = (self.shards.heads, self.shards.kv_heads) if not self.invariant else \
            (self.config.num_attention_heads // b, (getattr(self.config, "num_key_value_heads", None)
                                                   or self.config.num_attention_heads) // b)
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
        self._attend = modeling.eager_attention_forward
        # Rotary cos/sin for every position, computed once by the model's own rotary module and then indexed:
        # a per-step call would put a position's cos/sin in a different vector lane with every batch.
        L = serving.max_context
        with torch.no_grad():
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = model.model.rotary_emb(probe, torch.arange(L, device=self.device)[None])
        self.cos, self.sin = cos[0], sin[0]  # [L, head_dim]
        self._masks: dict[int | None, torch.Tensor] = {}
        self._layer_window = [self._window(layer.self_attn) for layer in self.layers]
        for w in set(self._layer_window):
            self._masks[w] = self._mask_table(w)

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

    def _mask_table(self, window: int | None) -> torch.Tensor:
        """Additive [L, L] mask (query position, key position) in the model dtype, as transformers builds it:
        0 where the key is visible, the dtype's minimum elsewhere."""
        L = self.cfg.max_context
        q = torch.arange(L)[:, None]
        k = torch.arange(L)[None, :]
        visible = k <= q
        if window is not None:
            visible &= k > q - window
        zero = torch.zeros((), dtype=self.dtype)
        return torch.where(visible, zero, torch.finfo(self.dtype).min).to(self.device)

    def new_cache(self) -> torch.Tensor:
        """One request's static KV cache on this rank: [layers, 2, this rank's KV heads, max_context, head_dim]."""
        s = self.shards
        return torch.zeros(len(self.layers), 2, s.kv_heads, self.cfg.max_context, s.head_dim, dtype=self.dtype,
                           device=self.device)

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

    # -- one step --------------------------------------------------------------------------------------
    def _attention(self, layer: int, attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   seg: Segment) -> torch.Tensor:
        """One request's n rows: q [heads, n, hd], k/v [kv_heads, n, hd] (rotated) -> [n, heads * hd]."""
        c, s = self.cfg, self.shards
        n, start = len(seg.tokens), seg.start
        kc, vc = seg.cache[layer, 0], seg.cache[layer, 1]
        kc[:, start : start + n] = k
        vc[:, start : start + n] = v
        table = self._masks[self._layer_window[layer]]
        out = torch.empty(n, s.heads * s.head_dim, dtype=self.dtype, device=self.device)
        qb = c.q_block
        for b0 in range(0, n, qb):
            m = min(qb, n - b0)
            qp = torch.zeros(1, s.heads, qb, s.head_dim, dtype=self.dtype, device=self.device)
            qp[0, :, :m] = q[:, b0 : b0 + m]
            qpos = torch.zeros(qb, dtype=torch.long, device=self.device)  # filler query rows see key 0
            qpos[:m] = torch.arange(start + b0, start + b0 + m, device=self.device)
            mask = table[qpos][None, None]  # [1, 1, q_block, L]
            gq, gk = self.group
            for g in range(s.heads // gq):  # fixed head groups: one call's shape does not follow W
                o, _ = self._attend(attn, qp[:, g * gq : (g + 1) * gq], kc[None, g * gk : (g + 1) * gk],
                                    vc[None, g * gk : (g + 1) * gk], mask, scaling=attn.scaling, dropout=0.0)
                cols = slice(g * gq * s.head_dim, (g + 1) * gq * s.head_dim)
                out[b0 : b0 + m, cols] = o[0, :m].reshape(m, gq * s.head_dim)  # o: [1, q_block, group, hd]
        return out

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
        (``add_rms_norm``, local)."""
        w, eps = norm.weight, norm.variance_epsilon
        if site is None:
            y, r = add_rms_norm(x, h[:rows], w, eps=eps)
        else:
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

    def forward(self, segments: Sequence[Segment], *, grad: bool = False) -> tuple[StepLogits, list[int]]:
        """Run one step over the segments' rows, packed in order. Collective.

        Returns the step's logits (``StepLogits``: this rank's vocabulary shard of every row, and the rows
        of the segments with ``sample``) and the index of each sampling segment. ``grad=True`` (the trainer,
        detcomm.rl): the same step with autograd, its collectives ``detcomm.rl.regions``' functions, whose
        forward is the same call: the same bits."""
        with torch.set_grad_enabled(grad):
            return self._step(segments)

    def _step(self, segments: Sequence[Segment]) -> tuple[StepLogits, list[int]]:
        c, s = self.cfg, self.shards
        ids, pos, offsets, rows = pack_segments(segments, t_pad=c.t_pad, max_context=c.max_context, device=self.device)
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
                q, k, v = q[0], k[0], v.transpose(0, 1)  # [heads, T_pad, hd]
                mixed = torch.zeros(c.t_pad, s.heads * hd, dtype=self.dtype, device=self.device)
                for seg, o in zip(segments, offsets):
                    n = len(seg.tokens)
                    mixed[o : o + n] = self._attention(li, attn, q[:, o : o + n], k[:, o : o + n], v[:, o : o + n], seg)
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
            logits = self.model.lm_head.shard_logits(x)  # [T_pad, shard] fp32
        finally:
            self.step_rows.rows = None
        picks = [i for i, seg in enumerate(segments) if seg.sample]
        last = torch.tensor([offsets[i] + len(segments[i].tokens) - 1 for i in picks], dtype=torch.long,
                            device=self.device)
        return StepLogits(logits, last), picks

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
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
        """Greedy continuation of every prompt by ``max_new_tokens`` tokens, all requests packed into shared
        steps (decode rows first, then prefill chunks, up to T_pad rows a step). Returns per prompt the new
        token ids and their fp32 logprobs; the bits do not depend on which prompts share the call. Collective
        (same arguments on every rank)."""
        c = self.cfg
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for p in prompts:
            if not 1 <= len(p) or len(p) + max_new_tokens > c.max_context:
                raise ValueError(f"a prompt of {len(p)} tokens plus {max_new_tokens} new ones must fit "
                                 f"max_context={c.max_context} (ServingConfig)")
        caches = [self.new_cache() for _ in prompts]
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
            logits, picks = self.forward([seg for _, seg in work])
            if not picks:
                continue
            toks, lps = self.greedy(logits), self.logprobs(logits)
            for j, k in enumerate(picks):
                i, tok = work[k][0], int(toks[j])
                out[i][0].append(tok)
                out[i][1].append(lps[j, tok].cpu())
        return [(t, torch.stack(l)) for t, l in out]
