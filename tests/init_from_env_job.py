"""Run as a rank under torchrun or with MPI-style variables: detcomm.init() must create the process group
itself from the environment, apply the envelope's environment first, and reduce correctly."""

import json
import os
import sys

import torch
import torch.distributed as dist

import detcomm

numerics = sys.argv[1] if len(sys.argv) > 1 else None
assert not dist.is_initialized()
comm = detcomm.init(numerics=numerics)
assert dist.is_initialized() and comm.owns_group
rank, w = dist.get_rank(), dist.get_world_size()
x = torch.full((2, 3), float(rank + 1))
y = detcomm.all_reduce(x, site="env.sum")
report = {
    "rank": rank,
    "world": w,
    "sum": y[0, 0].item(),
    "numerics": comm.resolved.numerics,
    "route": comm.routes().as_dicts()[0]["route"],
    "env": {k: os.environ.get(k) for k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE", "LOCAL_RANK")},
}
detcomm.shutdown()
assert not dist.is_initialized()
# One file per rank: lines printed by several ranks into one pipe can interleave.
with open(os.path.join(os.environ["DETCOMM_TEST_REPORTS"], f"{rank}.json"), "w") as f:
    json.dump(report, f)
