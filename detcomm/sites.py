"""The vocabulary below the router (docs/spec.md sections 2 and 3): what a call site is and what a route is.

Collective, ReduceOp and Route name what a site issues and what can carry it (``ROUTE_INFO``: what each route
moves and whether its floating-point SUM is the canonical fold); ``Site`` is a call site's static declaration,
validated here, without a group; ``Capabilities`` the static facts of a group found at startup; ``CallArgs``,
``BoundRoute`` and ``RouteImpl`` the protocol between the communicator, the router and the routes; a site's
``layout`` (plain, shard order or tree over V: detcomm/layout.py) is what every layer asks of its partials. The
defaults the static route view reads (``DEFAULT_*``) live here too, torch-free.

The router (detcomm/route.py) decides, the routes (detcomm/route_impls/) bind, the workspace's admission and the
numerics' fusion rule read sites: all of them import these names from here, so none of them imports the policy
for its words. Torch-free: torch appears only in annotations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from . import dtypes
from .dtypes import name_of
from .layout import SHARD_FOLDS, Layout

if TYPE_CHECKING:
    import torch

__all__ = [
    "Collective",
    "ReduceOp",
    "Route",
    "RouteInfo",
    "ROUTE_INFO",
    "Site",
    "Capabilities",
    "CallArgs",
    "NO_ARGS",
    "BoundRoute",
    "RouteImpl",
    "DEFAULT_MAX_ROWS",
    "DEFAULT_WORKSPACE_MAX_ROWS",
    "DEFAULT_WORKSPACE_BYTES",
    "VIRTUAL_SHARD_COLLECTIVES",
    "SHARD_FOLDS",
    "Layout",
]

DEFAULT_MAX_ROWS = 8192

# Workspace defaults (detcomm.init's workspace_max_rows / workspace_bytes; here, torch-free, so the static route
# view can read them): armed for sites up to a prefill chunk of rows; one launch carries this many bytes of a
# rank's rows: 32 MiB holds 2048 rows of a bf16 8192-wide row in one launch. Wider sites are chunked (same
# bits), and the route table says how many launches a site's max_rows takes.
DEFAULT_WORKSPACE_MAX_ROWS = 2048
DEFAULT_WORKSPACE_BYTES = 32 * 1024 * 1024


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    TOKEN_ALL_GATHER = "token_all_gather"
    ARGMAX = "argmax"
    # all-reduce, then the canonical residual add + RMSNorm (detcomm/numerics/norm.py): routed as an all-reduce
    ALL_REDUCE_RMSNORM = "all_reduce_rmsnorm"

    @property
    def reduces(self) -> bool:
        return self in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE_RMSNORM)


class ReduceOp(str, Enum):
    SUM = "sum"
    AVG = "avg"  # floats only: the SUM's fp32 result divided once by W, then rounded once (fold.average)
    MAX = "max"
    MIN = "min"

    @property
    def sums(self) -> bool:
        """SUM or AVG: reductions whose arithmetic is an addition (canonical fold on bitwise routes)."""
        return self in (ReduceOp.SUM, ReduceOp.AVG)


class Route(str, Enum):
    NATIVE = "native"
    GATHER_FOLD = "gather_fold"
    A2A_FOLD = "a2a_fold"
    RS_AG_FOLD = "rs_ag_fold"
    IPC_FOLD = "ipc_fold"


@dataclass(frozen=True)
class RouteInfo:
    """What a route moves and whether its floating-point SUM is the canonical fold."""

    moves: str
    canonical_sum: bool


ROUTE_INFO: Mapping[Route, RouteInfo] = {
    Route.NATIVE: RouteInfo("the library's collective (NCCL on GPU, gloo on CPU)", canonical_sum=False),
    Route.GATHER_FOLD: RouteInfo("all-gather of the W inputs, canonical fold locally", canonical_sum=True),
    Route.A2A_FOLD: RouteInfo("all-to-all of the shards, canonical fold of each shard", canonical_sum=True),
    Route.RS_AG_FOLD: RouteInfo("all-to-all of column blocks, canonical fold of each, all-gather of the rounded "
                                "blocks", canonical_sum=True),
    Route.IPC_FOLD: RouteInfo("CUDA-IPC workspace, one-store, one-shot or two-shot fold kernels", canonical_sum=True),
}

# Which routes can carry which collective at all (before envelope and capabilities).
_CARRIES: Mapping[Route, frozenset[Collective]] = {
    Route.NATIVE: frozenset(Collective),
    Route.GATHER_FOLD: frozenset({Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE_RMSNORM}),
    Route.A2A_FOLD: frozenset({Collective.REDUCE_SCATTER}),
    Route.RS_AG_FOLD: frozenset({Collective.ALL_REDUCE, Collective.ALL_REDUCE_RMSNORM}),
    Route.IPC_FOLD: frozenset({Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER,
                               Collective.ALL_REDUCE_RMSNORM}),
}


# Virtual-shard sites (docs/spec.md §9.1): the collectives and routes that carry them. gather_fold all-gathers
# the fp32 partials; a2a_fold exchanges column blocks (all-reduce) or row blocks (reduce-scatter) of them; the
# native route (outside bitwise envelopes, forced only) sums each rank's pre-folded partials in the library.
# An all_reduce_rmsnorm site's all-reduce may be virtual too (docs/spec.md §9.2 "Tree sites"): the layer boundary
# of a TP-size-invariant layout, its sum that virtual all-reduce, then the canonical residual add + RMSNorm.
VIRTUAL_SHARD_COLLECTIVES = frozenset({Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE_RMSNORM})
_VIRTUAL_ROUTES = frozenset({Route.GATHER_FOLD, Route.A2A_FOLD, Route.NATIVE, Route.IPC_FOLD})


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
        route: a forced route, or None for Router's choice.
        implicit: declared from a first call rather than by ``detcomm.site``.
        virtual_shards: V for a virtual-shard site (docs/spec.md §9.1): every call passes this rank's V/W fp32
            partial sums and the result is the canonical fold over the V shards, the same bits for every W that
            divides V. None: the plain fold over the W ranks.
        shard_fold: how a virtual-shard site combines its V partials: "order" (the fold over shards 0..V-1, every
            W dividing V) or "tree" (the fixed balanced binary tree of docs/spec.md §9.1 "The tree order": V a
            power of two, W a power of two dividing V; one fp32 partial per rank on the wire).
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
    virtual_shards: int | None = None
    shard_fold: str = "order"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"a site's name is a str, got {type(self.name).__name__}")
        if not self.name:
            raise ValueError("a site needs a non-empty name")
        if not dtypes.is_supported(self.dtype):
            raise ValueError(
                f"site {self.name!r}: dtype {self.dtype} is not supported; use one of "
                f"{['torch.' + n for n in dtypes.NAMES]}"
            )
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in self.shape):
            raise TypeError(f"site {self.name!r}: shape must be a tuple of ints (one row's trailing shape), got {self.shape!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"site {self.name!r}: shape must be non-negative, got {self.shape!r}")
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int):
            raise TypeError(f"site {self.name!r}: max_rows must be an int, got {type(self.max_rows).__name__}")
        if self.max_rows < 1:
            raise ValueError(f"site {self.name!r}: max_rows must be >= 1, got {self.max_rows}")
        if self.collective is Collective.ARGMAX:
            if not dtypes.is_float(self.dtype):
                raise ValueError(f"site {self.name!r}: argmax takes floating-point logits, got {self.dtype}")
            if len(self.shape) != 1:
                raise ValueError(f"site {self.name!r}: argmax rows are vocabulary shards, shape (V_shard,), got {self.shape}")
            if self.op is not ReduceOp.MAX:
                raise ValueError(f"site {self.name!r}: argmax is a MAX reduction; op={self.op.value!r} makes no sense")
        elif not self.collective.reduces and self.op is not ReduceOp.SUM:
            raise ValueError(f"site {self.name!r}: {self.collective.value} moves data and takes no reduce op")
        if self.op is ReduceOp.AVG and not dtypes.is_float(self.dtype):
            raise ValueError(f"site {self.name!r}: op='avg' takes floating-point inputs (an integer average "
                             f"rounds); use op='sum' and divide, got {self.dtype}")
        if self.shard_fold not in SHARD_FOLDS:
            raise ValueError(f"site {self.name!r}: shard_fold must be one of {list(SHARD_FOLDS)}, got "
                             f"{self.shard_fold!r}")
        if self.virtual_shards is not None:
            self._check_virtual_shards()
        elif self.shard_fold != "order":
            raise ValueError(f"site {self.name!r}: shard_fold={self.shard_fold!r} orders the sum of virtual shards; "
                             "declare virtual_shards=V too (e.g. 8), or drop shard_fold")
        elif self.route is not None and self.collective not in _CARRIES[self.route]:
            raise ValueError(
                f"site {self.name!r}: route {self.route.value!r} cannot carry {self.collective.value}; routes that "
                f"can: {sorted(r.value for r, c in _CARRIES.items() if self.collective in c)}"
            )

    def _check_virtual_shards(self) -> None:
        """What a virtual-shard site can be, checked without a group (W is checked by routing)."""
        v = self.virtual_shards
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"site {self.name!r}: virtual_shards must be an int (the number of fixed shards of the "
                            f"reduction dimension, e.g. 8), got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"site {self.name!r}: virtual_shards must be >= 1, got {v}; choose V a multiple of "
                             "every TP size you will run, e.g. 8")
        if self.collective not in VIRTUAL_SHARD_COLLECTIVES:
            raise ValueError(f"site {self.name!r}: virtual_shards applies to all_reduce, reduce_scatter and "
                             f"all_reduce_rmsnorm sites, not {self.collective.value}; declare the site without "
                             "virtual_shards")
        if not dtypes.is_float(self.dtype):
            raise ValueError(f"site {self.name!r}: virtual_shards folds fp32 partial sums into a float dtype "
                             f"(bfloat16, float16, float32), got {self.dtype}; integer sums are exact in any order, "
                             "declare the site without virtual_shards")
        if self.op is not ReduceOp.SUM:
            raise ValueError(f"site {self.name!r}: virtual_shards sums (op='sum'), got op={self.op.value!r}; an "
                             "average or an extreme of partial sums is not a layer's output: declare op='sum' (divide "
                             "afterwards for a mean), or drop virtual_shards")
        if self.shard_fold == "tree" and v & (v - 1):
            raise ValueError(f"site {self.name!r}: shard_fold='tree' is a balanced binary tree over the V shards, so "
                             f"V must be a power of two, got virtual_shards={v}; choose e.g. 8, or "
                             "shard_fold='order' (any V)")
        if self.route is not None and self.route not in _VIRTUAL_ROUTES:
            raise ValueError(f"site {self.name!r}: route {self.route.value!r} cannot carry a virtual-shard site"
                             f"; routes that can: {sorted(r.value for r in _VIRTUAL_ROUTES)}")
        if self.route is Route.IPC_FOLD and self.collective is Collective.REDUCE_SCATTER:
            raise ValueError(f"site {self.name!r}: route 'ipc_fold' folds the virtual shards of all-reduces (of "
                             "all_reduce sites only, and of all_reduce_rmsnorm sites): the workspace has no "
                             "virtual-shard reduce-scatter; drop route= (a2a_fold carries it)")

    @property
    def layout(self) -> Layout:
        """How the site's partials lie over the ranks and combine (detcomm/layout.py): what every layer asks."""
        return Layout.of(self.virtual_shards, self.shard_fold)

    @property
    def is_float(self) -> bool:
        return dtypes.is_float(self.dtype)

    @property
    def float_sum(self) -> bool:
        return self.collective.reduces and self.op.sums and self.is_float

    @property
    def row_numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        dt = name_of(self.dtype)
        op = f" {self.op.value}" if self.collective.reduces else ""
        rows = f"[rows<={self.max_rows}, {', '.join(map(str, self.shape))}]"
        return f"{self.collective.value}{op} {dt}{rows}{self.layout.spelled()}"



