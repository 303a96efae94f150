"""Run the start-up command (torchrun or mpiexec) as a child and relay its output: every rank's line with one
``[rankN]:`` tag whichever backend started it, and, once the group is down, the first failing rank's own
error last, once.

Each backend tags lines its own way: torchrun ``[rankN]:`` (its tee prefix; torch's excepthook adds a second
``[rankN]:`` to a traceback it prints), Open MPI ``[1,N]<stdout>:`` (--tag-output), MPICH/Intel MPI Hydra
``[N]`` (-prepend-rank). Lines that no rank wrote (the backend's own messages) pass through unchanged. Ranks
record their error in a folder this module creates (detcomm.launch.rank) rather than printing it, so that
the consequences on the other ranks (a closed connection, a torn-down peer) and the backend's summary cannot
bury it: it is printed after everything else.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from .rank import ERRORS_ENV

__all__ = ["normalize", "failure_report", "run"]

# Each backend's tag with the separator it puts after it (torchrun none, Open MPI and Hydra one space).
_TAGS = {
    "torchrun": re.compile(r"\[rank(\d+)\]:"),
    "openmpi": re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>: ?"),
    "hydra": re.compile(r"\[(\d+)\] ?"),
}


def normalize(line: str, flavor: str) -> str:
    """``[rankN]: text`` for a rank's line, whichever way ``flavor`` (torchrun, openmpi, hydra) tagged it."""
    m = _TAGS[flavor].match(line)
    if m is None:
        return line
    rank = m.group(1)
    rest = line[m.end():]
    rest = re.sub(rf"^(?:\[rank{rank}\]: ?)+", "", rest)  # torch's excepthook tags a traceback once more
    return f"[rank{rank}]: {rest}"


def failure_report(folder: Path, status: int) -> list[str]:
    """The lines printed last when the job failed: the first failing rank's error, after the others' summary."""
    recs = sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")), key=lambda r: r["time"])
    if not recs:
        codes = folder / "failures.json"
        died = json.loads(codes.read_text()) if codes.is_file() else {}
        if died:
            what = ", ".join(f"rank {r} ({_exit(c)})" for r, c in sorted(died.items(), key=lambda kv: int(kv[0])))
            return [f"detcomm-launch: {what} failed without a Python error (status {status}); their output is above"]
        return [f"detcomm-launch: the job failed (status {status}) and no rank recorded an error; see the output above"]
    first, later = recs[0], recs[1:]
    lines = []
    if later:
        lines.append(f"detcomm-launch: after rank {first['rank']} failed: " +
                     "; ".join(f"rank {r['rank']}: {_last(r['error'])[:160]}" for r in later))
    lines.append(f"detcomm-launch: rank {first['rank']} of {first['world_size']} failed first; the whole group was "
                 f"stopped (status {status}). Its error:")
    lines += [f"[rank{first['rank']}]: {line}" for line in first["error"].rstrip("\n").split("\n")]
    return lines


def _last(error: str) -> str:
    return error.strip().splitlines()[-1] if error.strip() else "(no message)"


def _exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def _pump(src: IO[bytes], dst: IO[str], flavor: str) -> None:
    for raw in iter(src.readline, b""):
        dst.write(normalize(raw.decode("utf-8", "replace").rstrip("\n"), flavor) + "\n")
        dst.flush()
    src.close()


def run(cmd: Sequence[str], env: Mapping[str, str], *, flavor: str) -> int:
    """Run ``cmd`` under ``env`` with its output relayed; return its exit status (128 + signal for a signal).

    SIGTERM and SIGHUP are passed on to the child. SIGINT is not: the child is in the same process group and
    gets the terminal's Ctrl-C itself; a second one would interrupt its own tear-down.
    """
    folder = Path(tempfile.mkdtemp(prefix="detcomm-launch-"))
    try:
        child = subprocess.Popen(list(cmd), env={**env, ERRORS_ENV: str(folder)}, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: child.send_signal(s))
        signal.signal(signal.SIGINT, lambda _s, _f: None)
        pumps = [threading.Thread(target=_pump, args=(child.stdout, sys.stdout, flavor), daemon=True),
                 threading.Thread(target=_pump, args=(child.stderr, sys.stderr, flavor), daemon=True)]
        for t in pumps:
            t.start()
        status = child.wait()
        for t in pumps:
            t.join(timeout=10)  # a rank that outlived the backend may still hold the pipes: do not wait for it
        status = status if status >= 0 else 128 - status
        if status:
            sys.stdout.flush()
            sys.stderr.write("\n".join(failure_report(folder, status)) + "\n")
            sys.stderr.flush()
        return status
    finally:
        shutil.rmtree(folder, ignore_errors=True)
