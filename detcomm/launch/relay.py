"""Run the start-up command (torchrun or mpiexec) as a child and relay its output: every rank's line with one
``[rankN]:`` tag whichever backend started it, and, once the group is down, the first rank that failed, how
(its error, the signal that ended it, or an early clean exit) and its own traceback last, once.

Each backend tags lines its own way: torchrun ``[rankN]:`` (its tee prefix; torch's excepthook adds a second
``[rankN]:`` to a traceback it prints), Open MPI ``[1,N]<stdout>:`` (--tag-output), MPICH/Intel MPI Hydra
``[N]`` (-prepend-rank). Lines that no rank wrote (the backend's own messages) pass through unchanged.

What the report is made of (docs/spec.md §6): each rank's own record of how it ended (detcomm.launch.rank: an
error or a clean exit with its time, a faulthandler dump for a fatal signal), and the exit status of every rank
that failed as its launcher saw it (the torchrun agent's ``failures.json``; Open MPI's "exited on signal" line).
The first to fail is the earliest record; a rank that died by a signal leaving no record (SIGKILL) or exited
non-zero without one was stopped from outside the job, never by a peer's failure, and comes first.

The child runs in a process group of its own with the kernel's parent-death signal (detcomm.launch.lifetime):
SIGINT, SIGTERM and SIGHUP sent to the launcher's pid are forwarded to that group, and a launcher killed
outright takes the child, and with it every rank, down.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .lifetime import die_with_parent
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


# Open MPI's word on a rank that a signal ended ("mpirun noticed that process rank 1 with PID 42 on node n0
# exited on signal 9 (Killed)."): the only place mpiexec names the rank.
_OMPI_SIGNALED = re.compile(r"noticed that process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")


@dataclass(frozen=True)
class _End:
    """How one rank ended: ``time`` None for an end it could not record (killed, or a C-level _exit)."""

    rank: int
    time: float | None
    how: str
    detail: str = ""  # its own traceback or faulthandler dump
    title: str = ""  # what ``detail`` is, for the report's headline
    clean: bool = False  # exited with status 0
    lost_peer: bool = False  # its error is a communication failure: a consequence of a peer that left or hung
    silent: tuple[int, ...] = ()  # the ranks its PeerTimeout names as never having arrived
    own_error: bool = False  # it raised an error (or exited non-zero) itself


# What a rank raises when a peer left, hung or closed its connection (gloo's, the store's and detcomm's own
# words): a clean exit before such a failure is its cause; before any other failure it is only a rank that finished.
_LOST_PEER = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|PeerTimeout|CollectiveFailed|DistNetworkError|"
                        r"DistStoreError|[Tt]imed out")


def _ends(folder: Path, exits: Mapping[int, int], *, agent_saw: bool = False) -> list[_End]:
    """How each rank ended, the first failure first. ``agent_saw``: ``exits`` is the torchrun agent's list of
    every rank that failed, so a rank missing from it ended with status 0."""
    recs = {int(r["rank"]): r for r in (json.loads(p.read_text()) for p in folder.glob("rank*.json"))}
    started = {int(p.stem[4:]) for p in folder.glob("rank*.fault")}  # created when a rank starts
    faults = {int(p.stem[4:]): p for p in folder.glob("rank*.fault") if p.stat().st_size}
    terms = {int(p.stem[4:]): p for p in folder.glob("rank*.term") if p.stat().st_size}
    ends = []
    for rank in sorted(set(recs) | started | set(exits)):
        rec, code = recs.get(rank), exits.get(rank)
        if rec is not None and not rec.get("returned", True):  # os._exit: its program did not finish
            ends.append(_End(rank, rec["time"], f"exited early (status {rec['status']}, through os._exit: its "
                             "program did not return)", clean=rec["status"] == 0, own_error=rec["status"] != 0))
        elif rec is not None and rec["status"] != 0:
            error = rec["error"] or ""
            if error == f"exited with status {rec['status']}":  # sys.exit(N): the program printed its own reason
                ends.append(_End(rank, rec["time"], error, own_error=True))
            else:
                ends.append(_End(rank, rec["time"], f"raised {_last(error)}", error, "Its error:",
                                 lost_peer=bool(_LOST_PEER.search(error)), own_error=True,
                                 silent=tuple(int(r) for r in rec.get("silent") or ())))
        elif rank in faults:
            sig = _exit(code) if code is not None and code < 0 else "a fatal signal"
            ends.append(_End(rank, faults[rank].stat().st_mtime, f"died of {sig}", faults[rank].read_text(),
                             "Its Python stack at the signal (faulthandler):"))
        elif rank in terms:
            ends.append(_End(rank, terms[rank].stat().st_mtime, "was stopped by signal SIGTERM", terms[rank].read_text(),
                             "Its Python stack at the signal (faulthandler):"))
        elif code is not None and code < 0:
            ends.append(_End(rank, None, f"was killed by {_exit(code)}, without a Python error (a signal from "
                             "outside the job: a user, a supervisor, the kernel's OOM killer)"))
        elif code:
            ends.append(_End(rank, None, f"exited with status {code} without recording a Python error", own_error=True))
        elif rec is not None:
            ends.append(_End(rank, rec["time"], "exited with status 0 while the other ranks still ran", clean=True))
        elif agent_saw:  # the torchrun agent lists every rank it saw fail: this one exited with status 0
            ends.append(_End(rank, None, "exited early (status 0 without a record, as a C-level _exit leaves it: "
                             "its program did not return)"))
        else:  # it ran (its files exist) and left nothing: the ends that run no handler
            ends.append(_End(rank, None, "ended without a record: killed by SIGKILL (from outside the job: a user, a "
                             "supervisor, the kernel's OOM killer) or exited through a C-level _exit"))
    ends.sort(key=lambda e: (e.time is not None, e.time or 0.0))
    first_failure = next((i for i, e in enumerate(ends) if not e.clean), len(ends))
    if first_failure < len(ends):
        failure = ends[first_failure]
        # A rank the first failure's PeerTimeout names as never having arrived (it hung before the rendezvous or
        # the call) is the cause, unless it raised an error of its own: how it ended (stopped by the tear-down's
        # SIGTERM, its stack showing where it hung) is then the news, and the rank that waited for it is not.
        by_rank = {e.rank: e for e in ends}
        hung = [by_rank[r] for r in failure.silent if r in by_rank and not by_rank[r].own_error and r != failure.rank]
        if hung:
            blamed = [_End(e.rank, e.time, f"never arrived (rank {failure.rank}'s PeerTimeout names it as the rank "
                           f"it waited for) and {e.how}", e.detail, e.title) for e in hung]
            rest = [e for e in ends if e.rank not in {b.rank for b in blamed}]
            ends = blamed + rest
            first_failure = len(blamed) + next((i for i, e in enumerate(rest) if not e.clean), len(rest))
    # A clean exit is news only before the first failure, and only when that failure is a lost peer (the clean
    # exit left it waiting): a rank that finished its program is no failure, and a peer's own error after it
    # (an exit status, an exception of its own) is the cause.
    lost = first_failure < len(ends) and ends[first_failure].lost_peer
    cause = ends[:first_failure] if lost else [e for e in ends[:first_failure] if not e.clean]
    return cause + [e for e in ends[first_failure:] if not e.clean]


def _cleanly_before(folder: Path, ends: list[_End]) -> list[int]:
    """The ranks that exited with status 0 before the first failure but are not in ``ends`` (no cause)."""
    if not ends or ends[0].clean or ends[0].time is None:
        return []
    shown = {e.rank for e in ends}
    cleans = []
    for p in folder.glob("rank*.json"):
        rec = json.loads(p.read_text())
        if rec["status"] == 0 and rec.get("returned", True) and rec["time"] < ends[0].time and rec["rank"] not in shown:
            cleans.append(int(rec["rank"]))
    return sorted(cleans)


def failure_report(folder: Path, status: int, *, exits: Mapping[int, int] | None = None) -> list[str]:
    """The lines printed last when the job failed: the first rank that failed and how, after the others.

    ``exits``: exit codes by rank as the ranks' launcher saw them (negative: the signal), merged with the
    torchrun agent's ``failures.json`` in ``folder``."""
    seen = dict(exits or {})
    codes = folder / "failures.json"
    if codes.is_file():
        seen.update({int(r): int(c) for r, c in json.loads(codes.read_text()).items()})
    ends = _ends(folder, seen, agent_saw=codes.is_file())
    if not ends:
        return [f"detcomm-launch: the job failed (status {status}) and no rank recorded an error; see the output above"]
    world = set()
    for p in (*folder.glob("rank*.json"), *folder.glob("rank*.start")):
        with contextlib.suppress(ValueError, KeyError):  # a start record cut short by the rank's death
            world.add(json.loads(p.read_text())["world_size"])
    of = f" of {world.pop()}" if len(world) == 1 else ""
    first, later = ends[0], ends[1:]
    lines = []
    cleans = _cleanly_before(folder, ends)
    if cleans:
        lines.append(f"detcomm-launch: rank{'s' if len(cleans) > 1 else ''} {', '.join(map(str, cleans))} finished "
                     f"cleanly (status 0) before rank {first.rank} failed: a clean exit is no failure")
    if later:
        lines.append(f"detcomm-launch: after rank {first.rank} {'ended' if first.clean else 'failed'}: " +
                     "; ".join(f"rank {e.rank} {e.how[:160]}" for e in later))
    verb = "ended first" if first.clean else "failed first"
    what = "" if first.how.startswith("raised") else f": it {first.how}"  # a raised error is quoted whole below
    lines.append(f"detcomm-launch: rank {first.rank}{of} {verb}{what}; the whole group was stopped (status {status})."
                 + (f" {first.title}" if first.detail else ""))
    if first.detail:
        lines += [f"[rank{first.rank}]: {line}" for line in first.detail.rstrip("\n").split("\n")]
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


