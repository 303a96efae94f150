"""Workspaces for the tests and the bench, never for serving: other kernel builds, and the record of the code paths
a workspace ran. Nothing in the runtime imports this module; a workspace the runtime arms is the canonical build
and records nothing.

- ``workspace_class(build, *, record=False)``: a Workspace subclass whose ``create`` (COLLECTIVE) and
  ``in_process`` load the kernel build ``build`` (kernels.BUILD_DEFINES: the negative controls "rotated",
  "stale_flags", "single_copy", "uncounted_skip", "one_buffer", "unmarked", which a test must catch; the bench's "fused_batch4" and
  "fused_no_wide", which give the canonical bits at another speed) and, with ``record``, start with an empty
  ``variants_run``.
- ``record(*workspaces)``: LOCAL. Start recording on workspaces that exist (for example the one a communicator
  armed): each gets a fresh empty ``variants_run`` of (collective, dtype, code path) and keeps adding to it.
"""

from __future__ import annotations

import functools
from typing import Any

from . import kernels
from .workspace import Workspace

__all__ = ["workspace_class", "record"]


@functools.cache  # one class per (build, record): a build's kernels are loaded once per process anyway
def workspace_class(build: str = "canonical", *, record: bool = False) -> type[Workspace]:
    """A Workspace subclass serving with the kernel build `build` and, with `record`, recording its code paths
    (``variants_run``). Raises ValueError for an unknown build."""
    kernels.check_build(build)
    namespace: dict[str, Any] = {"_kernel_build": build, "__module__": __name__}
    if record:
        def __init__(self: Workspace, **kw: Any) -> None:
            Workspace.__init__(self, **kw)
            _record(self)

        namespace["__init__"] = __init__
    return type(f"Workspace_{build}{'_recorded' if record else ''}", (Workspace,), namespace)


def record(*workspaces: Workspace) -> None:
    """Start (or restart) recording the code paths of each workspace: ``ws.variants_run`` becomes an empty set that
    every later launch adds its (collective, dtype, path) to (the workspace's path hook, which only this module
    sets). Not collective."""
    for ws in workspaces:
        ws.variants_run = set()
        ws._record_path = ws.variants_run.add


_record = record
