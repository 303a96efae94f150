"""Which sites the CUDA-IPC workspace (the ``ipc_fold`` route) serves, and why or why not: the workspace's answer
to the router, from a site's static facts and the group's capabilities only, never from a call's rows.

``detcomm.route.Router`` asks ``admit`` for every canonical-fold site and writes the answer into the route
table; ``detcomm.route_impls.ipc_fold`` binds what it admitted. The rules, each owned here because the workspace's
kernels and plan are what they describe:

- armed: the workspace exists on the group, and ``force_deterministic_rsag`` does not exclude symmetric memory;
- rows: ``max_rows`` within the armed rows; an all-reduce site above them still takes the workspace when one row
  fits one launch (``workspace_bytes``), chunked with the same bits; a reduce-scatter site above them does not;
- avg: the kernels round to the dtype, and avg needs the fp32 fold;
- virtual shards (the site's layout, detcomm/layout.py): all-reduce sites (and all_reduce_rmsnorm sites'
  all-reduce) only, where the fp32 row a rank sends fits one launch (its V/W slabs in the shard order; one root in
  the tree, whose V over this W the tree kernels must fold too: ``plan.tree_refusal``);
- fusion (``all_reduce_rmsnorm``): a fused kernel served for the site's all-reduce (the plain fold and the tree
  order; none for the shard order) and rows the fused kernels hold in registers
  (``plan.fused_norm_refusal``); what the numerics allow is ``detcomm.numerics.norm.fusion_refusal``'s part of
  the rule.

docs/performance.md holds the measurements behind the rows and fusion rules. Torch-free: ``detcomm routes``
decides without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import dtypes
from ..envelope import Resolved
from ..layout import Kind
from . import plan

if TYPE_CHECKING:
    from ..sites import Capabilities, Site

__all__ = ["Admission", "unavailable", "admit", "fused_layout_refusal"]

# The collectives whose sites above the armed rows stay on the workspace, chunked (by value: the router's enum is a
# str enum, and this layer sits below the router).
_CHUNKS_ABOVE_ARMED = frozenset({"all_reduce", "all_reduce_rmsnorm"})
# The collectives whose virtual-shard sites the workspace folds: all-reduce, and the all-reduce of an
# all_reduce_rmsnorm site (then the composition; fused_layout_refusal says why not fused).
_VIRTUAL_COLLECTIVES = frozenset({"all_reduce", "all_reduce_rmsnorm"})


@dataclass(frozen=True)
class Admission:
    """The workspace's answer for one site: ``serves``, and ``why`` it does (the route table's reason) or not (the
    reason the fallback route's entry quotes)."""

    serves: bool
    why: str


def unavailable(caps: Capabilities, resolved: Resolved) -> str | None:
    """Why no site of this group can take the workspace (None: it is armed and allowed)."""
    if resolved.switches.force_deterministic_rsag:
        return "force_deterministic_rsag: no symmetric-memory path"
    if not caps.workspace:
        return caps.workspace_reason
    return None


def admit(site: Site, caps: Capabilities, resolved: Resolved) -> Admission:
    """Whether the workspace serves ``site`` (a floating-point SUM or AVG site of a batch-invariant envelope, or a
    virtual-shard all-reduce site) on a group with ``caps``, and why or why not."""
    if site.layout.virtual and site.collective.value not in _VIRTUAL_COLLECTIVES:
        return Admission(False, "the workspace kernels fold virtual shards for all-reduce only")
    no = unavailable(caps, resolved)
    if no is not None:
        return Admission(False, no)
    if site.layout.virtual:
        return _admit_virtual(site, caps)
    if site.max_rows > caps.workspace_max_rows and not _chunks_above_armed(site, caps):
        return Admission(False, f"max_rows {site.max_rows} > workspace's armed {caps.workspace_max_rows} rows")
    if site.op.value == "avg":
        return Admission(False, "the workspace kernels round to the dtype; avg needs the fp32 fold")
    if site.max_rows > caps.workspace_max_rows:
        why = (f"canonical fold in the CUDA-IPC workspace, chunked: max_rows above the armed "
               f"{caps.workspace_max_rows} rows, and an all-reduce row fits one launch")
    else:
        why = f"canonical fold in the CUDA-IPC workspace (max_rows <= {caps.workspace_max_rows})"
    launches = _launches(site.max_rows * site.row_numel * dtypes.size_of(site.dtype), caps.workspace_bytes)
    if launches > 1:
        why += f"; {launches} launches per call at max_rows (workspace_bytes={caps.workspace_bytes})"
    return Admission(True, why)


def fused_layout_refusal(site: Site, world_size: int) -> str | None:
    """The workspace's part of whether an all_reduce_rmsnorm site fuses: None where a fused kernel serves its
    all-reduce (the plain fold and the tree order, csrc/fused_rmsnorm.cu; it has no shard-order variant) and holds
    its rows in registers at ``world_size`` (plan.fused_norm_refusal: the tree variants read fp32 slot rows but hold
    the site's dtype in registers, as the plain ones do)."""
    if site.layout.kind is Kind.ORDER:
        return ("no fused kernel folds the shard order, only the plain fold and the tree: the workspace's virtual "
                "all-reduce, then the canonical add + RMSNorm")
    return plan.fused_norm_refusal(site.shape[0], dtypes.name_of(site.dtype), world_size)


def _chunks_above_armed(site: Site, caps: Capabilities) -> bool:
    """An all-reduce site whose max_rows exceeds the armed rows takes the workspace when one row fits a launch."""
    if site.collective.value not in _CHUNKS_ABOVE_ARMED or caps.workspace_bytes <= 0:
        return False
    return site.row_numel * dtypes.size_of(site.dtype) <= caps.workspace_bytes


def _launches(nbytes: int, launch_bytes: int) -> int:
    """Launches a call of ``nbytes`` takes when each carries ``launch_bytes`` (rows beyond them are chunked)."""
    return 1 if launch_bytes <= 0 else max(1, -(-nbytes // launch_bytes))


# Per virtual layout: the kernels' own limit on (V, W) beyond the layout's (plan.tree_refusal), what one rank
# publishes per row in words (the refusal's), and what the kernels do (the route table's reason, from V/W and V).
_VIRTUAL_KERNELS: dict[Kind, tuple[Callable[[int, int], str | None] | None, Callable[[int, int], str],
                                   Callable[[int, int], str]]] = {
    Kind.ORDER: (None, lambda k, row: f"one row's V/W={k} fp32 slabs ({row} bytes) exceed",
                 lambda k, v: (f"the CUDA-IPC workspace kernels fold the V/W={k} fp32 slabs of every rank in global "
                               f"shard order ({v} virtual shards), one rounding")),
    Kind.TREE: (plan.tree_refusal, lambda k, row: f"one fp32 row ({row} bytes) exceeds",
                lambda k, v: (f"the CUDA-IPC workspace's tree kernels: each rank folds its V/W={k} fp32 shards as a "
                              f"subtree and publishes one fp32 row, the top levels after the exchange ({v} virtual "
                              "shards, shard_fold='tree'), one rounding")),
}


def _admit_virtual(site: Site, caps: Capabilities) -> Admission:
    """A virtual-shard all-reduce site (docs/spec.md §9.1; csrc/virtual_fold.cu for the shard order, tree_fold.cu for
    the tree): where the kernels fold V over this W and the fp32 row a rank publishes (the layout's V/W slabs in the
    shard order; in the tree the root of its subtree, folded in the kernel that publishes it) fits one launch; more
    rows than a launch holds are chunked (the fold is element-wise: the same bits)."""
    layout = site.layout
    assert layout.shards is not None
    limit, published, does = _VIRTUAL_KERNELS[layout.kind]
    no = limit(layout.shards, caps.world_size) if limit is not None else None
    if no is not None:
        return Admission(False, no)
    k = layout.per_rank(caps.world_size)
    row = layout.sent(caps.world_size) * site.row_numel * plan.F32_BYTES
    if row > caps.workspace_bytes:
        return Admission(False, f"{published(k, row)} a workspace launch (workspace_bytes={caps.workspace_bytes})")
    why = does(k, layout.shards)
    if site.max_rows > caps.workspace_max_rows:
        why += f"; chunked above the armed {caps.workspace_max_rows} rows"
    launches = -(-site.max_rows // (caps.workspace_bytes // row))
    if launches > 1:
        why += f"; {launches} launches per call at max_rows (workspace_bytes={caps.workspace_bytes})"
    return Admission(True, why)
