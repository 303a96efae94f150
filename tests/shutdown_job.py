"""One rank of tests/test_shutdown_frees_the_group.py (started by the test, one process per rank).

    python tests/shutdown_job.py MODE OUT_DIR        MODE: "guard" (the call guard) or "check" (init(check=True))

The garbage collector is off from the start, so only reference counting frees anything: ``detcomm.shutdown()``
must leave no reference to the process group it created, directly or through a reference cycle. A group kept
alive past shutdown is finalized at interpreter exit, where gloo's worker threads abort the process ("terminate
called without an active exception"), after the job printed its result. The job calls every kind of site, a
virtual-shard site among them, then reports the threads this process still runs after shutdown.
"""

from __future__ import annotations

import gc
import json
import os
import sys

gc.disable()

import torch  # noqa: E402

import detcomm  # noqa: E402


def _threads() -> list[str]:
    """This process's thread names (the kernel's view: gloo's threads are C++ threads Python does not list)."""
    names = []
    for t in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while listed
            pass
    return names


def main(mode: str, out: str) -> None:
    comm = detcomm.init(numerics="rl-bitwise", check=mode == "check", timeout_s=60.0)
    rank, w = comm.rank, comm.world_size
    v, fold = (8, "tree") if w in (2, 4, 8) else (4 * w, "order")
    h = 6
    detcomm.site("ar", collective="all_reduce", dtype=torch.float32, shape=h, max_rows=8)
    detcomm.site("ag", collective="all_gather", dtype=torch.float32, shape=h, max_rows=8)
    detcomm.site("rs", collective="reduce_scatter", dtype=torch.float32, shape=h, max_rows=8 * w)
    detcomm.site("a2a", collective="all_to_all", dtype=torch.float32, shape=h, max_rows=8 * w)
    detcomm.site("am", collective="argmax", dtype=torch.float32, shape=h, max_rows=8)
    detcomm.site("vs", collective="all_reduce", dtype=torch.float32, shape=h, max_rows=8, virtual_shards=v,
                 shard_fold=fold)
    detcomm.site("norm", collective="all_reduce_rmsnorm", dtype=torch.float32, shape=h, max_rows=8)
    x = torch.arange(4 * h, dtype=torch.float32).reshape(4, h) + rank
    during = _threads()
    detcomm.all_reduce(x, "ar")
    detcomm.all_gather(x, "ag")
    detcomm.reduce_scatter(torch.ones(4 * w, h), "rs")
    detcomm.all_to_all(torch.ones(4 * w, h), "a2a")
    detcomm.argmax(x, "am", vocab_start=rank * h)
    detcomm.all_reduce(torch.ones(v // w, 4, h), "vs")
    detcomm.all_reduce_residual_rmsnorm(x, torch.ones(4, h), torch.ones(h), eps=1e-6, site="norm")
    del comm
    detcomm.shutdown()
    result = {"rank": rank, "during": during, "after": _threads()}
    with open(os.path.join(out, f".rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out, f".rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
