"""One rank of the call-path failure tests in tests/test_robust_calls.py (started by the test, one process per rank).

    python tests/calls_rank_job.py SCENARIO OUT_DIR

RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT come from the environment; ``detcomm.init`` creates the gloo group
itself with ``timeout_s=DEADLINE_S``. Every rank that returns writes rankN.json (what it saw).

Scenarios (rank 1 is the odd one where there is one):
  threads         two threads per rank issue calls of two int32 sites on one communicator
  early-shutdown  rank 1 calls detcomm.shutdown() while the others call all_reduce
  die / die-check rank 1 exits mid-loop (os._exit) while every rank loops over all_reduce (check=True: die-check)
  exit-before-init  rank 1 exits before detcomm.init
  init-twice      init creates the group; is_initialized() and a second init
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

import detcomm

DEADLINE_S = 5.0


def _write(out: str, rank: int, result: dict[str, object]) -> None:
    tmp = os.path.join(out, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))


def _error(e: BaseException) -> dict[str, str]:
    return {"raised": type(e).__name__, "message": str(e)}


def threads(rank: int, w: int) -> dict[str, object]:
    """Each thread checks every result it gets against the exact sum of what the ranks passed (int32: exact), and
    stops at its first error. A wrong result returned without an error is the failure."""
    detcomm.init(numerics="auto", timeout_s=DEADLINE_S)
    seen: dict[str, object] = {"wrong": 0, "right": 0, "errors": []}
    lock = threading.Lock()

    def worker(name: str, scale: int) -> None:
        x = torch.full((4, 16), (rank + 1) * scale, dtype=torch.int32)
        want = torch.full((4, 16), scale * w * (w + 1) // 2, dtype=torch.int32)
        for _ in range(200):
            try:
                got = detcomm.all_reduce(x, site=name)
            except Exception as e:  # noqa: BLE001 - reported to the test
                with lock:
                    seen["errors"].append(type(e).__name__)  # type: ignore[attr-defined]
                return
            with lock:
                seen["right" if torch.equal(got, want) else "wrong"] += 1  # type: ignore[operator]

    ts = [threading.Thread(target=worker, args=(f"t.{i}", 10**i)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return seen


def early_shutdown(rank: int, w: int) -> dict[str, object]:
    detcomm.init(numerics="auto", timeout_s=20.0)
    x = torch.ones(4, 16)
    detcomm.all_reduce(x, site="x")
    try:
        if rank == 1:
            detcomm.shutdown()
        else:
            detcomm.all_reduce(x, site="x")
        return {"raised": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return _error(e)


def die(rank: int, w: int, *, check: bool) -> dict[str, object]:
    detcomm.init(numerics="rl-bitwise", timeout_s=DEADLINE_S, check=check)
    detcomm.site("x", collective="all_reduce", dtype=torch.float32, shape=(256,), max_rows=8)
    x = torch.full((8, 256), float(rank + 1))
    try:
        for i in range(100000):
            if rank == 1 and i == 50:
                os._exit(0)  # leaves without a word: its sockets close
            detcomm.all_reduce(x, site="x")
        return {"raised": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return _error(e)


def exit_before_init(rank: int, w: int) -> dict[str, object]:
    if rank == 1:
        os._exit(0)
    try:
        detcomm.init(numerics="auto", timeout_s=DEADLINE_S)
        return {"raised": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return _error(e)


def init_twice(rank: int, w: int) -> dict[str, object]:
    detcomm.init(numerics="auto", timeout_s=DEADLINE_S)
    result: dict[str, object] = {"initialized": detcomm.is_initialized()}
    try:
        detcomm.init(numerics="auto")
        result["second"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["second"] = type(e).__name__
    detcomm.all_reduce(torch.ones(2, 3), site="after")  # the group is intact: every rank still calls
    detcomm.shutdown()
    result["after_shutdown"] = detcomm.is_initialized()
    return result


def main(scenario: str, out: str) -> None:
    rank, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t0 = time.time()
    run = {"threads": threads, "early-shutdown": early_shutdown, "exit-before-init": exit_before_init,
           "init-twice": init_twice, "die": lambda r, n: die(r, n, check=False),
           "die-check": lambda r, n: die(r, n, check=True)}[scenario]
    result = run(rank, w)
    result.update(seconds=time.time() - t0)
    _write(out, rank, result)
    # Stay a moment: rank 0 hosts the rendezvous store the other survivors' timeout diagnosis reads.
    time.sleep(2.0)
    os._exit(0)  # the group may be broken: leave without shutdown()'s collective tear-down


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
