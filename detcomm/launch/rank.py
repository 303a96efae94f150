"""What every rank runs under detcomm-launch: the target, in this process, with how it ended recorded once.

    python -m detcomm.launch.rank [-m] TARGET [ARGS...]

Runs TARGET exactly as ``python [-m] TARGET ARGS`` would, and records how it ended for the launcher, which
names the first rank that failed and how (docs/spec.md §6), after the whole group is down:

- an error (an uncaught exception, a non-zero exit): torchelastic's error file ($TORCHELASTIC_ERROR_FILE, which
  the torchrun agent reads into its failure summary), through torchelastic's ``ErrorHandler``; and, when the
  launcher created ``$DETCOMM_LAUNCH_ERRORS`` on this host, ``rank<R>.json`` there with the exact time;
- a clean exit (the program returned, or raised ``SystemExit``): ``rank<R>.json`` with status 0, the time and
  ``returned``, so a rank that left while its peers still needed it is named (torchrun counts only non-zero
  exits as failures);
- an exit through ``os._exit(status)`` (no interpreter exit, no handler runs): the wrapper replaces
  ``os._exit`` in this process, so the record is written first, with the status, the time and ``returned``
  false: the program did not finish (a zero status from torchrun would otherwise look like success);
- a fatal signal (SIGABRT from a C++ terminate, SIGSEGV, ...): torchelastic's handler enables faulthandler,
  which writes the Python stack of every thread to ``rank<R>.fault``; its modification time is the moment of
  the fault. The file is created when the rank starts, so its presence says the rank ran;
- SIGTERM (the tear-down torchrun and mpiexec send the survivors, or someone's ``kill``): faulthandler writes
  the stack to ``rank<R>.term`` from the signal handler itself, even while the rank waits inside a C++
  collective, then the signal takes its default course.

Only SIGKILL (and a C-level ``_exit``) leave no record; the launcher takes their exit status from the torchrun agent
or mpiexec where those report it. The records are read after the group is down, so the consequences on the other
ranks (a closed connection, a torn-down peer) cannot bury the cause. Without that folder (a batch script starting a
bootstrap by hand, a rank on another node) an error is printed to stderr, each line tagged ``[rankN]:``. The torchrun
mode runs this module; the MPI bootstrap (detcomm.launch.mpi_bootstrap) calls ``run`` after mapping MPI's rank facts.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import IO, NoReturn

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from .lifetime import AGENT_PID_ENV, die_with_parent

__all__ = ["ERRORS_ENV", "parse", "run", "main"]

ERRORS_ENV = "DETCOMM_LAUNCH_ERRORS"


def parse(argv: Sequence[str], *, prog: str = "detcomm.launch.rank") -> tuple[bool, str, list[str]]:
    """``[-m] TARGET [ARGS...]`` -> (module, target, args)."""
    argv = list(argv)
    module = bool(argv) and argv[0] in ("-m", "--module")
    if module:
        argv = argv[1:]
    if not argv:
        raise ValueError(f"usage: python -m {prog} [-m] TARGET [ARGS...]")
    return module, argv[0], argv[1:]


def _run_target(module: bool, target: str, args: Sequence[str]) -> None:
    sys.argv = [target, *args]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # As `python script.py` does: the script's directory first on sys.path.
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


def _target_traceback(exc: BaseException) -> str:
    """The traceback from the target's own frames on: this module's, the bootstrap's and runpy's are noise."""
    tb = exc.__traceback__
    noise = (__file__, runpy.__file__, sys.modules["__main__"].__dict__.get("__file__"))
    while tb is not None and (tb.tb_frame.f_code.co_filename in noise or
                              tb.tb_frame.f_code.co_filename.startswith("<frozen")):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb if tb is not None else exc.__traceback__))


class _RankErrors(ErrorHandler):
    """torchelastic's error handler with the target's own traceback (the launcher's and runpy's frames are
    noise) and, in the launcher's folder, this rank's fault file and end record."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        folder = os.environ.get(ERRORS_ENV)
        self.folder = folder if folder and os.path.isdir(folder) else None
        self._files: list[IO[str]] = []

    def initialize(self) -> None:
        if self.folder is None:
            super().initialize()  # faulthandler on stderr
            return
        # Kept open for the life of the process: faulthandler writes to their descriptors from a signal handler.
        # The world size for the report, whatever this rank leaves later (a rank stopped by a signal writes no end
        # record).
        with open(os.path.join(self.folder, f"rank{self.rank}.start"), "w") as f:
            json.dump({"rank": self.rank, "world_size": self.world_size}, f)
        fault, term = (open(os.path.join(self.folder, f"rank{self.rank}.{kind}"), "w") for kind in ("fault", "term"))
        self._files += [fault, term]
        faulthandler.enable(file=fault, all_threads=True)
        faulthandler.register(signal.SIGTERM, file=term, all_threads=True, chain=True)

    def end(self, status: int, error: str | None, *, returned: bool = True, silent: tuple[int, ...] = ()) -> None:
        """Record how the target ended: ``error`` None for a clean exit; ``returned`` False for an exit that
        skipped the end of the program (``os._exit``); ``silent`` the ranks its ``PeerTimeout`` names as never
        having arrived (the launcher names them, not this rank that waited)."""
        when = time.time()
        if error is not None:
            file = self._get_error_file_path()
            if file:  # torchelastic's format, read by the torchrun agent's failure summary
                data = {"message": {"message": _last(error), "extraInfo": {"py_callstack": error,
                                                                           "timestamp": str(int(when))}}}
                self._write_error_file(file, json.dumps(data))
        if self.folder is not None:
            path = os.path.join(self.folder, f"rank{self.rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"rank": self.rank, "world_size": self.world_size, "time": when, "status": status,
                           "error": error, "returned": returned, "silent": list(silent)}, f)
            os.replace(path + ".tmp", path)  # the launcher never reads half a record
        elif error is not None:
            sys.stdout.flush()
            for line in error.rstrip("\n").split("\n"):
                sys.stderr.write(f"[rank{self.rank}]: {line}\n")
            sys.stderr.flush()