@dataclass(frozen=True)
class Capabilities:
    """Static facts about a group, found once at startup and identical on every rank."""

    backend: str
    device_type: str
    world_size: int
    workspace: bool = False
    workspace_reason: str = "no CUDA-IPC workspace on this group"
    workspace_max_rows: int = 0
    workspace_bytes: int = 0
    topology: str = ""
    hosts: int = 1  # distinct hosts the group's ranks run on (topology.py; DETCOMM_HOSTS simulates several)



class CallArgs(NamedTuple):
    """The per-call arguments a collective needs beyond its tensor (validated by the communicator). A named
    tuple: one is built on every call that passes ``out=``, and a tuple is the cheapest immutable record."""

    rows_per_rank: tuple[int, ...] | None = None  # token_all_gather
    in_splits: tuple[int, ...] | None = None  # all_to_all
    out_splits: tuple[int, ...] | None = None  # all_to_all
    vocab_start: int = 0  # argmax
    # all_reduce / reduce_scatter / all_gather: a caller's buffer the route may write the result into (the input
    # itself only where the binding's ``in_place`` says so); routes may ignore it, and the communicator copies.
    out: torch.Tensor | None = None


NO_ARGS = CallArgs()


@runtime_checkable
class BoundRoute(Protocol):
    """A site bound to one route: what the communicator calls for every call of that site.

    Calling it is collective over the site's group. Every route implementation returns one from ``bind``.
    """

    @property
    def route(self) -> Route: ...

    @property
    def site(self) -> Site: ...

    @property
    def in_place(self) -> bool:
        """Whether the route may be handed the input itself as ``CallArgs.out`` (it reads every input element
        before it writes that element of the result); otherwise an in-place call costs the communicator a copy."""
        ...

    def __call__(self, x: torch.Tensor, args: CallArgs) -> torch.Tensor: ...


class RouteImpl(Protocol):
    """One route's implementation on one group (detcomm/route_impls/, one file each)."""

    route: Route

    def bind(self, site: Site) -> BoundRoute:
        """The callable serving ``site`` (its collective and op resolved once, here, not per call)."""
        ...

