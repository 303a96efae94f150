"""Local multi-process groups for the demo, the tests and the bench (one machine, no launcher).

``LocalCluster(W)`` starts W fresh processes (multiprocessing "spawn": no state inherited from the parent),
joins them into a torch.distributed default group through a FileStore (no ports to race for), and then
runs jobs on all of them: ``cluster.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and
returns the W results in rank order. A job that fails on any rank raises ``RankFailed`` with every failing
rank's traceback; if a rank cannot finish (it is stuck in a collective a failed peer never joined), the whole
cluster is torn down within the deadline, so a bug shows as an error, never as a hang.

This is not the deployment launcher (that is detcomm-launch, under torchrun or MPI).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .envelope import MULTICAST_OFF_ENV

__all__ = ["LocalCluster", "RankFailed", "spawn"]


class RankFailed(RuntimeError):
    """A job raised on one or more ranks (the message holds each failing rank's traceback).

    ``late`` lists the ranks that gave no result within the deadline (``deadline_s``), if any: the caller can
    then name its own setting that raises the deadline.
    """

    def __init__(self, failures: dict[int, str], *, torn_down: bool, late: tuple[int, ...] = (),
                 deadline_s: float | None = None) -> None:
        self.failures = failures
        self.torn_down = torn_down
        self.late = late
        self.deadline_s = deadline_s
        by_text: dict[str, list[int]] = {}
        for r, tb in sorted(failures.items()):
            by_text.setdefault(tb, []).append(r)
        text = "\n".join(f"--- rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} ---\n{tb}" for tb, rs in by_text.items())
        super().__init__(f"{len(failures)} rank(s) failed{' (cluster torn down)' if torn_down else ''}:\n{text}")

    @property
    def messages(self) -> dict[int, str]:
        """The last line of each failing rank's traceback (the exception's message)."""
        return {r: tb.strip().splitlines()[-1] for r, tb in self.failures.items()}


def _worker(rank: int, world_size: int, store_path: str, backend: str, env: dict[str, str],
            jobs: mp.Queue[Any], results: mp.Queue[Any], pg_timeout_s: float) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout_s))
    try:
        while True:
            job = jobs.get()
            if job is None:
                break
            fn, args = job
            try:
                results.put((rank, True, fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - the parent reports it
                results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import detcomm

            detcomm.shutdown()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class LocalCluster:
    """W local ranks in fresh processes joined in one default process group (see the module docstring)."""

    def __init__(self, world_size: int, *, backend: str = "gloo", env: dict[str, str] | None = None,
                 pg_timeout_s: float = 60.0, start_timeout_s: float = 120.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self._dir = tempfile.mkdtemp(prefix="detcomm-cluster-")
        ctx = mp.get_context("spawn")
        child_env = dict(MULTICAST_OFF_ENV)
        child_env.update(env or {})
        self._results: mp.Queue[Any] = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world_size, os.path.join(self._dir, "store"), backend, child_env,
                              self._jobs[r], self._results, pg_timeout_s))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True
        # A first no-op job proves every rank joined the group.
        self.run(_ping, timeout_s=start_timeout_s)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results in rank order."""
        if not self.alive:
            raise ValueError("this LocalCluster was torn down; start a new one")
        for q in self._jobs:
            q.put((fn, args))
        # The job's deadline is a hang detector, not a timer of the work: a rank stuck in a collective already
        # fails at the group's timeout and reports it, and a rank whose process died is noticed within a second
        # (below). So the default is generous (4 group timeouts): on a busy 2-core machine a job that loads a
        # model on 3-4 ranks took longer than the former pg_timeout + 30 s and failed although nothing hung.
        deadline = 4 * self.pg_timeout_s + 30.0 if timeout_s is None else timeout_s
        got: dict[int, tuple[bool, Any]] = {}
        failures: dict[int, str] = {}
        end = time.monotonic() + deadline
        while len(got) < self.world_size:
            left = end - time.monotonic()
            try:
                rank, ok, value = self._results.get(timeout=max(min(left, 1.0), 0.01))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                missing = [r for r in range(self.world_size) if r not in got]
                expired = time.monotonic() >= end
                if not expired and not any(r in dead for r in missing):
                    continue
                codes = {r: self._procs[r].exitcode for r in dead}  # before close() terminates the others
                self.close(force=True)
                for r in missing:
                    if r in dead:
                        why = f"the process died (exit code {codes[r]}) before returning a result"
                    elif expired:
                        why = f"no result within the deadline of {deadline:g} s (LocalCluster.run's timeout_s raises it)"
                    else:
                        why = "still running when a peer's process died (torn down)"
                    failures.setdefault(r, why)
                late = tuple(r for r in missing if expired and r not in dead)
                raise RankFailed(failures, torn_down=True, late=late, deadline_s=deadline) from None
            got[rank] = (ok, value)
            if not ok:
                failures[rank] = value
                end = min(end, time.monotonic() + 10.0)  # the others' grace period to fail or finish too
        if failures:
            raise RankFailed(failures, torn_down=False)
        return [got[r][1] for r in range(self.world_size)]

    def close(self, *, force: bool = False) -> None:
        """Stop the ranks (``force``: terminate at once) and remove the rendezvous files."""
        if not self.alive:
            return
        self.alive = False
        if not force:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


def _ping(rank: int, world_size: int) -> int:
    import torch
    import torch.distributed as dist

    device = "cuda" if "nccl" in dist.get_backend() else "cpu"
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    assert int(t.item()) == world_size
    return rank


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, backend: str = "gloo",
          env: dict[str, str] | None = None, timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` once on ``nproc`` fresh local ranks; return the results in rank order."""
    with LocalCluster(nproc, backend=backend, env=env) as cluster:
        return cluster.run(fn, *args, timeout_s=timeout_s)
