"""One rank of the failure tests in tests/test_robust_failures.py (started by the test or by detcomm-launch).

    python tests/robust_rank_job.py SCENARIO OUT_DIR

RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT come from the environment; ``detcomm.init`` creates the gloo group
itself with ``timeout_s=DEADLINE_S``. Every rank that survives writes rankN.json: what it raised and when.

Scenarios (rank 1 is the faulty one, rank 0 in freeze0-*):
  absent-check    rank 1 never makes the call; the others call all_reduce with check=True
  absent          the same without checking (gloo's own timeout error)
  die-native      every rank loops over all_reduce on the native route (numerics=auto); rank 1 SIGKILLs itself
  die-gather_fold the same on the gather_fold route (numerics=rl-bitwise)
  freeze-gather_fold  rank 1 SIGSTOPs itself instead: its sockets stay open, only the deadline ends the wait
  freeze0-gather_fold rank 0 SIGSTOPs itself: without torchrun it hosts the rendezvous store, so the survivors'
                  timeout report meets a store that accepts bytes and never answers
  abort-native    rank 1 dies of SIGABRT (os.abort(), as a C++ std::terminate would)
  exit0-native    rank 1 leaves the job early with status 0 (sys.exit(0): the interpreter's exit runs)
  exit0hard-native  rank 1 leaves through os._exit(0) (no interpreter exit, no handler, status 0)

ROBUST_LINGER=1 (under detcomm-launch): a survivor waits after its report; ROBUST_RERAISE=1: it raises its error
again after the report, as a program that does not catch it would.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch

import detcomm

DEADLINE_S = 3.0


def main(scenario: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    numerics = "rl-bitwise" if scenario.endswith("gather_fold") else "auto"
    comm = detcomm.init(numerics=numerics, timeout_s=DEADLINE_S, check=scenario == "absent-check")
    detcomm.site("x", collective="all_reduce", dtype=torch.float32, shape=(1024,), max_rows=64)
    x = torch.full((64, 1024), float(rank + 1))
    detcomm.all_reduce(x, site="x")  # every rank reached the group and the route works
    result: dict[str, object] = {"route": comm.routes().as_dicts()[0]["route"]}
    faulty = 0 if scenario.startswith("freeze0") else 1
    if rank == faulty:
        if scenario.startswith("absent"):
            time.sleep(60)  # never makes the call; the test kills this process
            return
        # Die from another thread while the main thread is inside (or between) collectives.
        with open(os.path.join(out, "killed_at"), "w") as f:
            f.write(repr(time.time() + 0.3))
        if scenario.startswith("exit0hard"):
            time.sleep(0.3)
            os._exit(0)  # as a program that leaves without its interpreter's exit (no handler runs)
        if scenario.startswith("exit0"):
            time.sleep(0.3)
            sys.exit(0)  # as a program whose main returns: the interpreter's exit closes the group's sockets
        if scenario.startswith("abort"):
            threading.Timer(0.3, os.abort).start()
        else:
            sig = signal.SIGSTOP if scenario.startswith("freeze") else signal.SIGKILL
            threading.Timer(0.3, lambda: os.kill(os.getpid(), sig)).start()
    t0 = time.time()
    error: Exception | None = None
    try:
        for _ in range(100000):
            detcomm.all_reduce(x, site="x")
            if scenario.startswith("absent"):
                break
        result.update(raised=None)
    except Exception as e:  # noqa: BLE001 - reported to the test
        result.update(raised=type(e).__name__, message=str(e))
        error = e
    result.update(started=t0, ended=time.time())
    # Written whole or not at all: the launcher's tear-down may kill this rank at any moment.
    tmp = os.path.join(out, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))
    if os.environ.get("ROBUST_RERAISE") and error is not None:
        raise error
    if os.environ.get("ROBUST_LINGER"):
        time.sleep(600)  # under detcomm-launch: only the launcher's tear-down ends this rank
    # A serving process does not vanish the instant a collective fails: stay a moment, so the rank hosting
    # the rendezvous store (rank 0) still answers the other survivors' timeout diagnosis (detcomm/deadline.py).
    time.sleep(3.0)
    # The group is broken: leave without the collective tear-down of shutdown().
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
