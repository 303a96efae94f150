"""The environment every rank starts with.

The variables must exist before the first communicator: NCCL reads NCCL_ALGO/NCCL_PROTO when a communicator
is created, and a multicast object created by a child process that did not see the multicast-off variables
can take a shared host's GPUs out of service (docs/spec.md §8). So the launcher writes them into the environment that
torchrun or mpiexec hands to every rank, rather than trusting each rank to set them itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# The envelope module alone (stdlib only): the launcher need not import torch to start ranks.
from detcomm.envelope import envelope_environment

__all__ = ["MULTICAST_OFF", "launch_environment", "launch_variables"]

# docs/spec.md §8: set in every environment detcomm creates, whatever the envelope says. Kept here as well as in the
# core's envelope_environment so that the launcher's promise does not depend on a switch (allow_multicast)
# that only a rank-side opt-in may loosen.
MULTICAST_OFF: Mapping[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def launch_environment(numerics: str = "auto", *, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The complete environment for the ranks of a job launched under ``numerics``.

    Args:
        numerics: a registered numerics envelope name ("auto", "rl-bitwise", or a plugin's).
        base: the environment to start from (default: this process's ``os.environ``).

    Returns:
        ``base`` plus the envelope's variables (``detcomm.envelope_environment``), the multicast-off variables,
        and OMP_NUM_THREADS=1 unless the caller chose a value (torchrun sets the same default; W ranks each
        spawning one thread per core would oversubscribe the host).

    Raises:
        ValueError: unknown envelope name (from the core's resolver, naming the known ones).
    """
    env = dict(os.environ if base is None else base)
    env.update(envelope_environment(numerics))
    env.update(MULTICAST_OFF)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch_variables(numerics: str = "auto") -> dict[str, str]:
    """Only the variables the launcher sets or forces (for forwarding them to remote MPI nodes)."""
    names = set(envelope_environment(numerics)) | set(MULTICAST_OFF) | {"OMP_NUM_THREADS"}
    env = launch_environment(numerics)
    return {k: env[k] for k in sorted(names)}
