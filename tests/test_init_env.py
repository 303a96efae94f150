"""detcomm.init() with no process group: it creates one from torchrun's or an MPI launcher's variables."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = str(Path(__file__).with_name("init_from_env_job.py"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reports(path: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in path.glob("*.json")), key=lambda r: r["rank"])


def _clean_env(reports: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                         "MASTER_PORT", "NCCL_ALGO", "NCCL_PROTO", "DETCOMM_NUMERICS")}
    env["PYTHONPATH"] = str(ROOT)
    env["DETCOMM_TEST_REPORTS"] = str(reports)
    return env


def test_init_under_torchrun(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           JOB, "rl-bitwise"], capture_output=True, text=True, env=_clean_env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reps = _reports(tmp_path)
    assert [r["rank"] for r in reps] == [0, 1, 2]
    for r in reps:
        assert r["world"] == 3 and r["sum"] == 6.0 and r["route"] == "gather_fold"
        assert r["env"]["NCCL_ALGO"] == "Ring" and r["env"]["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("flavour", ["openmpi", "pmi"])
def test_init_from_mpi_variables(flavour: str, tmp_path: Path) -> None:
    port = str(_free_port())
    procs = []
    for rank in range(3):
        env = _clean_env(tmp_path)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DETCOMM_NUMERICS="rl-bitwise")
        if flavour == "openmpi":
            env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="3", OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
                       OMPI_COMM_WORLD_LOCAL_SIZE="3")
        else:
            env.update(PMI_RANK=str(rank), PMI_SIZE="3", MPI_LOCALRANKID=str(rank), MPI_LOCALNRANKS="3")
        procs.append(subprocess.Popen([sys.executable, JOB], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    reps = _reports(tmp_path)
    assert [r["rank"] for r in reps] == [0, 1, 2]
    assert all(r["numerics"] == "rl-bitwise" and r["sum"] == 6.0 and r["env"]["LOCAL_RANK"] == str(r["rank"]) for r in reps)


def test_init_without_any_environment_says_how_to_launch(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, JOB], capture_output=True, text=True, env=_clean_env(tmp_path), timeout=120)
    assert proc.returncode != 0
    assert "detcomm-launch --nproc N" in proc.stderr and "torchrun" in proc.stderr


@pytest.mark.parametrize(("env", "gpus", "plan"), [
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 0, ("gloo", None)),  # CPU machine
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 8, ("nccl", 2)),  # a GPU per rank
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 4, ("nccl", 3)),
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 1, ("gloo", 0)),  # four ranks share one GPU: NCCL refuses that
    ({"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}, 2, ("gloo", 1)),  # round-robin over the GPUs
    ({"LOCAL_RANK": "0"}, 1, ("nccl", 0)),  # no LOCAL_WORLD_SIZE: this rank alone is known
])
def test_rendezvous_plan_shares_gpus_over_gloo_when_ranks_outnumber_them(env: dict[str, str], gpus: int,
                                                                         plan: tuple[str, int | None]) -> None:
    from detcomm import rendezvous_plan

    assert rendezvous_plan(env, gpus) == plan
