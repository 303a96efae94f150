"""The environment every rank starts with.

The variables must exist before the first communicator: NCCL reads NCCL_ALGO/NCCL_PROTO when a communicator
is created, and a multicast object created by a child process that did not see the multicast-off variables
can take a shared host's GPUs out of service (docs/spec.md §8). So the launcher writes them into the environment that
torchrun or mpiexec hands to every rank, rather than trusting each rank to set them itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from detcomm import envelope
from detcomm.envelope import envelope_environment, known_envelopes

__all__ = ["DEFAULT_NUMERICS", "MULTICAST_OFF", "NUMERICS_ENV", "choose_numerics", "launch_environment",
           "launch_variables"]

# The one default envelope of every detcomm entry point (init, the probes, detcomm routes, detcomm-launch).
DEFAULT_NUMERICS: str = getattr(envelope, "DEFAULT_NUMERICS", "rl-bitwise")
# What detcomm.init() in the ranks reads when no numerics= is passed.
NUMERICS_ENV = "DETCOMM_NUMERICS"

# docs/spec.md §8: set in every environment the launcher creates, whatever the envelope says: the launcher applies
# the core's constant itself, so its promise does not depend on a switch (allow_multicast) that only a rank-side
# opt-in may loosen.
MULTICAST_OFF: Mapping[str, str] = envelope.MULTICAST_OFF_ENV


def choose_numerics(flag: str | None, *, env: Mapping[str, str], option: str = "--numerics") -> str:
    """The envelope a command runs under: its ``--numerics`` flag, else an exported $DETCOMM_NUMERICS, else
    ``DEFAULT_NUMERICS``.

    An exported value wins over the default, so a user who exported rl-bitwise never gets a weaker envelope
    from a launcher's default; a flag that contradicts the exported value is an error rather than a silent
    choice between the two (the ranks' ``detcomm.init()`` reads the variable too).

    Raises:
        ValueError: the flag and the exported value differ, or either names no registered envelope.
    """
    exported = env.get(NUMERICS_ENV) or None
    if exported is not None and exported not in known_envelopes():
        raise ValueError(f"{NUMERICS_ENV}={exported!r} (exported in this environment) is not a numerics envelope; "
                         f"known: {list(known_envelopes())}")
    if flag is None:
        return exported or DEFAULT_NUMERICS
    if flag not in known_envelopes():
        raise ValueError(f"unknown numerics envelope {flag!r} for {option}; known: {list(known_envelopes())}")
    if exported is not None and flag != exported:
        raise ValueError(
            f"{option} {flag} contradicts {NUMERICS_ENV}={exported} exported in this environment; pass "
            f"{option} {exported}, or change or unset {NUMERICS_ENV} (unset, the default is {DEFAULT_NUMERICS})")
    return flag


def launch_environment(numerics: str = DEFAULT_NUMERICS, *, base: Mapping[str, str] | None = None) -> dict[str, str]:
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


def launch_variables(numerics: str = DEFAULT_NUMERICS) -> dict[str, str]:
    """Only the variables the launcher sets or forces (for forwarding them to remote MPI nodes)."""
    names = set(envelope_environment(numerics)) | set(MULTICAST_OFF) | {"OMP_NUM_THREADS"}
    env = launch_environment(numerics)
    return {k: env[k] for k in sorted(names)}
