"""The command lines that start W ranks: torch.distributed.run (torchrun) or a real mpiexec.

Both are plain argv lists so the CLI can run them and tests can inspect them. Neither launcher is
reimplemented here: torchrun already tears the group down when a worker fails (its agent polls every
0.1 s and SIGTERMs the rest), and mpiexec does so when a rank calls MPI_Abort, which detcomm.launch.mpi_bootstrap
does on any uncaught exception. Every rank runs the target through detcomm.launch.rank (under torchrun) or
detcomm.launch.mpi_bootstrap (under mpiexec), which record the rank's error for the launcher's last word.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import LaunchError

__all__ = [
    "LaunchError",
    "Target",
    "MpiExec",
    "find_mpiexec",
    "torchrun_command",
    "mpiexec_command",
    "TORCHRUN_LINE_PREFIX",
    "have_mpi4py",
]

MPI_INSTALL_HINT = (
    "install Open MPI (Debian/Ubuntu: apt-get install -y openmpi-bin libopenmpi-dev; conda: conda install -c "
    "conda-forge openmpi) or MPICH (apt-get install -y mpich), then pip install mpi4py"
)

# torchrun's tee prefix, by global rank (its default is the role and the local rank): the variable is read by
# torch.distributed.run itself, so it goes into torchrun's environment.
TORCHRUN_LINE_PREFIX = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"}


@dataclass(frozen=True)
class Target:
    """What every rank runs: ``python -m module args`` or ``python script args``."""

    path: str
    args: tuple[str, ...] = ()
    module: bool = False

    def argv(self) -> list[str]:
        return (["-m"] if self.module else []) + [self.path, *self.args]


@dataclass(frozen=True)
class MpiExec:
    """An mpiexec found on PATH and the implementation behind it ("openmpi" or "hydra")."""

    path: str
    flavor: str
    version: str


def find_mpiexec(*, path: str | None = None) -> MpiExec:
    """Locate mpiexec (or mpirun) on PATH and tell Open MPI from MPICH/Intel MPI (Hydra).

    Raises:
        LaunchError: no mpiexec on PATH, or one whose implementation is not recognised; the message names
            the packages to install.
    """
    exe = shutil.which("mpiexec", path=path) or shutil.which("mpirun", path=path)
    if exe is None:
        raise LaunchError(f"detcomm-launch --backend mpi needs an mpiexec on PATH and found none: {MPI_INSTALL_HINT}")
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    text = proc.stdout + proc.stderr
    first = text.strip().splitlines()[0] if text.strip() else ""
    if "Open MPI" in text or "OpenRTE" in text:
        return MpiExec(exe, "openmpi", first)
    if "HYDRA" in text or "MPICH" in text or "Intel" in text:
        return MpiExec(exe, "hydra", first)
    raise LaunchError(f"{exe} is neither Open MPI nor an MPICH/Intel MPI Hydra mpiexec ({first!r}); {MPI_INSTALL_HINT}")


def torchrun_command(nproc: int, target: Target, *, extra: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """torchrun (``detcomm.launch.torchrun_agent``) for ``nproc`` local workers, each running the target
    through ``detcomm.launch.rank``; run it with ``TORCHRUN_LINE_PREFIX`` in its environment.

    ``--standalone`` (a private rendezvous on a free local port) unless ``extra`` configures a rendezvous
    itself (multi-node: --nnodes, --rdzv-*, --master-*).
    """
    _check_nproc(nproc)
    own_rdzv = any(a.startswith(("--nnodes", "--rdzv", "--master", "--node")) for a in extra)
    cmd = [python, "-m", "detcomm.launch.torchrun_agent"]
    if not own_rdzv:
        cmd.append("--standalone")
    # --tee 3 copies both streams to the console, each line tagged by TORCHRUN_LINE_PREFIX.
    cmd += ["--nproc-per-node", str(nproc), "--tee", "3", *extra]
    return cmd + ["-m", "detcomm.launch.rank", *target.argv()]


def mpiexec_command(
    mpi: MpiExec,
    nproc: int,
    target: Target,
    *,
    forward: Mapping[str, str],
    extra: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """mpiexec starting ``nproc`` copies of detcomm.launch.mpi_bootstrap running ``target``.

    Args:
        mpi: from ``find_mpiexec``.
        forward: variables every rank must see, also on other nodes (mpiexec passes its own environment only
            to local ranks): -x NAME for Open MPI, -genv NAME VALUE for Hydra.
        extra: further mpiexec arguments (a hostfile, say), placed before the program.
    """
    _check_nproc(nproc)
    cmd = [mpi.path, "-n", str(nproc)]
    if mpi.flavor == "openmpi":
        # --oversubscribe: --nproc is the user's explicit choice, also above the core count (CI runs W=4 on 2
        # cores). --bind-to none: as under torchrun, each rank's threads may use any core.
        cmd += ["--oversubscribe", "--bind-to", "none", "--tag-output"]
        for name in sorted(forward):
            cmd += ["-x", name]
    else:
        cmd += ["-prepend-rank"]
        for name in sorted(forward):
            cmd += ["-genv", name, forward[name]]
    return cmd + list(extra) + [python, "-m", "detcomm.launch.mpi_bootstrap", *target.argv()]


def have_mpi4py() -> bool:
    """Whether the ranks' interpreter (this one) can import mpi4py; importing the package does not start MPI."""
    try:
        import mpi4py  # noqa: F401  (presence check only)
    except ImportError:
        return False
    return True


def _check_nproc(nproc: int) -> None:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be a positive integer, got {nproc!r}")
