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
mix), so one kernel configuration serves every batch. Attention runs per request with the query block padded
to T_pad rows and the keys to the cache's fixed length with a causal mask. The only place where the batch's
real row count reaches the arithmetic is the all-reduce of the row-parallel projections: that is detcomm's
job, and what the probe measures. ``pad=False`` runs the GEMMs at the real row count instead (to show that
the probe also catches local non-invariance).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import detcomm

__all__ = ["ModelConfig", "Segment", "TPTransformer", "SITE_NAMES", "pack_segments"]

SITE_NAMES = {"o_proj": "o_proj", "down_proj": "down_proj", "argmax": "lm_head.argmax", "gather": "lm_head.gather"}
# Under a bitwise envelope each layer boundary is one fused call: the row-parallel all-reduce, the residual add and
# the next RMSNorm (detcomm.all_reduce_residual_rmsnorm, docs/spec.md §9.2).
FUSED_SITE_NAMES = {"o_proj": "o_proj.add_norm", "down_proj": "down_proj.add_norm"}


@dataclass(frozen=True)
class ModelConfig:
    """Model and serving geometry. ``heads``, ``ffn`` and ``vocab`` must divide by the world size
    (the defaults divide by 1..8 except 5 and 7 for heads)."""

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

    def check(self, world: int) -> None:
        for name in ("heads", "ffn", "vocab"):
            if getattr(self, name) % world:
                raise ValueError(f"model {name}={getattr(self, name)} does not divide by the world size {world}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype}")


@dataclass
class Segment:
    """One request's rows in one forward step: ``tokens`` at positions start.. of the request's ``cache``.

    ``sample``: the last row's logits produce the request's next token (a decode row, or the last chunk of
    its prompt)."""

    cache: torch.Tensor
    tokens: Sequence[int]
    start: int
    sample: bool = field(default=True)


