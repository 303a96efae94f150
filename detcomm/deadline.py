"""Deadlines: the default timeout of the groups detcomm creates, and a timeout error that names who is missing.

A collective whose peer never arrives fails in the library with a message that names neither the site nor the
peer ("Timed out waiting 300000ms for recv operation"). When a blocking call of a site times out, every rank
that timed out writes where it did (site and call number) into the process group's key-value store (the
rendezvous store every torch.distributed group already has), waits a moment for the other waiting ranks to
do the same, and raises ``PeerTimeout`` naming the site, the call number, where the other ranks timed out,
and the ranks that wrote nothing: those are dead, frozen, or stuck outside detcomm. The store is touched on this
failure path only, so a healthy call pays nothing.

Every wait on the store here is bounded (``grace_s`` plus ``STORE_REPLY_S``): the store is a server inside one
process (rank 0's when ranks start without torchrun: a plain env:// rendezvous, an MPI job), and a frozen host
accepts the connection's bytes into its kernel buffers but never answers, while torch's TCPStore client waits
for the answer without its timeout. The exchange therefore runs on a daemon thread, and a store that has not
answered in time is named as unreachable instead of the report waiting with it; the thread stays parked on
the silent store until the process exits.

DEFAULT_TIMEOUT_S: the deadline of every blocking wait on a group ``detcomm.init`` creates, when
``timeout_s`` is not given. Five minutes: far beyond any healthy collective (microseconds to milliseconds),
and beyond the host stalls a serving process meets between two collectives (weights loading on one rank
while the others wait, a kernel JIT, a GC pause), yet a dead rank surfaces in minutes rather than after
gloo's 30-minute default. A group the caller created keeps its own timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch.distributed as dist

from .errors import PeerTimeout

__all__ = ["DEFAULT_TIMEOUT_S", "REPORT_GRACE_S", "STORE_REPLY_S", "is_timeout", "timeout_reports", "arrivals",
           "peer_timeout"]

DEFAULT_TIMEOUT_S = 300.0
REPORT_GRACE_S = 2.0  # how long a timed-out rank waits for the other timed-out ranks to sign in
# How long past the grace the report waits for the store's answers: a live store answers W small reads in
# milliseconds, even on a loaded host.
STORE_REPLY_S = 2.0
_log = logging.getLogger("detcomm")


def is_timeout(e: BaseException) -> bool:
    """Whether a torch.distributed error is a deadline (gloo and NCCL spell it "Timed out" / "timeout")."""
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store reachable: the error says so instead of naming ranks
        return None


def _store_address(store: Any) -> str:
    """``host:port`` of the TCP server behind ``store`` (through its prefix wrappers), else its type."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None else type(store).__name__


def timeout_reports(prefix: str, rank: int, ranks: list[int], mine: str, *, grace_s: float = REPORT_GRACE_S,
                    reply_s: float = STORE_REPLY_S) -> dict[int, str] | None:
    """Post ``mine`` (where this rank timed out) under ``prefix/rank``, wait ``grace_s`` for the other timed-out
    ranks to do the same, and return what every rank posted ({} entries for ranks that posted nothing). None
    when the store fails or does not answer within ``grace_s + reply_s`` (its host may be the rank that died
    or froze). Returns within ``grace_s + reply_s`` whatever the store does."""
    store = _store()
    if store is None:
        return None
    answer: list[dict[int, str] | None] = []

    def exchange() -> None:
        try:
            store.set(f"{prefix}/{rank}", mine)
            time.sleep(grace_s)
            answer.append({r: store.get(f"{prefix}/{r}").decode() for r in ranks if store.check([f"{prefix}/{r}"])})
        except Exception:  # noqa: BLE001 - the store's host is gone: unreachable, said by the caller's message
            answer.append(None)
        done.set()

    done = threading.Event()
    threading.Thread(target=exchange, name="detcomm-timeout-report", daemon=True).start()
    return answer[0] if done.wait(grace_s + reply_s) else None


def arrivals(store: Any, prefix: str, ranks: list[int], *, reply_s: float = STORE_REPLY_S) -> list[int] | None:
    """Which of ``ranks`` set ``prefix/rank`` in ``store``; None when the store fails or does not answer within
    ``reply_s`` (its host may be the rank that is gone). Bounded as ``timeout_reports`` is: a daemon thread."""
    answer: list[list[int] | None] = []

    def ask() -> None:
        try:
            answer.append([r for r in ranks if store.check([f"{prefix}/{r}"])])
        except Exception:  # noqa: BLE001 - the store's host is gone: the caller says the ranks are unknown
            answer.append(None)
        done.set()

    done = threading.Event()
    threading.Thread(target=ask, name="detcomm-arrivals", daemon=True).start()
    return answer[0] if done.wait(reply_s) else None


def peer_timeout(site: str, call: int, e: BaseException, *, group: dist.ProcessGroup, rank: int,
                 timeout_s: float | None = None) -> PeerTimeout:
    """The PeerTimeout to raise for a timed-out call of ``site`` (call number ``call`` of this communicator).

    Ranks that timed out too report where (a ring lets a rank finish a call its neighbour is still waiting in,
    so survivors may stand at neighbouring calls); the ranks that report nothing are the ones to look at."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    posted = timeout_reports(f"detcomm/timeout/{getattr(group, 'group_name', 'default')}", me, ranks,
                             f"site {site!r} call #{call}")
    if posted is None:
        who = (f"the rendezvous store ({_store_address(_store())}) failed or did not answer within "
               f"{REPORT_GRACE_S + STORE_REPLY_S:.0f} s, so which rank is silent is unknown: the store's host is dead or "
               "frozen (rank 0 when the ranks started without torchrun, e.g. under MPI or a plain env:// "
               "rendezvous)")
    else:
        silent = [r for r in ranks if r not in posted]
        others = "; ".join(f"rank {r} timed out at {w}" for r, w in sorted(posted.items()) if r != me)
        who = (f"rank(s) {silent} did not report a timeout (dead, frozen, or stuck outside detcomm)" if silent
               else "every rank timed out (a rank left the collective mid-way)")
        if others:
            who += f"; {others}"
    deadline = (f"{timeout_s:g} s, set by init(timeout_s=...) (default {DEFAULT_TIMEOUT_S:.0f} s for groups detcomm "
                "creates)" if timeout_s is not None else "the process group's own timeout (set where it was created)")
    msg = f"site {site!r}, call #{call} on rank {rank}: the collective timed out; {who}. The deadline is {deadline}. Library error: {e}"
    _log.error("detcomm: %s", msg)
    return PeerTimeout(msg, silent=tuple(silent) if posted is not None else ())
