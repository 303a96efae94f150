"""Static call-site routing (docs/spec.md sections 2 and 3): the one place where a site gets its route.

A call site is a static declaration (name, collective, reduce op, dtype, trailing shape, group, the most rows
it will ever carry). ``Router.route(site)`` is the only function the runtime calls to resolve a site: it
ranks the acceptable routes from the site's static properties, the resolved numerics envelope and the group's
capabilities found at startup (``candidates``), runs the startup self-check of each candidate that claims
exact bits, remembers refusals (a route that failed a check for a collective serves that collective for no
dtype or shape; a check that failed for the site's own size, an allocation, refuses that site only), falls back only to another route with the same claim, and returns a ``BoundRoute`` that the
communicator calls. It has no tensor argument and never sees a row count, so a site cannot change route with
the batch. Inside a canonical-fold route the row count may still pick the kernel (one-store, one-shot, two-shot,
chunked): every kernel produces the canonical fold's bits.

``decide(site)`` is the same policy without self-checks: ``detcomm routes`` prints it for a group that does not
exist yet, and ``table()`` builds both that static table and the live ``detcomm.routes()``.

The words it decides in (Site, Route, Capabilities, the BoundRoute / RouteImpl protocol) are
detcomm/sites.py's, a layer below: the routes, the workspace's admission and the numerics read them from there.
A site's layout (plain, shard order or tree over V: detcomm/layout.py) says which W it serves and what the routes
move; the router asks it, so one candidate list serves every virtual layout.

Rejected: routing from the message size (the route would change with the batch: exactly the bug this package
exists to prevent); a separate "fallback" layer in the communicator (it made four places decide routes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from . import dtypes
from .dtypes import name_of
from .envelope import Resolved
from .errors import RouteRefused
from .layout import Kind
from .sites import ROUTE_INFO, BoundRoute, Capabilities, Collective, ReduceOp, Route, RouteImpl, Site
from .tables import format_table
from .workspace import admission

__all__ = ["RouteDecision", "Verdict", "RouteEntry", "RouteTable", "Router", "fusion_refusal"]


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    why: str

    @property
    def canonical_sum(self) -> bool:
        return ROUTE_INFO[self.route].canonical_sum


class Verdict(Protocol):
    """What routing reads from a self-check's outcome (selfcheck.CheckResult provides it)."""

    @property
    def passed(self) -> bool: ...

    @property
    def reason(self) -> str: ...

    @property
    def label(self) -> str: ...

    @property
    def site_only(self) -> bool: ...  # the failure was this site's own size or resources (selfcheck.CheckResult)


@dataclass(frozen=True)
class RouteEntry:
    """One row of the route table."""

    site: Site
    decision: RouteDecision
    selfcheck: str  # "passed", "FAILED", "-" (no claim to check, or checks off), "static" (no live group)

    def as_dict(self) -> dict[str, object]:
        s = self.site
        return {
            "site": s.name,
            "collective": s.collective.value,
            "op": s.op.value if s.collective.reduces or s.collective is Collective.ARGMAX else "",
            "dtype": name_of(s.dtype),
            "shape": list(s.shape),
            "max_rows": s.max_rows,
            "route": self.decision.route.value,
            "why": self.decision.why,
            "selfcheck": self.selfcheck,
            "virtual_shards": s.virtual_shards,
            "shard_fold": None if s.virtual_shards is None else s.shard_fold,
        }


@dataclass(frozen=True)
class RouteTable:
    """The route decisions of a group's sites, printable (``str``) and identical on every rank."""

    numerics: str
    backend: str
    world_size: int
    leaf: str
    entries: tuple[RouteEntry, ...]
    note: str = ""

    def as_dicts(self) -> list[dict[str, object]]:
        return [e.as_dict() for e in self.entries]

    def __str__(self) -> str:
        cols: tuple[str, ...] = ("site", "collective", "op", "dtype", "shape", "max_rows", "route", "selfcheck", "why")
        if any(e.site.virtual_shards is not None for e in self.entries):  # the column only where a site has them
            cols = (*cols[:5], "virtual_shards", *cols[5:])
        rows = [["x".join(map(str, d[c])) if c == "shape" else ("-" if d[c] is None else _cell(d, c))  # type: ignore[call-overload]
                 for c in cols] for d in self.as_dicts()]
        head = f"detcomm routes: numerics={self.numerics} backend={self.backend} W={self.world_size} fold leaf={self.leaf}"
        if self.note:
            head += "\n" + self.note
        return format_table(cols, rows, title=head, align="l" * len(cols)) + ("" if rows else "\n(no sites declared)")


