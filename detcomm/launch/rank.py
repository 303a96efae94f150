"""What every rank runs under detcomm-launch: the target, in this process, with its error recorded once.

    python -m detcomm.launch.rank [-m] TARGET [ARGS...]

Runs TARGET exactly as ``python [-m] TARGET ARGS`` would. When it raises (or exits non-zero), the error goes
to ``$DETCOMM_LAUNCH_ERRORS/rank<R>.json`` with the time it happened, when the launcher created that folder on
this host: the launcher prints the first failing rank's error last, once, after the whole group is down,
instead of one traceback per rank interleaved with the consequences of the first (peers losing their
connection). Without that folder (a batch script starting a bootstrap by hand, a rank on another node) the
error is printed to stderr, each line tagged ``[rankN]:``. The torchrun mode runs this module; the MPI
bootstrap (detcomm.launch.mpi_bootstrap) calls ``run`` after mapping MPI's rank facts.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence

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


def _record(rank: int, world_size: int, error: str, status: int) -> None:
    folder = os.environ.get(ERRORS_ENV)
    if folder and os.path.isdir(folder):
        path = os.path.join(folder, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "world_size": world_size, "time": time.time(), "status": status,
                       "error": error}, f)
        os.replace(path + ".tmp", path)  # the launcher never reads half a record
        return
    sys.stdout.flush()
    for line in error.rstrip("\n").split("\n"):
        sys.stderr.write(f"[rank{rank}]: {line}\n")
    sys.stderr.flush()


def run(rank: int, world_size: int, module: bool, target: str, args: Sequence[str]) -> int:
    """Run the target in this process; return its exit status (0 on success), its error recorded."""
    try:
        _run_target(module, target, args)
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return 0
        if isinstance(code, int):
            # The program said what went wrong itself (argparse, a CLI's own message) before exiting.
            _record(rank, world_size, f"exited with status {code}", code)
            return code
        _record(rank, world_size, str(code), 1)
        return 1
    except BaseException as exc:  # noqa: BLE001 - everything the target raises is the rank's error
        _record(rank, world_size, _target_traceback(exc), 1)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under torchrun: the rank and world size come from torchrun's RANK and WORLD_SIZE."""
    module, target, args = parse(sys.argv[1:] if argv is None else argv)
    return run(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), module, target, args)


if __name__ == "__main__":
    sys.exit(main())
