"""torchrun for detcomm-launch: ``torch.distributed.run`` with the same arguments, minus its failure traceback.

    python -m detcomm.launch.torchrun_agent [torchrun arguments] -m detcomm.launch.rank [-m] TARGET [ARGS...]

When a worker fails, torchrun tears the group down and then raises ``ChildFailedError``, whose traceback and
summary table would be the last thing on the console, below the failing rank's own error. Here the same
``run`` is called and the exception is turned into the failing worker's exit status plus one record for the
launcher (``failures.json`` in $DETCOMM_LAUNCH_ERRORS: the exit code of every rank the agent saw fail, a
negative one for the signal that ended it, so a rank that died without a Python error is still named). The
launcher then names the first rank that failed and prints its own error last.

A signal that stops the agent (the launcher forwards SIGINT / SIGTERM / SIGHUP to it, and the kernel sends
SIGTERM when the launcher dies: detcomm.launch.lifetime) makes torchrun pass it on to every worker and wait
for them; the agent then exits with 128 + the signal, as a shell reports a process ended by it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from .lifetime import AGENT_PID_ENV
from .rank import ERRORS_ENV

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun; return 0, or the first failing worker's exit status (128 + signal for a signal)."""
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the workers inherit it: the parent each one dies with
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        folder = os.environ.get(ERRORS_ENV)
        if folder and os.path.isdir(folder):
            with open(os.path.join(folder, "failures.json"), "w") as f:
                json.dump({str(r): f.exitcode for r, f in e.failures.items()}, f)
        code = failure.exitcode
        return code if code > 0 else 128 - code  # a negative exit code is the signal that ended the worker
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
