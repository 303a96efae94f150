"""Processes that die with their parent: no rank outlives the launcher that started it.

A supervisor (systemd, Slurm, Kubernetes, a shell's ``kill``) signals one pid: the launcher's. The launcher
forwards SIGINT / SIGTERM / SIGHUP to its child's process group, but a SIGKILL cannot be caught, so the other
half is the kernel's: ``prctl(PR_SET_PDEATHSIG)`` makes a process receive a signal when its parent dies.
Each link of the chain sets it for itself:

    detcomm-launch --> torchrun agent / mpiexec   SIGTERM: torchrun and mpiexec stop their ranks on it
                   --> each rank                  SIGKILL: its parent, the agent or MPI's daemon, is gone

The ranks need their own link: torchrun starts each worker in a session of its own, so a signal to the agent's
group never reaches them, and an agent that is itself killed stops nothing. Linux only (prctl); elsewhere the
launcher still forwards the catchable signals.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["AGENT_PID_ENV", "die_with_parent"]

# Set by detcomm.launch.torchrun_agent for its workers: the parent each rank must die with.
AGENT_PID_ENV = "DETCOMM_LAUNCH_AGENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: signal.Signals, *, parent: int) -> None:
    """Receive ``sig`` when the parent process dies; exit at once if ``parent`` already died.

    Call it in the child (a ``preexec_fn``, or first thing in a rank). ``parent`` is the pid the caller knows
    to be its parent: a parent that died before the prctl took effect shows as a different ``getppid()``
    (the process was re-parented), and the signal would then never come.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != parent:
        os._exit(128 + int(sig))
