"""One rank of the communicator tests of issue 40 in tests/test_robust_comm40.py (started by the test, one process
per rank): the scenarios that hang or abort a rank inside gloo when the communicator does not catch them.

    python tests/comm40_rank_job.py SCENARIO OUT_DIR

RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT come from the environment; ``detcomm.init`` creates the gloo group itself
with ``timeout_s=DEADLINE_S``. Every rank that returns writes rankN.json (what it raised, and how long it took).

Scenarios (rank 1 is the odd one):
  decl-cached     every rank declares site a [8] (its self-check runs and is cached); then rank 1 declares site b
                  with shape [16] (a new self-check) while the others declare b as [8] (the cached one)
  decl-cached-ok  the same with every rank declaring b as [8] (the control: no error, and the call works)
  a2a-splits      an uneven all_to_all whose out_splits on ranks 1 and 2 disagree with what ranks 0 and 1 send
  a2a-splits-ok   the same with consistent out_splits (the control: the rows arrive, exact)
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import detcomm

DEADLINE_S = 5.0


def _write(out: str, rank: int, result: dict[str, object]) -> None:
    tmp = os.path.join(out, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))


def declaration(rank: int, w: int, *, odd: bool) -> dict[str, object]:
    detcomm.init(numerics="rl-bitwise", timeout_s=DEADLINE_S)
    detcomm.site("a", collective="all_reduce", dtype=torch.float32, shape=(8,), max_rows=4)
    shape = (16,) if odd and rank == 1 else (8,)
    try:
        detcomm.site("b", collective="all_reduce", dtype=torch.float32, shape=shape, max_rows=4)
    except detcomm.CollectiveMismatch as e:  # the verdict must come from the declaration itself, on every rank
        return {"raised": "CollectiveMismatch", "at": "site", "message": str(e)}
    # Host work between setup and the first call (a user's own barrier): nothing of detcomm's runs here.
    torch.distributed.barrier()
    got = detcomm.all_reduce(torch.full((2, shape[0]), float(rank + 1)), site="b")
    return {"sum": got.flatten().tolist()}


def a2a_splits(rank: int, w: int, *, odd: bool) -> dict[str, object]:
    """Rank r sends r + q + 1 rows to rank q, each row holding 100 r + q. In the odd run rank 1 believes rank 0
    sends it 3 rows (rank 0 sends 2) and rank 2 that rank 1 sends it 3 (it sends 4): gloo reads past a message (a
    silently wrong row) or aborts the process."""
    detcomm.init(numerics="auto", timeout_s=DEADLINE_S)
    splits = [rank + q + 1 for q in range(w)]
    out_splits = [q + rank + 1 for q in range(w)]
    if odd and rank == 1:
        out_splits[0] += 1  # more rows than rank 0 sends
    if odd and rank == 2:
        out_splits[1] -= 1  # fewer rows than rank 1 sends
    x = torch.cat([torch.full((splits[q], 4), float(100 * rank + q)) for q in range(w)])
    got = detcomm.all_to_all(x, "a2a", splits=splits, out_splits=out_splits)
    return {"rows": got[:, 0].tolist()}


def main(scenario: str, out: str) -> None:
    rank, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run = {"decl-cached": lambda r, n: declaration(r, n, odd=True),
           "decl-cached-ok": lambda r, n: declaration(r, n, odd=False),
           "a2a-splits": lambda r, n: a2a_splits(r, n, odd=True),
           "a2a-splits-ok": lambda r, n: a2a_splits(r, n, odd=False)}[scenario]
    t0 = time.time()
    try:
        result = run(rank, w)
        result.setdefault("raised", None)
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"raised": type(e).__name__, "message": str(e)}
    result.update(seconds=time.time() - t0)
    _write(out, rank, result)
    # Stay a moment: rank 0 hosts the rendezvous store the other survivors' timeout diagnosis reads.
    time.sleep(2.0)
    os._exit(0)  # the group may be broken: leave without shutdown()'s collective tear-down


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
