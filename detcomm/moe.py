"""Expert-parallel MoE collectives whose combine does not depend on the batch or on the expert placement.

    placement = Placement.random(num_experts=16, world_size=W, seed=3, max_replicas=2)
    site = moe_site("layer3.moe", dtype=torch.bfloat16, hidden=H, top_k=k, max_tokens=2048)
    d = moe_dispatch(tokens, expert_ids, placement=placement, site=site)   # collective
    y = run_experts_blocked(d.rows, d.expert_ids, my_expert_fn, block=64)   # the model's part (below)
    out = moe_combine(y, weights, d.handle, site=site, shared=shared_out)  # collective

**Dispatch** moves every (token, slot) pair whose expert id is >= 0 to one replica of its expert over the site's
uneven all-to-all (rows as raw bits), the replica chosen from the token's key and the expert alone:
``hosts(e)[(key(t) + e) mod len(hosts(e))]``, key = the global token id when given, else rank + t.

**Combine** sends each expert output row back to the token's rank and folds the token's slots there in slot
order from +0.0: ``acc = fp32(acc + fp32(fp32(w[t, j]) * fp32(y[t, j])))`` for j = 0..k-1 (no FMA), the
shared expert's output as one more term of weight 1, one rounding to the dtype (canonical NaN). No per-rank
partials are summed, so no placement, replica choice, batch or W moves a bit. ``ZERO_EXPERT`` (-1) is skipped
(the same bits as adding +0.0); ``IDENTITY_EXPERT`` (-2) contributes ``w * token``.

``combine_order="rank"`` (per-rank partials summed in rank order, as engines do today) is the negative control,
refused under a bitwise envelope. The model's part of the bargain: ``run_experts_blocked`` runs each expert on
fixed blocks of ``block`` rows, so every expert GEMM has one shape whatever the batch.

Cost: one uneven all-to-all each way (16 bytes of metadata per slot; the combine reuses the dispatch's counts)
plus 2k elementwise fp32 passes. The full derivation (why skipping equals adding +0.0, the shared expert's
single rounding, the cost): docs/design/moe.md, "The collectives".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .dtypes import FLOAT_DTYPES, bits_view
from .numerics.fold import canonicalize_nan

__all__ = [
    "ZERO_EXPERT",
    "IDENTITY_EXPERT",
    "COMBINE_ORDERS",
    "Placement",
    "MoESite",
    "MoEHandle",
    "MoEDispatch",
    "moe_site",
    "moe_dispatch",
    "moe_combine",
    "slot_fold",
    "run_experts_blocked",
]

ZERO_EXPERT = -1
IDENTITY_EXPERT = -2
COMBINE_ORDERS = ("slot", "rank")
_META_BYTES = 16  # int32 expert id, source rank, token index, slot, carried as raw bits beside each row


@dataclass(frozen=True)
class Placement:
    """Which ranks host which expert: ``hosts[e]`` is the ascending tuple of distinct ranks holding expert e
    (more than one: replicas, e.g. of a hot expert). Every expert has at least one host."""

    world_size: int
    hosts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"world_size must be an int, got {type(self.world_size).__name__}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not self.hosts:
            raise ValueError("a placement needs at least one expert")
        for e, h in enumerate(self.hosts):
            if not isinstance(h, tuple) or not all(isinstance(r, int) and not isinstance(r, bool) for r in h):
                raise TypeError(f"hosts[{e}] must be a tuple of int ranks, got {h!r}")
            if not h:
                raise ValueError(f"expert {e} has no host rank; give every expert at least one")
            if list(h) != sorted(set(h)) or h[0] < 0 or h[-1] >= self.world_size:
                raise ValueError(f"hosts[{e}] = {h} must be distinct ascending ranks in 0..{self.world_size - 1}")

    @property
    def num_experts(self) -> int:
        return len(self.hosts)

    @classmethod
    def round_robin(cls, num_experts: int, world_size: int) -> Placement:
        """Expert e on rank e mod world_size, no replicas."""
        return cls(world_size, tuple((e % world_size,) for e in range(num_experts)))

    @classmethod
    def replicated(cls, num_experts: int, world_size: int) -> Placement:
        """Every expert on every rank (the replica rule then spreads each expert's rows over all ranks)."""
        return cls(world_size, tuple(tuple(range(world_size)) for _ in range(num_experts)))

    @classmethod
    def random(cls, num_experts: int, world_size: int, *, seed: int, max_replicas: int = 1) -> Placement:
        """A random placement: each expert on 1..max_replicas distinct random ranks (torch.Generator(seed))."""
        if not 1 <= max_replicas <= world_size:
            raise ValueError(f"max_replicas must be in 1..{world_size}, got {max_replicas}")
        gen = torch.Generator().manual_seed(seed)
        hosts = []
        for _ in range(num_experts):
            n = int(torch.randint(1, max_replicas + 1, (1,), generator=gen))
            hosts.append(tuple(sorted(torch.randperm(world_size, generator=gen)[:n].tolist())))
        return cls(world_size, tuple(hosts))

    def experts_on(self, rank: int) -> tuple[int, ...]:
        """The experts rank ``rank`` hosts (ascending)."""
        return tuple(e for e, h in enumerate(self.hosts) if rank in h)

    def replica_ranks(self, expert_ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The module docstring's replica rule, elementwise: hosts(e)[(key + e) mod len(hosts(e))]."""
        width = max(len(h) for h in self.hosts)
        table = torch.tensor([h + (h[0],) * (width - len(h)) for h in self.hosts], dtype=torch.int64)
        count = torch.tensor([len(h) for h in self.hosts], dtype=torch.int64)
        e = expert_ids.cpu()
        pick = torch.remainder(keys.cpu() + e, count[e])
        return table[e, pick].to(expert_ids.device)


@dataclass(frozen=True)
class MoESite:
    """The two all-to-all sites of one MoE layer (declared by ``moe_site``)."""

    name: str
    dispatch: str
    combine: str
    group: dist.ProcessGroup | None = None


def moe_site(name: str, *, dtype: torch.dtype, hidden: int, top_k: int, max_tokens: int,
             group: dist.ProcessGroup | None = None) -> MoESite:
    """Declare an MoE layer's sites: ``name.dispatch`` (token rows with their 16 metadata bytes as extra
    columns of ``dtype``, at most ``max_tokens * top_k`` rows sent by a rank) and ``name.combine`` (expert output
    rows back, ``hidden`` wide: at most every slot of every rank, ``world_size * max_tokens * top_k``). Collective when a declaration runs a
    self-check: declare in the same order on every rank. A plain str site instead declares the same names
    implicitly at their first call (with ``init(default_max_rows=)``)."""
    from . import get_communicator

    if not isinstance(name, str):
        raise TypeError(f"an MoE site's name is a str, got {type(name).__name__}")
    for what, v in (("hidden", hidden), ("top_k", top_k), ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{what} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{what} must be >= 1, got {v}")
    comm = get_communicator(group)
    s = _site_names(name, group)
    sent = max_tokens * top_k
    comm.site(s.dispatch, collective="all_to_all", dtype=dtype, shape=(hidden + _meta_columns(dtype),), max_rows=sent)
    comm.site(s.combine, collective="all_to_all", dtype=dtype, shape=(hidden,), max_rows=comm.world_size * sent)
    return s


def _site_names(name: str, group: dist.ProcessGroup | None = None) -> MoESite:
    return MoESite(name, f"{name}.dispatch", f"{name}.combine", group)


def _meta_columns(dtype: torch.dtype) -> int:
    return _META_BYTES // dtype.itemsize


@dataclass(frozen=True)
class MoEHandle:
    """What ``moe_combine`` needs to route expert outputs back and fold them (opaque to callers).

    Source side (this rank's tokens): ``send_pos`` holds the flat slot index t*k + j of every row sent, in send
    order; ``send_splits`` the rows sent to each rank; ``slot_rank`` [T, k] the rank serving each slot (the
    source rank for the identity expert, -1 for the zero expert). Expert side: ``recv_splits`` the rows received
    from each rank and ``recv_order`` the received position of each dispatched row."""

    num_tokens: int
    top_k: int
    world_size: int
    rank: int
    expert_ids: torch.Tensor
    tokens: torch.Tensor
    send_pos: torch.Tensor
    send_splits: tuple[int, ...]
    slot_rank: torch.Tensor
    recv_splits: tuple[int, ...]
    recv_order: torch.Tensor


@dataclass(frozen=True)
class MoEDispatch:
    """What a rank runs its experts on: ``rows`` [R, H] sorted by (expert id, source rank, token, slot), with
    ``expert_ids``, ``src_rank``, ``src_token``, ``src_slot`` [R] int64 naming each row; ``handle`` goes to
    ``moe_combine``. The expert outputs passed to the combine must be in the same row order."""

    rows: torch.Tensor
    expert_ids: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_slot: torch.Tensor
    handle: MoEHandle


def _resolve(site: MoESite | str) -> MoESite:
    if isinstance(site, MoESite):
        return site
    if isinstance(site, str):
        return _site_names(site)
    raise TypeError(f"site must be an MoE site name (str) or a detcomm.moe.MoESite, got {type(site).__name__}")


def moe_dispatch(tokens: torch.Tensor, expert_ids: torch.Tensor, *, placement: Placement, site: MoESite | str,
                 token_ids: torch.Tensor | None = None) -> MoEDispatch:
    """Send each of this rank's (token, slot) pairs to a rank hosting the slot's expert. Collective.

    ``tokens`` [T, H] (contiguous, on the communicator's device); ``expert_ids`` [T, k] int64, each in
    0..num_experts-1 or ``ZERO_EXPERT`` / ``IDENTITY_EXPERT`` (never sent); ``token_ids`` [T] int64: global
    token ids for the replica rule (default: rank + t; see the module docstring). Returns an ``MoEDispatch``.
    """
    from . import get_communicator

    s = _resolve(site)
    comm = get_communicator(s.group)
    w, rank = comm.world_size, comm.rank
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a detcomm.moe.Placement, got {type(placement).__name__}")
    if placement.world_size != w:
        raise ValueError(f"the placement is for {placement.world_size} ranks, the group has {w}")
    if not isinstance(tokens, torch.Tensor) or not isinstance(expert_ids, torch.Tensor):
        raise TypeError("tokens and expert_ids must be torch.Tensors")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [T, H], got shape {list(tokens.shape)}")
    if expert_ids.dtype != torch.int64 or expert_ids.dim() != 2 or expert_ids.shape[0] != tokens.shape[0]:
        raise ValueError(f"expert_ids must be int64 [T={tokens.shape[0]}, k], got {expert_ids.dtype} "
                         f"{list(expert_ids.shape)}")
    if expert_ids.numel() and (int(expert_ids.min()) < IDENTITY_EXPERT
                               or int(expert_ids.max()) >= placement.num_experts):
        raise ValueError(f"expert ids must be in 0..{placement.num_experts - 1} or ZERO_EXPERT (-1) / "
                         f"IDENTITY_EXPERT (-2), got {int(expert_ids.min())}..{int(expert_ids.max())}")
    T, k = expert_ids.shape
    if token_ids is not None and (token_ids.dtype != torch.int64 or tuple(token_ids.shape) != (T,)):
        raise ValueError(f"token_ids must be int64 [T={T}], got {token_ids.dtype} {list(token_ids.shape)}")
    dev = tokens.device
    ids = expert_ids.to(dev)
    flat = ids.reshape(-1)
    pos = torch.arange(T * k, device=dev)
    t_of, j_of = pos // k, pos % k
    sent = flat >= 0
    e, t, j = flat[sent], t_of[sent], j_of[sent]
    keys = (token_ids.to(dev)[t] if token_ids is not None else t + rank)
    dest = placement.replica_ranks(e, keys)
    # Send order: by destination (the all-to-all's blocks), then expert, then (t, j) (stable sort keeps it).
    order = torch.sort(dest * placement.num_experts + e, stable=True).indices
    send_pos = pos[sent][order]
    send_splits = torch.bincount(dest, minlength=w).tolist()
    H = tokens.shape[1]
    # One message per slot: the row and its metadata bytes side by side (exact: all-to-all moves raw bits).
    packed = torch.empty(e.numel(), H + _meta_columns(tokens.dtype), dtype=tokens.dtype, device=dev)
    packed[:, :H] = tokens[t[order]]
    meta = torch.stack([e, torch.full_like(e, rank), t, j], dim=1)[order].to(torch.int32)
    bits = bits_view(tokens.dtype)  # metadata is written and read through an integer view: never as floats
    packed.view(bits)[:, H:] = meta.view(bits)
    recv = comm.all_to_all(packed, s.dispatch, splits=send_splits)
    recv_meta = recv.view(bits)[:, H:].contiguous().view(torch.int32).to(torch.int64)
    recv_rows = recv[:, :H]
    recv_splits = torch.bincount(recv_meta[:, 1], minlength=w).tolist()
    recv_order = torch.sort(recv_meta[:, 0], stable=True).indices
    got = recv_meta[recv_order]
    slot_rank = torch.full((T * k,), -1, dtype=torch.int64, device=dev)
    slot_rank[send_pos] = dest[order]
    slot_rank[flat == IDENTITY_EXPERT] = rank
    handle = MoEHandle(T, k, w, rank, ids, tokens, send_pos, tuple(send_splits), slot_rank.view(T, k),
                       tuple(recv_splits), recv_order)
    return MoEDispatch(recv_rows[recv_order], got[:, 0], got[:, 1], got[:, 2], got[:, 3], handle)


def moe_combine(expert_out: torch.Tensor, weights: torch.Tensor, handle: MoEHandle, *, site: MoESite | str,
                shared: torch.Tensor | None = None, combine_order: str = "slot") -> torch.Tensor:
    """Return each expert output row to its token's rank and fold the token's slots (module docstring). Collective.

    ``expert_out`` [R, H'] in the dispatched rows' order (float); ``weights`` [T, k] (any float dtype; widened
    to fp32 exactly); ``shared`` [T, H'] or None. Returns [T, H'] in ``expert_out``'s dtype.
    ``combine_order="rank"`` (the negative control) is refused under a bitwise envelope.
    """
    from . import get_communicator

    s = _resolve(site)
    comm = get_communicator(s.group)
    if not isinstance(handle, MoEHandle):
        raise TypeError(f"handle must be the MoEHandle moe_dispatch returned, got {type(handle).__name__}")
    if combine_order not in COMBINE_ORDERS:
        raise ValueError(f"combine_order must be one of {COMBINE_ORDERS}, got {combine_order!r}")
    if combine_order == "rank" and comm.resolved.bitwise:
        raise ValueError(
            f"combine_order='rank' sums per-rank partials, whose bits move with the expert placement and the "
            f"batch; numerics={comm.resolved.numerics!r} is bitwise and refuses it. Use combine_order='slot' "
            "(same cost), or detcomm.init(numerics='auto') for the engines' rank-order sum"
        )
    T, k = handle.num_tokens, handle.top_k
    rows = handle.recv_order.numel()
    if not isinstance(expert_out, torch.Tensor) or not isinstance(weights, torch.Tensor):
        raise TypeError("expert_out and weights must be torch.Tensors")
    if expert_out.dtype not in FLOAT_DTYPES or expert_out.dim() != 2 or expert_out.shape[0] != rows:
        raise ValueError(f"expert_out must be a float [R={rows}, H] tensor in the dispatched rows' order, got "
                         f"{expert_out.dtype} {list(expert_out.shape)}")
    if weights.dtype not in FLOAT_DTYPES or tuple(weights.shape) != (T, k):
        raise ValueError(f"weights must be a float [T={T}, k={k}] tensor, got {weights.dtype} {list(weights.shape)}")
    hid = expert_out.shape[1]
    if shared is not None and (not isinstance(shared, torch.Tensor) or shared.dtype not in FLOAT_DTYPES
                               or tuple(shared.shape) != (T, hid)):
        raise ValueError(f"shared must be a float [T={T}, H={hid}] tensor or None")
    ids = handle.expert_ids.reshape(-1)
    ident = (ids == IDENTITY_EXPERT).nonzero().squeeze(1)
    if ident.numel() and handle.tokens.shape[1] != hid:
        raise ValueError(f"the identity expert's output is its token row: expert outputs must be the tokens' width "
                         f"{handle.tokens.shape[1]}, got {hid}")
    back = torch.empty_like(expert_out)
    back[handle.recv_order] = expert_out
    # The counts coming back are the ones this rank dispatched: no count exchange on the way back.
    returned = comm.all_to_all(back, s.combine, splits=list(handle.recv_splits), out_splits=list(handle.send_splits))
    dev = returned.device
    # y[t, j]: slot j's expert output for token t (+0.0 rows for the zero expert, the token for the identity).
    alloc = torch.zeros if bool((ids == ZERO_EXPERT).any()) else torch.empty  # every other row is written below
    y = alloc(T * k, hid, dtype=expert_out.dtype, device=dev)
    y[handle.send_pos] = returned
    if ident.numel():
        y[ident] = handle.tokens[ident // k].to(y.dtype)
    y = y.view(T, k, hid)
    if combine_order == "slot":
        # y's zero-expert rows are +0.0 already: the fold without slot_fold's masking pass.
        return _slot_fold(_weights32(weights.to(dev), handle.expert_ids), y, None if shared is None else shared.to(dev))
    return _rank_order_fold(weights.to(dev), y, handle.expert_ids, handle.slot_rank, handle.world_size,
                            shared=None if shared is None else shared.to(dev))


def _weights32(weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    # Zero-expert slots: weight +0.0 (a NaN there is never read) times a +0.0 row is +0.0, which the fold adds
    # as a no-op (module docstring).
    return torch.where(expert_ids != ZERO_EXPERT, weights.to(torch.float32), 0.0)


def slot_fold(weights: torch.Tensor, y: torch.Tensor, expert_ids: torch.Tensor, *,
              shared: torch.Tensor | None = None) -> torch.Tensor:
    """The combine's arithmetic on one rank (module docstring): ``y`` [T, k, H] holds slot j's expert output
    for token t (any row for a zero-expert slot: it is ignored), ``weights`` and ``expert_ids`` [T, k];
    returns [T, H] in ``y``'s dtype. Local (not collective)."""
    zero = expert_ids == ZERO_EXPERT
    if bool(zero.any()):
        y = y.masked_fill(zero.unsqueeze(2), 0.0)
    return _slot_fold(_weights32(weights, expert_ids), y, shared)


def _slot_fold(w32: torch.Tensor, y: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    T, k, H = y.shape
    acc = torch.zeros(T, H, dtype=torch.float32, device=y.device)
    prod = torch.empty_like(acc)
    for j in range(k):
        # A multiply and an add as two torch operations: the product is rounded to fp32 (written to memory)
        # before the add reads it, so nothing can contract them into an FMA. The operand widens exactly.
        torch.mul(y[:, j], w32[:, j : j + 1], out=prod)
        acc.add_(prod)
    if shared is not None:
        acc.add_(shared)  # a bf16/fp16 operand widens exactly before its one fp32 addition
    return canonicalize_nan(acc.to(y.dtype))


def _rank_order_fold(weights: torch.Tensor, y: torch.Tensor, expert_ids: torch.Tensor, slot_rank: torch.Tensor,
                     world_size: int, *, shared: torch.Tensor | None) -> torch.Tensor:
    """The negative control: each serving rank's partial (its slots, in slot order, fp32), then the partials in
    rank order (engines compute the partials on the serving ranks; the fp32 arithmetic is the same)."""
    prod = torch.mul(_weights32(weights, expert_ids).unsqueeze(2), y.to(torch.float32))
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for r in range(world_size):
        partial = torch.zeros_like(acc)
        for j in range(y.shape[1]):
            mine = (slot_rank[:, j] == r).unsqueeze(1)
            partial = torch.where(mine, torch.add(partial, prod[:, j]), partial)
        acc = torch.add(acc, partial)
    if shared is not None:
        acc = torch.add(acc, shared.to(torch.float32))
    return canonicalize_nan(acc.to(y.dtype))


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def run_experts_blocked(rows: torch.Tensor, expert_ids: torch.Tensor, expert_fn: ExpertFn, *,
                        block: int) -> torch.Tensor:
    """Run ``expert_fn(e, x)`` on each expert's rows in fixed blocks of exactly ``block`` rows (the last block
    zero-padded), so every call has the same shape whatever the batch: the model's part of the bargain (module
    docstring). ``rows`` [R, H] and ``expert_ids`` [R] as ``MoEDispatch`` gives them; returns [R, H'] in the
    same order. Local (not collective)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if rows.dim() != 2 or expert_ids.shape != (rows.shape[0],):
        raise ValueError(f"rows must be [R, H] and expert_ids [R], got {list(rows.shape)} and {list(expert_ids.shape)}")
    outs: list[torch.Tensor] = []
    where: list[torch.Tensor] = []
    for e in torch.unique(expert_ids).tolist():
        idx = (expert_ids == e).nonzero().squeeze(1)
        for start in range(0, idx.numel(), block):
            part = idx[start:start + block]
            x = torch.zeros(block, rows.shape[1], dtype=rows.dtype, device=rows.device)
            x[: part.numel()] = rows[part]
            y = expert_fn(int(e), x)
            if y.dim() != 2 or y.shape[0] != block:
                raise ValueError(f"expert_fn must return [block={block}, H'] rows, got {list(y.shape)}")
            outs.append(y[: part.numel()])
            where.append(part)
    if not outs:
        return rows.new_zeros(0, rows.shape[1])
    out = torch.empty(rows.shape[0], outs[0].shape[1], dtype=outs[0].dtype, device=rows.device)
    out[torch.cat(where)] = torch.cat(outs)
    return out
