"""Startup self-checks (docs/spec.md section 5): prove on this group that a route gives the bits it claims.

For each (route, collective, op, dtype, trailing shape) that will serve a bitwise claim, before its first real
call, an ill-conditioned payload (detcomm.payload) is reduced

  (a) twice: the two results must be bitwise equal (repeatability);
  (b) with the same rows at several offsets inside batches of different sizes: the rows' results must not
      move (the check the in-switch reduction and a ring reduction fail);
  (c) and compared with an independent reference computed from the gathered inputs (``reference_fold`` for
      sums; torch's own amax/amin/argmax for the key-based routes);
  (d) and every rank's result is compared with every other rank's.

A virtual-shard site (docs/spec.md §9.1) is checked the same way with V inputs: each rank passes its V/W fp32
partials of a payload whose cancelling pairs are spread over all V shards (so any reordering of shards shows
after rounding, at W = 1 too), and (c) compares with ``reference_fold`` of all V shards stacked. A tree-order
site (docs/spec.md §9.1 "The tree order") compares with the tree's definition (``numerics.tree.reference_tree``),
and its payload holds placed cancellations: +big and -big on the last leaf of one subtree and the first of its
sibling, at every level of the tree, on two sibling leaves, and an all -0.0 element, so that the shard-order
fold, another pairing, a reversed fold and a tree without its +0.0 each give other bits, at W = 1 too.

The verdict is agreed across ranks (one integer MAX), so a failing route is refused on every rank with the
same reason. Everything here is collective over the communicator's group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from . import envelope as _env
from .declare import allocatable, site_bytes
from .dtypes import name_of
from .errors import CollectiveMismatch
from .invariance import (
    Composition,
    batch1_reference,
    bits_equal,
    compositions,
    gather_whole,
    measure,
)
from .invariance import rows_changed as _rows_differing
from .layout import Kind, Layout
from .numerics.fold import average, canonical_nan, reference_fold
from .numerics.tree import reference_tree
from .payload import ill_conditioned, with_specials
from .route_impls import guard
from .route_impls.guard import hash_text
from .route_impls.native import NativeRoute
from .sites import NO_ARGS, BoundRoute, CallArgs, Collective, ReduceOp, Route, Site

__all__ = ["CheckKey", "CheckResult", "SelfChecks", "run_check", "bits_equal", "declaration", "is_resource_error"]

_BASE_ROWS = 3
# Filler rows the compositions of check (b) draw from (detcomm.invariance places the checked rows among them).
_FILLER_ROWS = 8
_SEED = 0x5E1FC
_DECLARE = 0x0DE7C0_DEC1  # the declaration header's tag (route_impls/guard.py)


@dataclass(frozen=True)
class CheckKey:
    route: Route
    collective: Collective
    op: ReduceOp
    dtype: torch.dtype
    shape: tuple[int, ...]
    variant: str = ""  # a forced kernel variant of the route ("" = the route's own choice)
    virtual_shards: int | None = None  # V of a virtual-shard site: the check folds V fp32 partials
    shard_fold: str = "order"  # a virtual-shard site's order over its V partials ("order" or "tree")

    @property
    def layout(self) -> Layout:
        """The checked site's layout (detcomm/layout.py): the payload and the reference follow it."""
        return Layout.of(self.virtual_shards, self.shard_fold)

    def label(self) -> str:
        dt = name_of(self.dtype)
        op = f" {self.op.value}" if self.collective.reduces else ""
        variant = f" [{self.variant}]" if self.variant else ""
        return f"{self.route.value}{variant}: {self.collective.value}{op} {dt}{list(self.shape)}{self.layout.spelled()}"


@dataclass(frozen=True)
class CheckResult:
    key: CheckKey
    passed: bool
    reason: str
    seconds: float
    # The check failed for this site's own size or resources (an allocation failure on every failing rank), not
    # for the route's arithmetic: routing refuses this site only, not the route for every other site (route.py).
    site_only: bool = False

    @property
    def label(self) -> str:
        return self.key.label()


