"""detcomm-launch: start W detcomm ranks under torchrun or a real mpiexec (docs/spec.md section 6).

Whichever backend starts the ranks, the launcher applies the numerics envelope's environment (NCCL_ALGO,
NCCL_PROTO, NVIDIA_TF32_OVERRIDE under a bitwise envelope; DETCOMM_NUMERICS) and the multicast-off variables
of docs/spec.md §8 before any rank, and therefore any communicator, exists, and the whole group goes down with a
non-zero exit when one rank fails.

Modules, one mechanism each:
    environment    the variables every rank starts with
    mpi_bootstrap  what each MPI rank runs: MPI rank facts (detcomm.mpi_env) -> torch env, then the target,
                   abort on failure
    backends       the torchrun and mpiexec command lines
    cli            the ``detcomm-launch`` command
"""

from __future__ import annotations

from .environment import launch_environment

__all__ = ["launch_environment"]
