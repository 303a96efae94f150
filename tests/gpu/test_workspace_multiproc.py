"""W processes sharing ONE GPU (W = 2, 3, 4), CUDA IPC between them, gloo side channel. The processes
time-slice the GPU, so each barrier costs milliseconds: few, small calls. Where several GPUs exist, also W
processes on W GPUs (IPC across devices, peer access proven by the real write/read-back)."""

from __future__ import annotations

import os

import pytest
from mp_worker import MULTICAST_OFF, run_rank

pytestmark = pytest.mark.gpu

CASES = [
    # op, dtype, rows, payload, algo
    ("all_reduce", "bfloat16", 1, "random", None),
    ("all_reduce", "float32", 7, "ill", "one_shot"),
    ("all_reduce", "float32", 7, "ill", "two_shot"),
    ("all_reduce", "float32", 36, "ill", "one_shot"),   # cap - 1 (fp32 rows: cap = 37)
    ("all_reduce", "float32", 38, "ill", "two_shot"),   # cap + 1: chunked
    ("all_reduce", "float32", 75, "ill", None),         # 2 cap + 1
    ("reduce_scatter", "bfloat16", 24, "ill", None),
    ("all_gather", "float16", 5, "ill", None),
    ("graph", "float32", 11, "ill", "one_shot"),
    ("graph", "bfloat16", 11, "ill", "two_shot"),
]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_processes_sharing_one_gpu(world, tmp_path):
    import torch.multiprocessing as mp

    os.environ.update(MULTICAST_OFF)  # children inherit the environment
    cases = [c for c in CASES if c[0] != "reduce_scatter" or c[2] % world == 0]
    cases += [("reduce_scatter", "float32", world * 3, "ill", None)]
    mp.spawn(run_rank, args=(world, str(tmp_path / "init"), cases, str(tmp_path)), nprocs=world, join=True)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("world", [2, 4, 8])
def test_processes_one_gpu_each(world, tmp_path):
    import torch.multiprocessing as mp

    if _gpu_count() < world:
        pytest.skip(f"needs {world} GPUs, found {_gpu_count()}")
    os.environ.update(MULTICAST_OFF)
    cases = [c for c in CASES if c[0] != "reduce_scatter" or c[2] % world == 0]
    cases += [("reduce_scatter", "float32", world * 3, "ill", None)]
    mp.spawn(run_rank, args=(world, str(tmp_path / "init"), cases, str(tmp_path), True), nprocs=world, join=True)