def pack_segments(segments: Sequence[Segment], *, t_pad: int, max_context: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """Lay one step's segments out in a fixed ``t_pad``-row buffer, in order: the token ids and positions of
    every row (filler rows: token 0 at position 0), each segment's first row, and the real row count."""
    rows = sum(len(s.tokens) for s in segments)
    if not 1 <= rows <= t_pad:
        raise ValueError(f"a step carries 1..T_pad={t_pad} rows, got {rows}")
    ids = torch.zeros(t_pad, dtype=torch.long)
    pos = torch.zeros(t_pad, dtype=torch.long)  # built on the CPU, moved once below
    offsets, at = [], 0
    for s in segments:
        n = len(s.tokens)
        if s.start + n > max_context:
            raise ValueError(f"a request outgrew max_context={max_context}")
        ids[at : at + n] = torch.tensor(list(s.tokens), dtype=torch.long)
        pos[at : at + n] = torch.arange(s.start, s.start + n)
        offsets.append(at)
        at += n
    return ids.to(device), pos.to(device), offsets, rows


def _rand(g: torch.Generator, *shape: int, fan_in: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32) / math.sqrt(fan_in)


class TPTransformer:
    """The decoder's shard on this rank. Call ``declare_sites`` once after ``detcomm.init`` (collective),
    then ``forward`` on every rank with the same segments."""

    def __init__(self, cfg: ModelConfig, *, pad: bool = True, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = dev = torch.device(device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cfg.check(self.world)
        self.pad = pad
        self.fuse = False  # declare_sites decides (fused layer boundaries under a bitwise envelope)
        self.heads_local = cfg.heads // self.world
        self.vocab_local = cfg.vocab // self.world
        self.vocab_start = self.rank * self.vocab_local
        g = torch.Generator().manual_seed(cfg.seed)
        H, A, F, V, r, w = cfg.hidden, cfg.heads * cfg.head_dim, cfg.ffn, cfg.vocab, self.rank, self.world
        dt = cfg.dtype

        # Drawn on the CPU (same numbers on every platform), then moved.
        def cols(m: torch.Tensor, n: int) -> torch.Tensor:  # this rank's slice of the output columns
            return m[:, r * (n // w) : (r + 1) * (n // w)].contiguous().to(dt).to(dev)

        def rows(m: torch.Tensor, n: int) -> torch.Tensor:  # this rank's slice of the input rows
            return m[r * (n // w) : (r + 1) * (n // w)].contiguous().to(dt).to(dev)

        def vec(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dt).to(dev)

        self.embed = torch.randn(V, H, generator=g).to(dt).to(dev)
        self.layers = []
        for _ in range(cfg.layers):
            wq, wk, wv = (_rand(g, H, A, fan_in=H) for _ in range(3))
            wo = _rand(g, A, H, fan_in=A)
            wg, wu = _rand(g, H, F, fan_in=H), _rand(g, H, F, fan_in=H)
            wd = _rand(g, F, H, fan_in=F)
            self.layers.append({
                "attn_norm": vec(H),
                "mlp_norm": vec(H),
                # Q, K, V column-parallel by heads: one GEMM for the three.
                "wqkv": torch.cat([cols(wq, A), cols(wk, A), cols(wv, A)], dim=1),
                "wo": rows(wo, A),
                "wgu": torch.cat([cols(wg, F), cols(wu, F)], dim=1),
                "wd": rows(wd, F),
            })
        self.final_norm = vec(H)
        # LM head: every vocabulary entry has a near-twin half a vocabulary away (the same column times
        # 1 + ~2^-21 noise), so the top logit always has a rival a few ulps away. A reduction whose order
        # moves then flips greedy tokens, not only logprob bits: the negative control bites on token ids.
        base = _rand(g, H, V // 2, fan_in=H) * 4.0
        twin = base * (1.0 + 2.0**-21 * torch.randn(H, V // 2, generator=g))
        self.lm_head = cols(torch.cat([base, twin], dim=1), V)
        # Rotary table for every position, computed once in float64: per-call cos/sin could take a vector or a
        # scalar path depending on the tensor's length and round differently.
        inv = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        ang = torch.arange(cfg.max_context, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos, self.sin = torch.cos(ang).to(dt).to(dev), torch.sin(ang).to(dt).to(dev)
        # Causal mask over the fixed key length, per query position.
        self.mask = (torch.arange(cfg.max_context)[None, :] > torch.arange(cfg.max_context)[:, None]).to(dev)

    # -- sites -----------------------------------------------------------------------------------------
    def declare_sites(self, *, route: str | None = None) -> None:
        """Declare the model's call sites (collective). ``route`` forces the route of the two row-parallel
        all-reduces (the probe's negative control uses "native")."""
        cfg = self.cfg
        # The fused boundary under a bitwise envelope (its norm is then detcomm's canonical RMSNorm everywhere);
        # a forced route (the negative control) keeps the plain all-reduce + the model's own norm.
        self.fuse = route is None and detcomm.get_communicator().resolved.bitwise
        for name in ("o_proj", "down_proj"):
            detcomm.site(SITE_NAMES[name], collective="all_reduce", dtype=cfg.dtype, shape=(cfg.hidden,),
                         max_rows=cfg.t_pad, route=route)
            if self.fuse:
                detcomm.site(FUSED_SITE_NAMES[name], collective="all_reduce_rmsnorm", dtype=cfg.dtype,
                             shape=(cfg.hidden,), max_rows=cfg.t_pad)
        detcomm.site(SITE_NAMES["argmax"], collective="argmax", dtype=torch.float32, shape=(self.vocab_local,),
                     max_rows=cfg.t_pad)
        detcomm.site(SITE_NAMES["gather"], collective="all_gather", dtype=torch.float32, shape=(self.vocab_local,),
                     max_rows=cfg.t_pad)

    def new_cache(self) -> torch.Tensor:
        """One request's KV cache on this rank: [layers, 2, local heads, max_context, head_dim]."""
        c = self.cfg
        return torch.zeros(c.layers, 2, self.heads_local, c.max_context, c.head_dim, dtype=c.dtype, device=self.device)

    # -- local compute at a fixed shape ----------------------------------------------------------------
    def _linear(self, x: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
        if self.pad:
            return torch.matmul(x, w)  # x is the whole [T_pad, K] buffer
        out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=self.device)
        out[:rows] = torch.matmul(x[:rows], w)
        return out

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fuse:  # one norm everywhere: the canonical one the fused boundaries compute
            return detcomm.rms_norm(x, w, eps=self.cfg.eps)
        f = x.to(torch.float32)
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.cfg.eps)).to(x.dtype) * w

    def _reduce_add_norm(self, part: torch.Tensor, h: torch.Tensor, w: torch.Tensor, name: str,
                         rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After a row-parallel projection: the residual stream h + all_reduce(part) and its next norm (rows >=
        ``rows`` are filler). Fused: one detcomm.all_reduce_residual_rmsnorm; else the all-reduce, the add, the
        model's norm. Collective."""
        h = h.clone()
        if not self.fuse:
            h[:rows] += detcomm.all_reduce(part[:rows], site=SITE_NAMES[name])
            return h, self._norm(h, w)
        y, r = detcomm.all_reduce_residual_rmsnorm(part[:rows], h[:rows], w, eps=self.cfg.eps,
                                                   site=FUSED_SITE_NAMES[name])
        h[:rows] = r
        normed = torch.zeros_like(h)  # filler rows stay filler: rows never mix in the fixed-shape GEMMs
        normed[:rows] = y
        return h, normed

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [T_pad, heads, head_dim], rotate-half convention.
        half = x.shape[-1] // 2
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _attention(self, q: torch.Tensor, seg: Segment, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One request's attention: its n new rows of q/k/v ([n, heads, hd]); returns [n, heads * hd]."""
        c = self.cfg
        n, s = len(seg.tokens), seg.start
        kc, vc = seg.cache[layer, 0], seg.cache[layer, 1]  # [heads, L, hd]
        kc[:, s : s + n] = k.transpose(0, 1)
        vc[:, s : s + n] = v.transpose(0, 1)
        qp = torch.zeros(self.heads_local, c.t_pad, c.head_dim, dtype=c.dtype, device=self.device)
        qp[:, :n] = q.transpose(0, 1)
        qpos = torch.zeros(c.t_pad, dtype=torch.long, device=self.device)
        qpos[:n] = torch.arange(s, s + n, device=self.device)
        scores = torch.matmul(qp, kc.transpose(1, 2)).to(torch.float32) * (1.0 / math.sqrt(c.head_dim))
        scores = scores.masked_fill(self.mask[qpos][None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(c.dtype)
        out = torch.matmul(probs, vc)  # [heads, T_pad, hd]
        return out[:, :n].transpose(0, 1).reshape(n, self.heads_local * c.head_dim)

    # -- one forward step ------------------------------------------------------------------------------
    def forward(self, segments: Sequence[Segment]) -> tuple[torch.Tensor, list[int]]:
        """Run one step over the segments' rows, packed in order. Collective.

        Returns this rank's fp32 logit shard [S, vocab/W] of the sampling rows (the last row of every segment
        with ``sample``) and the index of each such segment.
        """
        c = self.cfg
        ids, pos, offsets, rows = pack_segments(segments, t_pad=c.t_pad, max_context=c.max_context, device=self.device)
        h = self.embed[ids]  # [T_pad, H]; rows >= `rows` are filler
        hd, hl = c.head_dim, self.heads_local
        normed = self._norm(h, self.layers[0]["attn_norm"] if self.layers else self.final_norm)
        for li, L in enumerate(self.layers):
            qkv = self._linear(normed, L["wqkv"], rows)
            q, k, v = qkv.split(hl * hd, dim=1)
            q = self._rope(q.reshape(c.t_pad, hl, hd), pos)
            k = self._rope(k.reshape(c.t_pad, hl, hd), pos)
            v = v.reshape(c.t_pad, hl, hd)
            attn = torch.zeros(c.t_pad, hl * hd, dtype=c.dtype, device=self.device)
            for s, o in zip(segments, offsets):
                n = len(s.tokens)
                attn[o : o + n] = self._attention(q[o : o + n], s, li, k[o : o + n], v[o : o + n])
            part = self._linear(attn, L["wo"], rows)
            h, normed = self._reduce_add_norm(part, h, L["mlp_norm"], "o_proj", rows)
            gu = self._linear(normed, L["wgu"], rows)
            gate, up = gu.split(c.ffn // self.world, dim=1)
            part = self._linear(torch.nn.functional.silu(gate) * up, L["wd"], rows)
            nxt = self.layers[li + 1]["attn_norm"] if li + 1 < len(self.layers) else self.final_norm
            h, normed = self._reduce_add_norm(part, h, nxt, "down_proj", rows)
        logits = self._linear(normed, self.lm_head, rows).to(torch.float32)
        picks = [i for i, s in enumerate(segments) if s.sample]
        last = torch.tensor([offsets[i] + len(segments[i].tokens) - 1 for i in picks], dtype=torch.long, device=self.device)
        return logits[last], picks

    # -- vocabulary-parallel head ------------------------------------------------------------------------
    def greedy(self, shard: torch.Tensor) -> torch.Tensor:
        """Global argmax per row (lowest index on exact ties) over the vocabulary shards. Collective."""
        return detcomm.argmax(shard, site=SITE_NAMES["argmax"], vocab_start=self.vocab_start)

    def logprobs(self, shard: torch.Tensor) -> torch.Tensor:
        """fp32 log-softmax over the whole vocabulary, [S, vocab], identical bits on every rank. Collective.

        The shards are gathered (data movement: no arithmetic, so no order to move) and each row's
        log-softmax runs row-locally on a fixed [T_pad, vocab] buffer, so neither the number of rows nor a
        row's place among them reaches its arithmetic."""
        c = self.cfg
        n = shard.shape[0]
        full = detcomm.all_gather(shard.contiguous(), site=SITE_NAMES["gather"])  # [W * n, V/W], rank order
        full = full.view(self.world, n, self.vocab_local).transpose(0, 1).reshape(n, c.vocab)
        buf = torch.zeros(c.t_pad, c.vocab, dtype=torch.float32, device=self.device)
        buf[:n] = full
        return torch.log_softmax(buf, dim=-1)[:n]
