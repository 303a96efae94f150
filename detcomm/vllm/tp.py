"""vLLM's tensor-parallel group as detcomm sees it: one communicator, the sites, and the one call path.

Every TP reduction of a vLLM process reaches ``TPGroup.all_reduce`` (or ``reduce_scatter``), from two callers:

* the plugin's layers (detcomm/vllm/layers.py) call the custom op ``torch.ops.detcomm.vllm_all_reduce(x, site)``
  with the site named after the layer (vLLM's ``prefix``, e.g. ``model.layers.0.self_attn.o_proj``), declared
  when vLLM builds the layer: every rank builds the model in one order, so the sites are declared in one order;
* the TP group's device communicator (detcomm/vllm/communicator.py) for every other caller of vLLM's
  ``tensor_model_parallel_all_reduce`` (a fused-MoE block's output, a model's own call): vLLM hands it a tensor
  and no name, so its site is named after vLLM's group and the tensor's row shape, declared at its first call
  (the ranks issue those calls in one order too, and the first happens in vLLM's warm-up, before any graph
  capture).

A custom op, not a Python call: vLLM compiles the model with torch.compile (Dynamo cannot trace into the
collective, and must not: it would bake one call's shapes in); the op is opaque to it, carries the site's name as
a constant, and runs eagerly inside the compiled graph, the way vLLM's own ``torch.ops.vllm.all_reduce`` does.

``DETCOMM_VLLM_AUDIT=<dir>`` records every TP all-reduce of every rank (site, call number, input, output) in
``<dir>/rank<r>.pkl``, with the plugin (these calls) or without it (vLLM's own communicator: the negative control):
tests/vllm_plugin compares each record with an independent fold of the ranks' inputs.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

import detcomm

from ..dtypes import name_of
from ..sites import Site
from .settings import Settings

__all__ = ["TPGroup", "Audit", "attach", "current", "calls", "all_reduce", "reduce_scatter", "audited_all_reduce",
           "detach", "describe"]

log = logging.getLogger("vllm.detcomm")  # under vLLM's logger: vLLM's handler and level print it

_TP: TPGroup | None = None
_LOCK = threading.Lock()


class Audit:
    """Appends one pickled record per TP all-reduce to ``<dir>/rank<r>.pkl`` (flushed per record: vLLM ends its
    workers with ``os._exit``, so nothing may wait for an exit hook). ``step`` numbers vLLM's forward passes (a new
    forward context is a new pass; None outside one): how many passes a generation takes follows the engine's
    timing (async scheduling may run one more), how many all-reduces a pass issues does not."""

    def __init__(self, directory: str, *, rank: int, world_size: int, path: str, mechanism: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.rank, self.world_size, self.path, self.mechanism = rank, world_size, path, mechanism
        self._file = open(os.path.join(directory, f"rank{rank}.pkl"), "ab")  # noqa: SIM115  (open for the process)
        self._calls: Counter[str] = Counter()
        self._context: object = None  # the last forward context seen, held so that its id cannot be reused
        self._step = -1

    def record(self, site: str, x: torch.Tensor, y: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        k = self._calls[site]
        self._calls[site] += 1
        step = None
        if is_forward_context_available():
            context = get_forward_context()
            if context is not self._context:
                self._context, self._step = context, self._step + 1
            step = self._step
        pickle.dump({"site": site, "call": k, "step": step, "rank": self.rank, "world_size": self.world_size,
                     "path": self.path, "mechanism": self.mechanism,
                     "x": x.detach().to("cpu", copy=True), "y": y.detach().to("cpu", copy=True)}, self._file)
        self._file.flush()


class TPGroup:
    """detcomm's communicator on vLLM's TP group, its sites and their call counts. One per process."""

    def __init__(self, *, group: dist.ProcessGroup, unique_name: str, device: torch.device, settings: Settings,
                 max_rows: int) -> None:
        self.settings = settings
        self.unique_name = unique_name
        self.max_rows = max_rows
        # Collective over the TP group: the envelope and options compared across ranks, the startup self-checks.
        self.comm = detcomm.init(numerics=settings.numerics, group=group, device=device)
        self._agree(group)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.sites: dict[str, Site] = {}
        self.counts: Counter[str] = Counter()
        self.audit = (Audit(settings.audit_dir, rank=self.rank, world_size=self.world_size, path="detcomm",
                            mechanism="detcomm")
                      if settings.audit_dir else None)
        self._shown = False
        log.info("detcomm: TP group %s (W=%d) on %s, envelope %s, layout %s", unique_name, self.world_size,
                 device, settings.numerics, settings.layout)

    def _agree(self, group: dist.ProcessGroup) -> None:
        # detcomm.init compared the envelope; the plugin's own settings (layout, shards) must agree too, or the
        # ranks would build different layers and reduce different shapes.
        mine = sorted(self.settings.fingerprint().items())
        seen: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, mine, group=group)
        if any(s != mine for s in seen):
            raise detcomm.CollectiveMismatch(
                f"the detcomm vLLM plugin's settings differ across the TP group's ranks: {seen}; export the same "
                "DETCOMM_VLLM_* variables for every rank")

    def declare(self, name: str, *, dtype: torch.dtype, shape: tuple[int, ...], collective: str = "all_reduce",
                virtual_shards: int | None = None) -> Site:
        """Declare a site (collective over the TP group: every rank declares its sites in one order)."""
        if name in self.sites:
            raise ValueError(f"site {name!r} is declared twice: two vLLM layers share the prefix {name!r}; give "
                             "them distinct prefixes")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"detcomm: site {name!r} is first reached inside a CUDA graph capture, where its declaration "
                "cannot be exchanged; vLLM's warm-up runs every shape eagerly first, so a call seen only during "
                "capture means a caller detcomm does not know: report it (docs/vllm.md)")
        site = self.comm.site(name, collective=collective, dtype=dtype, shape=shape, max_rows=self.max_rows,
                              virtual_shards=virtual_shards, shard_fold="tree" if virtual_shards else "order")
        self.sites[name] = site
        if self._shown:  # a site declared after the table was shown: show its row
            log.info("detcomm: new site %s", self._row(name))
        return site

    def _row(self, name: str) -> str:
        for line in str(self.comm.routes()).splitlines():
            if name in line:
                return line.strip()
        return name

    def _show(self) -> None:
        self._shown = True
        if self.rank == 0:
            log.info("detcomm route table of vLLM's TP group %s:\n%s", self.unique_name, self.comm.routes())

    def all_reduce(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The one call path of a TP all-reduce: rows are the leading dims (flattened), the site's row shape the
        last; a virtual-shard site takes [V/W, tokens, N] fp32 partials and returns [tokens, N]."""
        if not self._shown:
            self._show()
        site = self.sites[name]
        # A fresh output (``out``): the op declares no mutation, so no route may write into ``x``.
        if site.virtual_shards is not None:
            y = self.comm.all_reduce(x, site=site)
        else:
            rows = x.reshape(-1, *site.shape)
            y = self.comm.all_reduce(rows, site=site, out=torch.empty_like(rows))
        assert isinstance(y, torch.Tensor)  # async_op is never set here
        if site.virtual_shards is None:
            y = y.reshape(x.shape)
        self.counts[name] += 1
        if self.audit is not None:
            self.audit.record(name, x, y)
        return y

    def reduce_scatter(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Rank r receives row block r of the canonical fold of [W * rows, *shape]."""
        site = self.sites[name]
        y = self.comm.reduce_scatter(x, site=site)
        assert isinstance(y, torch.Tensor)
        self.counts[name] += 1
        return y

    def close(self) -> None:
        self.comm.close()


def attach(*, group: dist.ProcessGroup, unique_name: str, device: torch.device, settings: Settings,
           max_rows: int) -> TPGroup:
    """Start detcomm on vLLM's TP group (collective over it). One TP group per process, as vLLM has."""
    global _TP
    with _LOCK:
        if _TP is not None:
            raise RuntimeError(f"detcomm: a second TP group ({unique_name}) in one process; vLLM has one per "
                               f"worker (the first was {_TP.unique_name})")
        _TP = TPGroup(group=group, unique_name=unique_name, device=device, settings=settings, max_rows=max_rows)
        return _TP


def current() -> TPGroup | None:
    """This process's TP group, or None (plugin off, TP = 1, or before vLLM built its groups)."""
    return _TP


def detach() -> None:
    """Close the TP group's communicator (vLLM's ``destroy_model_parallel`` through the device communicator)."""
    global _TP
    with _LOCK:
        if _TP is not None:
            _TP.close()
            _TP = None


def calls() -> dict[str, int]:
    """Calls per site so far in this process."""
    return dict(_TP.counts) if _TP is not None else {}


def _group() -> TPGroup:
    if _TP is None:
        raise RuntimeError("detcomm: a layer called the TP all-reduce but vLLM's TP group has no detcomm "
                           "communicator (the platform plugin did not start one: see docs/vllm.md 'Checking it is on')")
    return _TP


# Catch-all sites (the device communicator's callers) are named "vllm.<group>.<collective>.<dtype>x<shape>" and
# declared by their first call, inside the op, where the tensor is real (never while torch.compile traces).
CATCH_ALL = "vllm."


def _declared(g: TPGroup, site: str, x: torch.Tensor, collective: str) -> str:
    if site not in g.sites:
        if not site.startswith(CATCH_ALL):
            raise RuntimeError(f"detcomm: site {site!r} was never declared (a layer's site is declared when vLLM "
                               "builds the layer)")
        g.declare(site, dtype=x.dtype, shape=tuple(x.shape[1:]), collective=collective)
    return site


@torch.library.custom_op("detcomm::vllm_all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, site: str) -> torch.Tensor:
    """The TP all-reduce of ``x`` at ``site``; opaque to torch.compile, which on vLLM's CPU platform traces into
    the device communicator (``use_custom_op_collectives`` is off there): a collective must not be traced."""
    g = _group()
    return g.all_reduce(x, _declared(g, site, x, "all_reduce"))


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor, site: str) -> torch.Tensor:
    s = _group().sites.get(site)
    if s is not None and s.virtual_shards is not None:  # [V/W, T, N] fp32 partials -> [T, N] in the site's dtype
        return x.new_empty(x.shape[1:], dtype=s.dtype)
    return torch.empty_like(x)


@torch.library.custom_op("detcomm::vllm_reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, site: str) -> torch.Tensor:
    """The TP reduce-scatter of ``x``'s rows at ``site``: rank r receives row block r of the canonical fold."""
    g = _group()
    return g.reduce_scatter(x, _declared(g, site, x, "reduce_scatter"))


@reduce_scatter.register_fake
def _reduce_scatter_fake(x: torch.Tensor, site: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] // _group().world_size, *x.shape[1:]))


# The audit of vLLM's own all-reduce (plugin off): the communicators of the TP groups being audited, by name.
AUDITED: dict[str, Any] = {}


@torch.library.custom_op("detcomm::vllm_audited_all_reduce", mutates_args=())
def audited_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """vLLM's own all-reduce (its arithmetic untouched), recorded: the negative control's path."""
    c = AUDITED[group]
    y = c.vllm_all_reduce(x.clone())  # vLLM's CPU all-reduce works in place; the op must not mutate its input
    c.detcomm_audit.record(f"vllm.{group.split(':')[0]}.all_reduce", x, y)
    return y


@audited_all_reduce.register_fake
def _audited_all_reduce_fake(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def describe(x: torch.Tensor) -> str:
    """A catch-all site's name part for a tensor's row shape: ``float32x4096``."""
    return "x".join([name_of(x.dtype), *map(str, x.shape[1:])]) if x.dim() > 1 else name_of(x.dtype)