def _max_min_reference(stacked: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    f = stacked.to(torch.float32)
    red = f.amax(dim=0) if op is ReduceOp.MAX else f.amin(dim=0)
    red = torch.where(red == 0, torch.zeros((), dtype=red.dtype), red)
    red = torch.where(torch.isnan(f).any(dim=0), float("nan"), red)
    out = red.to(stacked.dtype)
    return torch.where(torch.isnan(out), canonical_nan(out.dtype, out.device), out)


def is_resource_error(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure (this site's size or this device's memory, not the route's
    arithmetic): MemoryError, torch's OutOfMemoryError, or the allocators' RuntimeError texts."""
    if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(m in text for m in (
        "can't allocate memory", "cannot allocate memory", "not enough memory", "out of memory",
        "numel overflow", "storage size calculation overflowed"))


def declaration(site: Site, route: str) -> tuple[list[int], str]:
    """The declaration header (``guard.exchange``) of ``site`` bound to ``route``, and its readable form: the
    communicator exchanges it at every new declaration, the self-checks before a check runs."""
    forced = "" if site.route is None else f", route={site.route.value}"
    return ([_DECLARE, guard.site_hash(site), hash_text(site.name), site.max_rows,
             hash_text(f"{site.group}|{site.route.value if site.route else ''}")],
            f"declaring site {site.name!r} as {site.describe()}, max_rows={site.max_rows}{forced} ({route})")


def agree_at_init(group: dist.ProcessGroup, resolved: _env.Resolved, *, rank: int, world_size: int,
                  device: torch.device, **options: object) -> None:
    """Before any other collective: every rank must run the same envelope, checking mode and options, or
    the group's calls would pair wrongly later (a self-check one rank skips, a fingerprint one rank does not
    send). One object all-gather; on a difference every rank raises ``CollectiveMismatch`` naming it."""
    mine = {**_env.fingerprint(resolved), **{k: repr(v) for k, v in options.items()},
            "device": device.type, "W": str(world_size)}
    everyone: list[dict[str, str]] = [{}] * world_size
    dist.all_gather_object(everyone, mine, group=group)  # type: ignore[arg-type]
    differ = [k for k in mine if len({e.get(k) for e in everyone}) > 1]
    if differ:
        parts = "; ".join(f"{k}: " + ", ".join(f"rank {r}={e.get(k)}" for r, e in enumerate(everyone))
                          for k in differ)
        raise CollectiveMismatch(
            f"detcomm.init on rank {rank}: the ranks initialized differently ({parts}). Give every rank the "
            "same init arguments and environment (DETCOMM_NUMERICS, DETCOMM_CHECK): detcomm-launch exports "
            "them to every rank"
        )


def agree_declaration(s: Site, *, native: NativeRoute, world_size: int, device: torch.device) -> None:
    """Every new declaration is proven the same on every rank, whether or not its self-check is cached (a
    cached check runs no collective, so a rank whose declaration differs would otherwise wait alone in its
    own check), and every rank refuses a site too large for this device's memory before its self-check
    allocates (a check that ran out of memory would read as the route's failure). One header all-gather;
    on a difference every rank raises ``CollectiveMismatch`` naming each rank's declaration. Collective."""
    need, have = site_bytes(s, world_size), allocatable(device)
    fits = need <= have
    if world_size > 1:
        header, readable = declaration(s, "new site")
        if not fits:
            readable += f" (too large: {need} B > {have} B of {device.type} memory)"
        guard.exchange(native, [*header, int(fits)], readable, device=device)
    if not fits:
        raise ValueError(
            f"site {s.name!r} ({s.describe()}, max_rows={s.max_rows}): one call at max_rows carries {need} bytes "
            f"(max_rows x {s.row_numel} elements per row), more than this {device.type} "
            f"device's {have} bytes of memory, so no route can serve it (nothing was self-checked or refused). "
            "Declare the real trailing shape and the most rows a call carries"
        )


def run_check(
    key: CheckKey,
    execute: Callable[[torch.Tensor], torch.Tensor],
    *,
    native: NativeRoute,
    device: torch.device,
) -> CheckResult:
    """Run the four checks of ``key``'s route through ``execute`` (the route's collective); gathers and the
    verdict go through ``native`` (data movement and an integer MAX: exact on any library). Collective."""
    t0 = time.perf_counter()
    group, w, rank = native.group, native.world_size, native.rank
    failures: list[str] = []
    resource = False
    try:
        failures = _checks(key, execute, w=w, rank=rank, native=native, device=device)
    except Exception as e:  # noqa: BLE001 - a route that raises has failed its check; report why, agree below
        failures = [f"raised {type(e).__name__}: {e}"]
        resource = is_resource_error(e)
    flag = native.all_reduce(torch.tensor([1 if failures else 0], dtype=torch.int32, device=device), ReduceOp.MAX)
    if int(flag.item()) == 0:
        return CheckResult(key, True, "repeatable, offset/batch-invariant, equals the reference, ranks agree", time.perf_counter() - t0)
    gathered: list[object] = [None] * w
    dist.all_gather_object(gathered, (failures, resource), group=group)
    everyone = cast("list[tuple[list[str], bool]]", gathered)
    reason = "; ".join(f"rank {r}: {', '.join(f)}" for r, (f, _) in enumerate(everyone) if f)
    # Site-only when every failing rank ran out of memory: a wrong bit anywhere still refuses the route.
    site_only = all(res for f, res in everyone if f)
    return CheckResult(key, False, reason, time.perf_counter() - t0, site_only=site_only)


def _shard_payload(key: CheckKey, rows: int, *, seed: int, rank: int, w: int, device: torch.device) -> torch.Tensor:
    """A virtual-shard check's input, rows first: [rows, V/W, *shape] fp32, slab j = shard rank*V/W + j. Each
    shard's values are the dtype's ill-conditioned payload (cancelling pairs over all V shards), times a
    per-element factor 1 + u*2^-20 computed in fp32, so partials carry bits below the dtype's precision and the
    final rounding is exercised. The factor is the same on every shard: +big and -big still cancel exactly."""
    v = key.virtual_shards
    assert v is not None
    k = v // w
    u = torch.randint(-64, 65, (rows, *key.shape), generator=torch.Generator().manual_seed(seed))
    factor = 1.0 + u.to(torch.float32) * 2.0**-20
    slabs = []
    for j in range(k):
        shard = rank * k + j
        p = ill_conditioned(rows, key.shape, key.dtype, seed=seed, rank=shard, world_size=v).to(torch.float32)
        if key.layout.kind is Kind.TREE:
            p = _tree_placed(p, shard, v, key.dtype)
        slabs.append(p * factor)
    return torch.stack(slabs, dim=1).to(device)


def _tree_placements(v: int) -> list[tuple[int, int] | None]:
    """Where a tree check puts +big and -big (shard pairs), None for an element of -0.0 on every shard (which a
    tree without the root's +0.0 leaves -0.0). First the root's split (V/2 - 1, V/2): the tree cancels the pair
    only at the root, after each half absorbed its smalls, where the shard-order fold cancels it at once and keeps
    the smalls after it. Then two sibling leaves (0, 1), which the tree cancels first and another pairing or a
    reversed fold does not. Then the split of the first node of every lower level."""
    out: list[tuple[int, int] | None] = [None]
    if v >= 2:
        out.append((v // 2 - 1, v // 2))
    if v >= 4:
        out.append((0, 1))
    m = 4
    while m < v:
        out.append((m // 2 - 1, m // 2))
        m *= 2
    return out


def _tree_placed(p: torch.Tensor, shard: int, v: int, dtype: torch.dtype) -> torch.Tensor:
    """Shard ``shard``'s payload ``p`` with placed cancellations: the first elements take every placement once
    (so a check of one-element rows still meets each), then every even element cycles through them; the other
    elements keep the ill-conditioned values (subnormals, zeros, triads)."""
    big, small = (2.0**14, 2.0**-12) if dtype == torch.float16 else (2.0**100, 1.0)
    flat = p.reshape(-1).clone()
    places = _tree_placements(v)
    chosen = [(e, places[e]) for e in range(min(len(places), flat.numel()))]
    chosen += [(e, places[(e // 2) % len(places)]) for e in range(len(places) + len(places) % 2, flat.numel(), 2)]
    for e, place in chosen:
        if place is None:
            flat[e] = -0.0
        else:
            plus, minus = place
            flat[e] = big if shard == plus else -big if shard == minus else small * (1 + (shard + 1) / 32)
    return flat.view_as(p)


def _payload(key: CheckKey, rows: int, *, seed: int, rank: int, w: int, device: torch.device) -> torch.Tensor:
    if key.layout.virtual:
        return _shard_payload(key, rows, seed=seed, rank=rank, w=w, device=device)
    x = ill_conditioned(rows, key.shape, key.dtype, seed=seed, rank=rank, world_size=w)
    if key.collective is Collective.ARGMAX:
        # Exact ties across ranks and within a shard, and signed zeros, so lowest-index resolution is tested.
        x = x.clone()
        x[:, 1::7] = 1e4 if key.dtype == torch.float16 else 1e37
        x[:, 2::11] = -0.0
    if not key.op.sums and key.collective is not Collective.ARGMAX:
        x = with_specials(x, seed=seed, rank=rank)
    return x.to(device)


def _shards_first(execute: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: execute(x.transpose(0, 1).contiguous())


def _checks(key: CheckKey, execute: Callable[[torch.Tensor], torch.Tensor], *, w: int, rank: int,
            native: NativeRoute, device: torch.device) -> list[str]:
    rs = key.collective is Collective.REDUCE_SCATTER
    blocks = w if rs else 1  # a reduce-scatter input is W row blocks; rank r receives block r
    if key.layout.virtual:
        # The payloads are rows first (the compositions of (b) index dim 0); the route takes [V/W, rows, ...].
        execute = _shards_first(execute)
    b = _BASE_ROWS
    base = _payload(key, blocks * b, seed=_SEED, rank=rank, w=w, device=device)
    failures: list[str] = []

    out = execute(base)
    if not bits_equal(execute(base), out):
        failures.append("(a) not repeatable")

    # (b) the first B rows alone, then at other offsets, in batches of other sizes and (reduce-scatter) on
    # every receiving rank, compared wherever they land (detcomm.invariance).
    pool = torch.cat([base[:b], _payload(key, _FILLER_ROWS, seed=_SEED + 1, rank=rank, w=w, device=device)])
    coll = key.collective.value

    def whole(comp: Composition) -> torch.Tensor:
        return gather_whole(execute(pool[comp.tensor(device)]), collective=coll, all_gather=native.all_gather).cpu()

    _, tally = batch1_reference(whole, b, collective=coll, world_size=w)
    measure(whole, compositions(b, collective=coll, world_size=w, filler_rows=_FILLER_ROWS, count=4), tally=tally)
    if tally.rows_changed:
        failures.append(f"(b) rows moved with the batch or the receiving rank: {tally.rows_changed} of {b} rows "
                        f"changed, up to {tally.max_ulps:g} ulps")

    stacked = native.all_gather(base).view(w, *base.shape).cpu()
    if key.layout.virtual:  # [W, rows, V/W, ...] -> the V shards in order, [V, rows, ...]
        stacked = stacked.transpose(1, 2).reshape(-1, *base.shape[:1], *base.shape[2:])
    if key.collective is Collective.ARGMAX:
        full = stacked.permute(1, 0, 2).reshape(b, -1).to(torch.float32)
        ref = torch.argmax(full, dim=-1)
    elif key.layout.kind is Kind.TREE:
        ref = reference_tree(stacked.to(torch.float32), key.dtype)
    elif key.op is ReduceOp.SUM:
        ref = reference_fold(stacked, key.dtype)
    elif key.op is ReduceOp.AVG:
        ref = average(reference_fold(stacked, torch.float32), w, key.dtype)
    else:
        ref = _max_min_reference(stacked, key.op)
    if rs:
        ref = ref[rank * b : (rank + 1) * b]
    if not bits_equal(out.cpu(), ref):
        failures.append(f"(c) differs from the reference on {_rows_differing(out.cpu(), ref)} of {b} rows")

    if not rs:
        outs = native.all_gather(out.contiguous())
        if not all(bits_equal(o, out) for o in outs.view(w, *out.shape)):
            failures.append("(d) ranks hold different bits")
    return failures


class SelfChecks:
    """The group's self-check runner and its results, one per (route, collective, op, dtype, shape).

    Routing (route.Router.route) calls it with the bound route of a candidate that claims exact bits; a
    result is reused for every site with the same key. Calling it is collective over the group.
    """

    def __init__(self, *, native: NativeRoute, device: torch.device) -> None:
        self.native = native
        self.device = device
        self.results: dict[CheckKey, CheckResult] = {}

    def __call__(self, bound: BoundRoute) -> CheckResult:
        """Check the bound route and every kernel variant it exposes; the first failure is the verdict."""
        site = bound.site
        # An argmax check gives each rank the vocabulary shard it would hold in a real call.
        args = (CallArgs(vocab_start=self.native.rank * site.shape[0])
                if site.collective is Collective.ARGMAX else NO_ARGS)
        calls: dict[str, Callable[[torch.Tensor, CallArgs], torch.Tensor]] = {"": bound}
        calls.update(getattr(bound, "variants", {}))
        keys = [CheckKey(bound.route, site.collective, site.op, site.dtype, site.shape, v, site.virtual_shards,
                         site.shard_fold) for v in calls]
        if self.native.world_size > 1 and any(k not in self.results for k in keys):
            # The checks are collectives: ranks that declared the site differently would pair unrelated check
            # calls and refuse a sound route; prove first that every rank checks the same site.
            header, readable = declaration(site, f"route {bound.route.value}, self-checked now")
            guard.exchange(self.native, header, readable, device=self.device)
        result: CheckResult | None = None
        for key, call in zip(keys, calls.values()):
            result = self.results.get(key)
            if result is None:
                result = run_check(key, lambda x, c=call: c(x, args), native=self.native,  # type: ignore[misc]
                                   device=self.device)
                self.results[key] = result
            if not result.passed:
                return result
        assert result is not None
        return result

    def seconds(self) -> float:
        return sum(r.seconds for r in self.results.values())
