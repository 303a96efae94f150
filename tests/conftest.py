"""Shared test machinery: the `gpu` marker's skip, and local gloo clusters reused across tests.

A cluster is W spawned processes joined in one default process group (detcomm._spawn.LocalCluster). Tests
send it jobs: top-level functions of the test modules, called on every rank as fn(rank, world_size, *args).
Each job calls detcomm.init and detcomm.shutdown itself, so jobs do not leak state into each other. A job
that leaves the cluster unusable (a rank stuck or dead) tears it down; the next test gets a fresh one.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from clusters import close_clusters, get_cluster  # noqa: E402
from detcomm._spawn import LocalCluster  # noqa: E402

# tests/torch_suite/ is torch's own suite, run by .ci/torch_suite.sh under its own runner, not collected here.
collect_ignore_glob = ["torch_suite/*"]


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the accelerator machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[2, 3, 4], ids=lambda w: f"W{w}")
def cluster(request) -> LocalCluster:  # noqa: ANN001
    return get_cluster(request.param)


@pytest.fixture
def cluster2() -> LocalCluster:
    """W = 2 only."""
    return get_cluster(2)


@pytest.fixture
def cluster4() -> LocalCluster:
    """W = 4 only (the collective probe's width)."""
    return get_cluster(4)


@pytest.fixture(params=[3, 4], ids=lambda w: f"W{w}")
def cluster3plus(request) -> LocalCluster:  # noqa: ANN001
    """W >= 3 only: at W = 2 every order of two addends gives the same sum (a + b == b + a)."""
    return get_cluster(request.param)


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001
    close_clusters()