def _cell(d: Mapping[str, object], col: str) -> str:
    """A route table cell; a tree site's virtual_shards reads "V tree" (the shard order is the unmarked default)."""
    if col == "virtual_shards" and d.get("shard_fold") == "tree":
        return f"{d[col]} tree"
    return str(d[col])


_log = logging.getLogger("detcomm")


def fusion_refusal(resolved: Resolved, site: Site, *, world_size: int) -> str | None:
    """Why an all_reduce_rmsnorm ``site`` on a group of ``world_size`` ranks takes the composition rather than the
    workspace's fused kernel (None: it may fuse, and still serves only after passing the self-checks). Two owners'
    rules: what the numerics allow (detcomm.numerics.norm.fusion_refusal) and the rows the fused kernels hold
    (detcomm.workspace.admission). The router and the workspace route both ask this, so the route table and the
    call agree."""
    from .numerics.norm import fusion_refusal as numerics_refusal  # noqa: PLC0415 (norm loads torch; routing imports none)

    return numerics_refusal(resolved, site) or admission.fused_layout_refusal(site, world_size)


# rs_ag_fold against gather_fold (the route table's reason). Per rank, gather_fold receives (W-1)·M in one
# collective and rs_ag_fold 2(W-1)/W·M in two; with a collective's fixed cost a and a link rate B per rank,
# rs_ag_fold is the faster when (W-1)(W-2)/W · M/B > a, that is M > a·B·W/((W-1)(W-2)). a·B, the bytes a
# rank's link moves in one collective's fixed cost: a = 20 us (an eager NCCL all-reduce of 16 KiB, 2x H200,
# docs/performance.md) at 275 GB/s (NVLink per GPU, measured at W = 2) on one host, and at 50 GB/s (one
# 400 Gb/s NIC per GPU, an assumption: docs/multinode.md) across hosts.
RS_AG_LINK_BYTES_ONE_HOST = 5_500_000
RS_AG_LINK_BYTES_HOSTS = 1_000_000


