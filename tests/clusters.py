"""Local gloo clusters reused across tests (detcomm._spawn.LocalCluster), one per world size.

A module of its own rather than conftest.py: tests that need a cluster of a given W inside a test body import
`get_cluster` from here, and `from conftest import ...` would find whichever conftest.py (tests/ or tests/gpu/)
pytest imported last.
"""

from __future__ import annotations

from detcomm._spawn import LocalCluster

_CLUSTERS: dict[int, LocalCluster] = {}


def get_cluster(world_size: int) -> LocalCluster:
    """The live cluster of ``world_size`` ranks, started on first use or after a job left it unusable."""
    c = _CLUSTERS.get(world_size)
    if c is None or not c.alive:
        c = _CLUSTERS[world_size] = LocalCluster(world_size, pg_timeout_s=30.0)
    return c


def close_clusters() -> None:
    """Tear every cluster down (the end of the pytest session)."""
    for c in _CLUSTERS.values():
        c.close()
    _CLUSTERS.clear()