def _pump(src: IO[bytes], dst: IO[str], flavor: str, exits: dict[int, int]) -> None:
    for raw in iter(src.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if flavor == "openmpi" and (m := _OMPI_SIGNALED.search(line)):
            exits.setdefault(int(m.group(1)), -int(m.group(2)))
        dst.write(normalize(line, flavor) + "\n")
        dst.flush()
    src.close()


_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run(cmd: Sequence[str], env: Mapping[str, str], *, flavor: str) -> int:
    """Run ``cmd`` under ``env`` with its output relayed; return its exit status (128 + signal for a signal).

    The child gets a process group of its own and dies with this process (SIGTERM: torchrun and mpiexec stop
    their ranks on it). SIGINT, SIGTERM and SIGHUP sent to this process, a terminal's Ctrl-C included, are
    forwarded to the child's group once each; this process then waits for the group to stop and returns
    128 + the first such signal. The ranks' stdin is /dev/null.
    """
    folder = Path(tempfile.mkdtemp(prefix="detcomm-launch-"))
    received: list[int] = []
    launcher = os.getpid()
    try:
        # stdin: /dev/null. Outside the terminal's foreground group a read of the terminal stops the reader
        # (SIGTTIN), and mpiexec reads stdin to pass it on to rank 0.
        child = subprocess.Popen(list(cmd), env={**env, ERRORS_ENV: str(folder)}, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
                                 preexec_fn=lambda: die_with_parent(signal.SIGTERM, parent=launcher))

        def forward(sig: int, _frame: object) -> None:
            if sig not in received:  # a second Ctrl-C would interrupt the ranks' own tear-down
                received.append(sig)
                os.killpg(child.pid, sig)

        for sig in _FORWARDED:
            signal.signal(sig, forward)
        exits: dict[int, int] = {}
        pumps = [threading.Thread(target=_pump, args=(child.stdout, sys.stdout, flavor, exits), daemon=True),
                 threading.Thread(target=_pump, args=(child.stderr, sys.stderr, flavor, exits), daemon=True)]
        for t in pumps:
            t.start()
        status = child.wait()
        for t in pumps:
            t.join(timeout=10)  # a rank that outlived the backend may still hold the pipes: do not wait for it
        if received:
            sys.stderr.write(f"detcomm-launch: stopped by {signal.Signals(received[0]).name}, forwarded to the job\n")
            return 128 + received[0]
        status = status if status >= 0 else 128 - status
        if status:
            sys.stdout.flush()
            sys.stderr.write("\n".join(failure_report(folder, status, exits=exits)) + "\n")
            sys.stderr.flush()
        return status
    finally:
        shutil.rmtree(folder, ignore_errors=True)
