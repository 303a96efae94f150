"""Mapping an MPI launcher's rank facts to the variables torch.distributed's env:// rendezvous reads.

Two sources, in order of preference:

Shared by ``detcomm.init`` (a group created from a bare mpiexec's environment) and ``detcomm.launch.mpi_bootstrap``.

1. mpi4py (what ``detcomm.launch.mpi_bootstrap`` uses when it is importable): rank and size of MPI_COMM_WORLD, the
   local rank and local size from a COMM_TYPE_SHARED split (correct under any MPI and any placement), and the
   rendezvous address broadcast from rank 0 over MPI.
2. The launcher's own variables, when mpi4py is missing: Open MPI (OMPI_COMM_WORLD_*), MPICH / Intel MPI
   Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), MVAPICH2 (MV2_COMM_WORLD_*) and Slurm's srun
   (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID). Without MPI there is no broadcast, so MASTER_ADDR and
   MASTER_PORT must then already be in the environment (detcomm-launch sets them for a single-node job; a
   batch script sets them for a multi-node one), and tear-down relies on mpiexec killing the job when a rank
   exits non-zero (Open MPI and Hydra both do) instead of an explicit MPI_Abort.

Nothing here imports mpi4py or torch, so the mapping is unit-testable on any machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RankFacts", "rank_facts_from_environment", "torch_distributed_variables"]


@dataclass(frozen=True)
class RankFacts:
    """One rank's place in the job.

    Attributes:
        rank: global rank in [0, world_size).
        world_size: number of ranks.
        local_rank: rank among the ranks of this node.
        local_world_size: number of ranks on this node.
        source: where the facts came from ("mpi4py", "Open MPI", "MPICH/Hydra", ...), for messages.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size):
            raise ValueError(f"{self.source}: rank {self.rank} is outside [0, {self.world_size})")
        if not (0 <= self.local_rank < self.local_world_size <= self.world_size):
            raise ValueError(
                f"{self.source}: local rank {self.local_rank} / local size {self.local_world_size} is inconsistent "
                f"with world size {self.world_size}"
            )


# (source, rank, size, local rank, local size); the local size may be None where the launcher has no such
# variable, in which case it must come from elsewhere (see _local_size_fallback).
_VENDORS: tuple[tuple[str, str, str, str, str | None], ...] = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH/Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)


def _int(env: Mapping[str, str], name: str, source: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{source}: {name}={raw!r} is not an integer") from None


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    # SLURM_STEP_TASKS_PER_NODE looks like "4" or "4(x2)" or "3,2": the per-node count is only unambiguous
    # in the first two forms; a ragged placement gives None and the caller reports what is missing.
    raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not raw or "," in raw:
        return None
    head = raw.split("(", 1)[0]
    return int(head) if head.isdigit() else None


def rank_facts_from_environment(env: Mapping[str, str]) -> RankFacts | None:
    """Rank facts from an MPI launcher's variables, or None when no known launcher set them.

    Raises:
        ValueError: a launcher's variables are present but malformed or inconsistent, or the local size
            cannot be determined (a ragged Slurm placement without mpi4py).
    """
    for source, rank_var, size_var, local_var, local_size_var in _VENDORS:
        if rank_var not in env or size_var not in env:
            continue
        rank = _int(env, rank_var, source)
        size = _int(env, size_var, source)
        local_rank = _int(env, local_var, source) if local_var in env else None
        if local_size_var is not None and local_size_var in env:
            local_size: int | None = _int(env, local_size_var, source)
        elif source == "Slurm":
            local_size = _slurm_local_size(env)
        else:
            local_size = None
        if local_rank is None or local_size is None:
            missing = [v for v in (local_var, local_size_var) if v and v not in env]
            raise ValueError(
                f"{source} set {rank_var}/{size_var} but not the local rank facts ({', '.join(missing) or 'a per-node task count'}); "
                "install mpi4py (pip install mpi4py) so the bootstrap can find them with a shared-memory split"
            )
        return RankFacts(rank, size, local_rank, local_size, source)
    return None


def torch_distributed_variables(facts: RankFacts, *, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables torch.distributed's env:// rendezvous (and detcomm.init) read, as torchrun sets them."""
    if not master_addr:
        raise ValueError("master_addr must be a non-empty host name or address")
    if not (0 < master_port < 65536):
        raise ValueError(f"master_port must be in 1..65535, got {master_port}")
    return {
        "RANK": str(facts.rank),
        "WORLD_SIZE": str(facts.world_size),
        "LOCAL_RANK": str(facts.local_rank),
        "LOCAL_WORLD_SIZE": str(facts.local_world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