class Router:
    """Maps sites to routes from static facts only (the site, the envelope, the group's capabilities).

    ``candidates(site)``: the acceptable routes in preference order (pure policy). ``decide(site)``: the first
    candidate (the static view: no group needed). ``route(site)``: the runtime's resolution, with self-checks,
    refusal memory and fallback, cached per site; needs ``impls`` (and ``checker`` when checks are on).
    """

    def __init__(
        self,
        resolved: Resolved,
        caps: Capabilities,
        *,
        impls: Mapping[Route, RouteImpl] | None = None,
        checker: Callable[[BoundRoute], Verdict] | None = None,
        leaf: str = "-",
    ) -> None:
        self.resolved = resolved
        self.caps = caps
        self.leaf = leaf
        self._impls = dict(impls or {})
        self._checker = checker
        self._bound: dict[Site, tuple[BoundRoute, RouteDecision, str]] = {}
        # (route, collective, op, the site's layout kind) -> why it was refused: a route that failed a check serves
        # that collective for no dtype or shape on this group (each layout runs other code on the route).
        self._refused: dict[tuple[Route, Collective, ReduceOp, Kind], str] = {}

    # -- the static policy -------------------------------------------------------------------------------------
    def decide(self, site: Site) -> RouteDecision:
        """The route ``site`` gets before any self-check (what ``detcomm routes`` shows without a group)."""
        return self.candidates(site)[0]

    def candidates(self, site: Site) -> list[RouteDecision]:
        sw = self.resolved.switches
        if site.layout.virtual:
            return self._with_norm(site, self._virtual_candidates(site))
        if site.route is not None:
            return [self._forced(site)]
        if site.collective in (Collective.ALL_GATHER, Collective.TOKEN_ALL_GATHER):
            why = "data movement" + (" (force_deterministic_rsag)" if sw.force_deterministic_rsag else "")
            return [RouteDecision(Route.NATIVE, why)]
        if site.collective is Collective.ALL_TO_ALL:
            return [RouteDecision(Route.NATIVE, "data movement")]
        if site.collective is Collective.ARGMAX:
            return [RouteDecision(Route.NATIVE, "int64 (value key, index) MAX: exact in any order, lowest index on ties")]
        if not site.op.sums:
            return [RouteDecision(Route.NATIVE, f"{site.op.value.upper()} on order-preserving int keys: exact in any order, ±0 and NaN canonical")]
        if not site.is_float:
            return [RouteDecision(Route.NATIVE, "integer SUM: exact in any order")]
        if not sw.batch_invariant_collectives:
            return [RouteDecision(Route.NATIVE, f"numerics={self.resolved.numerics}: the library's reduction (run-stable, not batch-invariant)")]
        return self._fold_candidates(site)

    def _fold_candidates(self, site: Site) -> list[RouteDecision]:
        """A floating-point SUM or AVG site under a batch-invariant envelope: the workspace where it admits the site
        (detcomm.workspace.admission), then rs_ag_fold where its rule takes the site, then the fold after an
        all-gather (a2a_fold for reduce-scatter); the fallbacks' reasons quote the workspace's refusal."""
        ws = admission.admit(site, self.caps, self.resolved)
        no_ws = "ipc_fold refused" if ws.serves else ws.why
        out = [RouteDecision(Route.IPC_FOLD, ws.why)] if ws.serves else []
        if site.collective is Collective.REDUCE_SCATTER:
            out.append(RouteDecision(Route.A2A_FOLD, f"canonical fold after an all-to-all ({no_ws})"))
        else:
            no_rsag = self._rs_ag_refusal(site)
            if no_rsag is None:
                out.append(RouteDecision(Route.RS_AG_FOLD, f"{self._rs_ag_why(site)} ({no_ws})"))
                no_rsag = "rs_ag_fold refused"
            out.append(RouteDecision(Route.GATHER_FOLD, f"canonical fold after an all-gather ({no_ws}; {no_rsag})"))
        return self._with_norm(site, out)

    def _with_norm(self, site: Site, out: list[RouteDecision]) -> list[RouteDecision]:
        """An all_reduce_rmsnorm site's candidates are its all-reduce's (plain or virtual), each reason completed:
        the workspace fuses the all-reduce with the residual add + RMSNorm where fusion is allowed (``fusion_refusal``,
        asked only where ipc_fold is a candidate); every other route runs the site's all-reduce, then the canonical
        add + RMSNorm (the same bits). Other sites' candidates pass through."""
        if site.collective is not Collective.ALL_REDUCE_RMSNORM:
            return out
        no_fuse = (fusion_refusal(self.resolved, site, world_size=self.caps.world_size)
                   if any(d.route is Route.IPC_FOLD for d in out) else None)
        return [RouteDecision(d.route, d.why + self._norm_clause(d.route, no_fuse)) for d in out]

    @staticmethod
    def _norm_clause(route: Route, no_fuse: str | None) -> str:
        """What an all_reduce_rmsnorm site's reason adds to its all-reduce's: fused, or the composition (and why)."""
        if route is not Route.IPC_FOLD:
            return "; then the canonical residual add + RMSNorm (composition)"
        if no_fuse is None:
            return ("; fused with the residual add + RMSNorm in one kernel (batch_invariant, self-checked against the "
                    "composition)")
        return f"; then the canonical residual add + RMSNorm (composition: {no_fuse})"

    # -- rs_ag_fold against gather_fold where no workspace serves the site (a self-contained rule) -------------
    def _rs_ag_break_even(self) -> int:
        """The site bytes (max_rows x one row) from which rs_ag_fold beats gather_fold on this group (the cost model
        beside RS_AG_LINK_BYTES_ONE_HOST)."""
        w = self.caps.world_size
        link = RS_AG_LINK_BYTES_HOSTS if self.caps.hosts > 1 else RS_AG_LINK_BYTES_ONE_HOST
        return -(-link * w // ((w - 1) * (w - 2)))

    def _rs_ag_link(self) -> str:
        return f"{self.caps.hosts} hosts" if self.caps.hosts > 1 else "one host"

    def _rs_ag_refusal(self, site: Site) -> str | None:
        """Why an all-reduce site without the workspace keeps gather_fold rather than rs_ag_fold (None: it takes
        rs_ag_fold). Static: W, whether the group spans hosts, and the site's bytes at max_rows."""
        w = self.caps.world_size
        if w < 3:
            return (f"W={w}: rs_ag_fold would receive as many bytes as gather_fold (2(W-1)/W = W-1) in two "
                    "collectives instead of one")
        nbytes = site.max_rows * site.row_numel * dtypes.size_of(site.dtype)
        need = self._rs_ag_break_even()
        if nbytes < need:
            return (f"{nbytes} B at max_rows, below rs_ag_fold's break-even {need} B (W={w}, {self._rs_ag_link()}; "
                    "docs/spec.md §3)")
        return None

    def _rs_ag_why(self, site: Site) -> str:
        w = self.caps.world_size
        nbytes = site.max_rows * site.row_numel * dtypes.size_of(site.dtype)
        return (f"all-to-all of column blocks, canonical fold, all-gather of the rounded blocks: "
                f"{2 * (w - 1) / w:.2f}x the message per rank, gather_fold {w - 1}x; {nbytes} B at max_rows >= "
                f"break-even {self._rs_ag_break_even()} B (W={w}, {self._rs_ag_link()}; docs/spec.md §3)")

    def _virtual_candidates(self, site: Site) -> list[RouteDecision]:
        """A virtual-shard site (docs/spec.md §9.1; its layout, detcomm/layout.py, says what each rank holds and
        how the routes move and combine it): gather_fold or a2a_fold under every envelope, by a static rule. The
        declaration asks for bits that do not depend on W; under ``auto`` the native route would give other
        numerics without a word, so it serves such a site only when forced (outside bitwise envelopes), as a
        negative control. All-reduce: the workspace where it admits the site (detcomm.workspace.admission), then
        gather_fold (one collective: the decode route), then a2a_fold (column blocks, then an all-gather of the
        rounded blocks: the bandwidth route). Reduce-scatter: a2a_fold's row-block exchange, then gather_fold."""
        layout, w = site.layout, self.caps.world_size
        no_w = layout.world_refusal(w)
        if no_w is not None:
            raise ValueError(f"site {site.name!r}: {no_w}")
        ws = admission.admit(site, self.caps, self.resolved)
        if site.route is not None:
            if site.route is Route.NATIVE and self.resolved.bitwise:
                raise ValueError(
                    f"site {site.name!r}: route='native' sums each rank's pre-folded partials in the library's order "
                    f"(W-dependent, not batch-invariant) and numerics={self.resolved.numerics!r} promises bitwise "
                    "batch invariance; drop route= (gather_fold/a2a_fold fold the V shards) or use numerics='auto'"
                )
            if site.route is Route.IPC_FOLD and not ws.serves:
                raise ValueError(f"site {site.name!r}: route='ipc_fold' is unavailable for {layout.shards} virtual "
                                 f"shards: {ws.why}; drop route= (gather_fold / a2a_fold fold the V shards on any "
                                 "group)")
            return [RouteDecision(site.route, f"forced by the site's route=; {layout.declared()}")]
        held = layout.held(w)
        if site.collective is Collective.REDUCE_SCATTER:
            held += f"; {ws.why}"
            return [RouteDecision(Route.A2A_FOLD, f"{layout.moves('rows')} ({held})"),
                    RouteDecision(Route.GATHER_FOLD, f"{layout.moves('gather')} ({held})")]
        out = [RouteDecision(Route.IPC_FOLD, ws.why)] if ws.serves else []
        held += f"; {'ipc_fold refused' if ws.serves else ws.why}"
        return out + [RouteDecision(Route.GATHER_FOLD, f"{layout.moves('gather')} ({held})"),
                      RouteDecision(Route.A2A_FOLD, f"{layout.moves('columns')} ({held})")]

    def _forced(self, site: Site) -> RouteDecision:
        route = site.route
        assert route is not None
        if site.collective.reduces and not site.op.sums and route is not Route.NATIVE:
            raise ValueError(f"site {site.name!r}: {site.op.value.upper()} reductions run on the native route (order-preserving keys); route={route.value!r} does not apply")
        if site.collective.reduces and not site.is_float and route is not Route.NATIVE:
            raise ValueError(f"site {site.name!r}: integer sums run on the native route; route={route.value!r} does not apply")
        if site.float_sum and self.resolved.bitwise and not ROUTE_INFO[route].canonical_sum:
            raise ValueError(
                f"site {site.name!r}: route={route.value!r} is not batch-invariant and numerics="
                f"{self.resolved.numerics!r} promises bitwise batch invariance; drop route= (the envelope "
                "picks a canonical-fold route) or use numerics='auto'"
            )
        no_ws = admission.unavailable(self.caps, self.resolved) if route is Route.IPC_FOLD else None
        if no_ws is not None:
            raise ValueError(f"site {site.name!r}: route='ipc_fold' is unavailable: {no_ws}")
        return RouteDecision(route, "forced by the site's route=")

    # -- the runtime resolution --------------------------------------------------------------------------------
    @staticmethod
    def claims(decision: RouteDecision, site: Site) -> bool:
        """Whether the route promises exact, batch-invariant bits for this site (and so must be self-checked)."""
        if site.collective is Collective.ARGMAX:
            return True
        if site.collective.reduces and site.is_float:
            return not site.op.sums or decision.canonical_sum
        return False

    def route(self, site: Site) -> BoundRoute:
        """The bound route serving ``site``: the first candidate whose self-check passed (collective when it runs
        a check). Raises RouteRefused, on every rank, when none did."""
        hit = self._bound.get(site)
        if hit is not None:
            return hit[0]
        refused: list[str] = []
        for cand in self.candidates(site):
            kind = (cand.route, site.collective, site.op, site.layout.kind)
            if kind in self._refused:
                refused.append(f"{cand.route.value}: {self._refused[kind]}")
                continue
            impl = self._impls.get(cand.route)
            if impl is None:
                raise AssertionError(f"route {cand.route.value!r} was chosen but has no implementation on this group")
            bound = impl.bind(site)
            check = "-"
            if self._checker is not None and self.claims(cand, site):
                verdict = self._checker(bound)
                if not verdict.passed:
                    why = f"{verdict.label}: {verdict.reason}"
                    if not verdict.site_only:
                        # A wrong bit is the route's: it serves this collective and op for no other site either.
                        self._refused[kind] = why
                    # else the site's own size failed (an allocation): the route still serves every other site.
                    refused.append(f"{cand.route.value}: {why}")
                    _log.warning("detcomm: route %s refused for %s (%s): %s", cand.route.value, site.name,
                                 site.describe(), why)
                    continue
                check = "passed"
            decision = cand
            if getattr(bound, "note", ""):  # what binding learned that the static policy could not (ipc_fold)
                decision = RouteDecision(cand.route, cand.why + bound.note)  # type: ignore[attr-defined]
            if refused:
                decision = RouteDecision(cand.route, decision.why + " [refused: " + " | ".join(refused) + "]")
                _log.warning("detcomm: site %s falls back to %s after refusals (same canonical bits)", site.name,
                             cand.route.value)
            self._bound[site] = (bound, decision, check)
            return bound
        raise RouteRefused(
            f"site {site.name!r} ({site.describe()}): no acceptable route passed its startup self-check under "
            f"numerics={self.resolved.numerics!r}: " + " | ".join(refused)
        )

    def bound_sites(self) -> list[Site]:
        """Every site ``route`` has resolved so far (declared sites and the startup self-check probes)."""
        return list(self._bound)

    def release(self) -> None:
        """Drop the route implementations, the checker and the bound routes (they hold the process group, which must not outlive
        its destruction: gloo's threads abort a process that finalizes one at exit). The decisions stay, so the
        route table still reads as before; nothing can be routed afterwards. Local."""
        self._impls.clear()
        self._checker = None
        self._bound = {s: (cast("BoundRoute", None), d, c) for s, (_, d, c) in self._bound.items()}

    def table(self, sites: Sequence[Site], *, note: str = "") -> RouteTable:
        """The route table of ``sites``: live entries for sites this router has bound, the static decision
        (``selfcheck`` reads "static") for the others. Local; identical on every rank."""
        entries = []
        for s in sites:
            hit = self._bound.get(s)
            if hit is not None:
                entries.append(RouteEntry(s, hit[1], hit[2]))
            else:
                entries.append(RouteEntry(s, self.decide(s), "static"))
        return RouteTable(self.resolved.numerics, self.caps.backend, self.caps.world_size, self.leaf, tuple(entries), note)