def _silent(exc: BaseException) -> tuple[int, ...]:
    """The ranks a ``PeerTimeout`` in ``exc``'s chain names as never having arrived (``PeerTimeout.silent``)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        silent = getattr(e, "silent", None)
        if isinstance(silent, tuple) and silent:
            return tuple(int(r) for r in silent)
        e = e.__cause__ or e.__context__
    return ()


def _last(error: str) -> str:
    return error.strip().splitlines()[-1] if error.strip() else "(no message)"


def _record_os_exit(errors: _RankErrors) -> None:
    """Make ``os._exit`` in this process record the early end before it happens (a forked child, which has
    another pid, exits untouched)."""
    real, me = os._exit, os.getpid()

    def _exit(status: int) -> NoReturn:
        if os.getpid() == me:
            try:
                errors.end(status, None if status == 0 else f"exited through os._exit({status})", returned=False)
            except BaseException:  # noqa: BLE001, S110 - the exit itself must happen whatever the record does
                pass
        real(status)

    os._exit = _exit


def run(rank: int, world_size: int, module: bool, target: str, args: Sequence[str]) -> int:
    """Run the target in this process; return its exit status (0 on success), how it ended recorded."""
    errors = _RankErrors(rank, world_size)
    errors.initialize()
    _record_os_exit(errors)
    try:
        _run_target(module, target, args)
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            errors.end(0, None)
            return 0
        if isinstance(code, int):
            # The program said what went wrong itself (argparse, a CLI's own message) before exiting.
            errors.end(code, f"exited with status {code}")
            return code
        errors.end(1, str(code))
        return 1
    except BaseException as exc:  # noqa: BLE001 - everything the target raises is the rank's error
        errors.end(1, _target_traceback(exc), silent=_silent(exc))
        return 1
    errors.end(0, None)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under torchrun: the rank and world size come from torchrun's RANK and WORLD_SIZE."""
    agent = os.environ.get(AGENT_PID_ENV)
    if agent is not None:  # started by detcomm-launch's agent: die with it (detcomm.launch.lifetime)
        die_with_parent(signal.SIGKILL, parent=int(agent))
    module, target, args = parse(sys.argv[1:] if argv is None else argv)
    return run(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), module, target, args)


if __name__ == "__main__":
    sys.exit(main())
