"""detcomm-launch: start W detcomm ranks under torchrun or a real mpiexec (docs/spec.md section 6).

Whichever launcher starts the ranks, detcomm-launch applies the numerics envelope's environment (NCCL_ALGO,
NCCL_PROTO, NVIDIA_TF32_OVERRIDE under a bitwise envelope; DETCOMM_NUMERICS: the exported value, else the
default envelope) and the multicast-off variables of docs/spec.md §8 before any rank, and therefore any
communicator, exists; the whole group goes down with a non-zero exit when one rank fails, and the first rank
that failed is named last with how it ended (its error, its signal, an early exit). The launcher and its job
end together: signals to its pid are forwarded, and a launcher killed outright takes every rank with it.

Modules, one mechanism each:
    environment     the variables every rank starts with, and which envelope (flag, exported, default)
    lifetime        every process dies with its parent (the kernel's parent-death signal)
    rank            what each rank runs: the target, how it ended recorded once for the launcher
    mpi_bootstrap   what each MPI rank runs: MPI rank facts (detcomm.mpi_env) -> torch env, then ``rank``,
                    abort on failure
    torchrun_agent  torchrun without its ChildFailedError traceback
    backends        the torchrun and mpiexec command lines
    relay           runs one of them as a child: one [rankN]: tag per line, signals forwarded, the first
                    failure named last
    cli             the ``detcomm-launch`` command
"""

from __future__ import annotations

from .environment import launch_environment

__all__ = ["launch_environment"]
