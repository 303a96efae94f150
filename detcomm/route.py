"""Static call-site routing (docs/spec.md sections 2 and 3).

A call site is a static declaration (name, collective, reduce op, dtype, trailing shape, group, the most rows
it will ever carry). ``AutoBackend.route(site)`` maps it to a route from those properties, the resolved
numerics envelope and the group's capabilities found at startup. It has no tensor argument and never sees a
row count, so a site cannot change route with the batch. Inside a canonical-fold route the row count may
still pick the kernel (one-shot, two-shot, gather+fold): all of them produce the canonical fold's bits.

Routes that later parts add (the CUDA-IPC workspace, multicast gathers) slot in here and in the
communicator's backend table; callers never name a route unless they force one on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

import torch

from .envelope import Resolved
from .fold import FLOAT_DTYPES

__all__ = [
    "Collective",
    "ReduceOp",
    "Route",
    "RouteInfo",
    "ROUTE_INFO",
    "Site",
    "Capabilities",
    "RouteDecision",
    "AutoBackend",
    "SUPPORTED_DTYPES",
    "DEFAULT_MAX_ROWS",
]

DEFAULT_MAX_ROWS = 8192
INT_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.uint8, torch.int32, torch.int64)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = FLOAT_DTYPES + INT_DTYPES


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    TOKEN_ALL_GATHER = "token_all_gather"
    ARGMAX = "argmax"

    @property
    def reduces(self) -> bool:
        return self in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)


class ReduceOp(str, Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"


class Route(str, Enum):
    NATIVE = "native"
    GATHER_FOLD = "gather_fold"
    A2A_FOLD = "a2a_fold"
    IPC_FOLD = "ipc_fold"
    MULTICAST_GATHER = "multicast_gather"
    IN_SWITCH = "in_switch"


@dataclass(frozen=True)
class RouteInfo:
    """What a route moves and whether its floating-point SUM is the canonical fold."""

    moves: str
    canonical_sum: bool


ROUTE_INFO: Mapping[Route, RouteInfo] = {
    Route.NATIVE: RouteInfo("the library's collective (NCCL on GPU, gloo on CPU)", canonical_sum=False),
    Route.GATHER_FOLD: RouteInfo("all-gather of the W inputs, canonical fold locally", canonical_sum=True),
    Route.A2A_FOLD: RouteInfo("all-to-all of the shards, canonical fold of each shard", canonical_sum=True),
    Route.IPC_FOLD: RouteInfo("CUDA-IPC workspace, one-shot or two-shot fold kernels", canonical_sum=True),
    Route.MULTICAST_GATHER: RouteInfo("NVLS multimem stores (gathers only)", canonical_sum=False),
    Route.IN_SWITCH: RouteInfo("NVLS in-switch reduction, order follows the buffer offset", canonical_sum=False),
}

# Which routes can carry which collective at all (before envelope and capabilities).
_CARRIES: Mapping[Route, frozenset[Collective]] = {
    Route.NATIVE: frozenset(Collective),
    Route.GATHER_FOLD: frozenset({Collective.ALL_REDUCE, Collective.REDUCE_SCATTER}),
    Route.A2A_FOLD: frozenset({Collective.REDUCE_SCATTER}),
    Route.IPC_FOLD: frozenset({Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER}),
    Route.MULTICAST_GATHER: frozenset({Collective.ALL_GATHER, Collective.TOKEN_ALL_GATHER}),
    Route.IN_SWITCH: frozenset({Collective.ALL_REDUCE}),
}


@dataclass(frozen=True)
class Site:
    """A static call-site declaration.

    Attributes:
        name: unique per group, e.g. "layers.o_proj".
        collective: which collective the site issues.
        dtype: the input dtype (the output keeps it; the fold accumulates in fp32).
        shape: trailing shape of one row (dim 0 is the row count, which varies per call).
        max_rows: the most rows a call will carry (per rank, for gathers).
        op: the reduce op (all_reduce, reduce_scatter); "max" for argmax by definition.
        group: the group's name as torch.distributed knows it.
        route: a forced route, or None for AutoBackend's choice.
        implicit: declared from a first call rather than by ``detcomm.site``.
    """

    name: str
    collective: Collective
    dtype: torch.dtype
    shape: tuple[int, ...]
    max_rows: int
    op: ReduceOp = ReduceOp.SUM
    group: str = "default"
    route: Route | None = None
    implicit: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a site needs a non-empty string name, got {self.name!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"site {self.name!r}: dtype {self.dtype} is not supported; use one of "
                f"{[str(d) for d in SUPPORTED_DTYPES]}"
            )
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.shape):
            raise ValueError(f"site {self.name!r}: shape must be a tuple of non-negative ints, got {self.shape!r}")
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise ValueError(f"site {self.name!r}: max_rows must be a positive int, got {self.max_rows!r}")
        if self.collective is Collective.ARGMAX:
            if self.dtype not in FLOAT_DTYPES:
                raise ValueError(f"site {self.name!r}: argmax takes floating-point logits, got {self.dtype}")
            if len(self.shape) != 1:
                raise ValueError(f"site {self.name!r}: argmax rows are vocabulary shards, shape (V_shard,), got {self.shape}")
            if self.op is not ReduceOp.MAX:
                raise ValueError(f"site {self.name!r}: argmax is a MAX reduction; op={self.op.value!r} makes no sense")
        elif not self.collective.reduces and self.op is not ReduceOp.SUM:
            raise ValueError(f"site {self.name!r}: {self.collective.value} moves data and takes no reduce op")
        if self.route is not None and self.collective not in _CARRIES[self.route]:
            raise ValueError(
                f"site {self.name!r}: route {self.route.value!r} cannot carry {self.collective.value}; routes that "
                f"can: {sorted(r.value for r, c in _CARRIES.items() if self.collective in c)}"
            )

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def float_sum(self) -> bool:
        return self.collective.reduces and self.op is ReduceOp.SUM and self.is_float

    @property
    def row_numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        op = f" {self.op.value}" if self.collective.reduces else ""
        return f"{self.collective.value}{op} {dt}[rows<={self.max_rows}, {', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Capabilities:
    """Static facts about a group, found once at startup and identical on every rank."""

    backend: str
    device_type: str
    world_size: int
    workspace: bool = False
    workspace_reason: str = "no CUDA-IPC workspace on this group"
    workspace_max_rows: int = 0
    multicast: bool = False
    multicast_reason: str = "not opted in"


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    why: str

    @property
    def canonical_sum(self) -> bool:
        return ROUTE_INFO[self.route].canonical_sum


class AutoBackend:
    """Maps sites to routes from static facts only (the site, the envelope, the group's capabilities).

    ``candidates(site)`` lists the acceptable routes in preference order; the communicator takes the first
    whose startup self-check passed. ``route(site)`` is the first candidate, cached per site.
    """

    def __init__(self, resolved: Resolved, caps: Capabilities) -> None:
        self.resolved = resolved
        self.caps = caps
        self._cache: dict[Site, RouteDecision] = {}

    def route(self, site: Site) -> RouteDecision:
        decision = self._cache.get(site)
        if decision is None:
            decision = self._cache[site] = self.candidates(site)[0]
        return decision

    def candidates(self, site: Site) -> list[RouteDecision]:
        sw = self.resolved.switches
        if site.route is not None:
            return [self._forced(site)]
        if site.collective in (Collective.ALL_GATHER, Collective.TOKEN_ALL_GATHER):
            if self.caps.multicast and not sw.force_deterministic_rsag:
                return [
                    RouteDecision(Route.MULTICAST_GATHER, "data movement on the multicast kernels"),
                    RouteDecision(Route.NATIVE, "data movement (multicast gather refused)"),
                ]
            why = "data movement" + (" (force_deterministic_rsag)" if sw.force_deterministic_rsag else "")
            return [RouteDecision(Route.NATIVE, why)]
        if site.collective is Collective.ALL_TO_ALL:
            return [RouteDecision(Route.NATIVE, "data movement")]
        if site.collective is Collective.ARGMAX:
            return [RouteDecision(Route.NATIVE, "int64 (value key, index) MAX: exact in any order, lowest index on ties")]
        if site.op is not ReduceOp.SUM:
            return [RouteDecision(Route.NATIVE, f"{site.op.value.upper()} on order-preserving int keys: exact in any order, ±0 and NaN canonical")]
        if not site.is_float:
            return [RouteDecision(Route.NATIVE, "integer SUM: exact in any order")]
        if not sw.batch_invariant_collectives:
            return [RouteDecision(Route.NATIVE, f"numerics={self.resolved.numerics}: the library's reduction (run-stable, not batch-invariant)")]
        return self._fold_candidates(site)

    def _fold_candidates(self, site: Site) -> list[RouteDecision]:
        sw = self.resolved.switches
        out: list[RouteDecision] = []
        if sw.force_deterministic_rsag:
            no_ws = "force_deterministic_rsag: no symmetric-memory path"
        elif not self.caps.workspace:
            no_ws = self.caps.workspace_reason
        elif site.max_rows > self.caps.workspace_max_rows:
            no_ws = f"max_rows {site.max_rows} > workspace's armed {self.caps.workspace_max_rows} rows"
        else:
            out.append(RouteDecision(Route.IPC_FOLD, f"canonical fold in the CUDA-IPC workspace (max_rows <= {self.caps.workspace_max_rows})"))
            no_ws = "workspace refused"
        if site.collective is Collective.ALL_REDUCE:
            out.append(RouteDecision(Route.GATHER_FOLD, f"canonical fold after an all-gather ({no_ws})"))
        else:
            out.append(RouteDecision(Route.A2A_FOLD, f"canonical fold after an all-to-all ({no_ws})"))
        return out

    def _forced(self, site: Site) -> RouteDecision:
        route = site.route
        assert route is not None
        if site.collective.reduces and site.op is not ReduceOp.SUM and route is not Route.NATIVE:
            raise ValueError(f"site {site.name!r}: {site.op.value.upper()} reductions run on the native route (order-preserving keys); route={route.value!r} does not apply")
        if site.collective.reduces and not site.is_float and route is not Route.NATIVE:
            raise ValueError(f"site {site.name!r}: integer sums run on the native route; route={route.value!r} does not apply")
        if site.float_sum and self.resolved.bitwise and not ROUTE_INFO[route].canonical_sum:
            raise ValueError(
                f"site {site.name!r}: route={route.value!r} is not batch-invariant and numerics="
                f"{self.resolved.numerics!r} promises bitwise batch invariance; drop route= (the envelope "
                "picks a canonical-fold route) or use numerics='auto'"
            )
        if route is Route.IPC_FOLD and (not self.caps.workspace or self.resolved.switches.force_deterministic_rsag):
            why = "force_deterministic_rsag" if self.resolved.switches.force_deterministic_rsag else self.caps.workspace_reason
            raise ValueError(f"site {site.name!r}: route='ipc_fold' is unavailable: {why}")
        if route in (Route.MULTICAST_GATHER, Route.IN_SWITCH) and not self.caps.multicast:
            raise ValueError(f"site {site.name!r}: route={route.value!r} is unavailable: {self.caps.multicast_reason}")
        return RouteDecision(route, "forced by the site's route=")
