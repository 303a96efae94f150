"""Every error detcomm raises on purpose derives from ``DetcommError``, so serving code can catch detcomm's own
failures in one place. Caller errors are not here: a wrong value raises ``ValueError`` and a wrong type
``TypeError`` before any communication, as Python's own functions do.

Each class names the situation, not the mechanism; the message always says what to do next. Classes that are
raised "on every rank" carry the same message on every rank of the group.
"""

from __future__ import annotations

__all__ = [
    "DetcommError",
    "RouteRefused",
    "CollectiveMismatch",
    "PeerTimeout",
    "WorkspaceUnavailable",
    "WorkspaceFailed",
    "SymmMemUnavailable",
    "LaunchError",
    "CollectiveFailed",
    "ConcurrentCall",
    "CaptureUnprepared",
    "CaptureThroughHost",
    "KernelBuildFailed",
    "NoFoldLeaf",
    "LogprobMismatch",
    "ContractMismatch",
]


class DetcommError(RuntimeError):
    """Base class of detcomm's own errors (a RuntimeError, so existing ``except RuntimeError`` code still works)."""


class RouteRefused(DetcommError):
    """No acceptable route passed its self-check for a site (raised on every rank with the same reason)."""


class CollectiveMismatch(DetcommError):
    """The ranks of a group made different collective calls (raised on every rank, same message)."""


class PeerTimeout(DetcommError):
    """A peer did not reach a collective call within the deadline (it skipped it, stalled or died).

    ``silent``: the ranks known not to have arrived (they reported nothing: never reached ``detcomm.init``'s
    rendezvous, or did not time out in the same call), empty when unknown; detcomm-launch names them as the cause
    instead of the rank that only waited."""

    def __init__(self, *args: object, silent: tuple[int, ...] = ()) -> None:
        super().__init__(*args)
        self.silent = tuple(silent)


class WorkspaceUnavailable(DetcommError):
    """The CUDA-IPC workspace could not be armed on this group (raised on every rank, with every rank's reason);
    the group's sites then take another canonical route and the route table says why."""


class WorkspaceFailed(DetcommError):
    """A workspace collective ended without a result (a deadline passed, or a rank aborted). The workspace refuses
    every further call until it is re-created; the message names the site, the rank waited for and the call."""


class SymmMemUnavailable(DetcommError):
    """Symmetric memory could not be set up on this group (raised on every rank, with every rank's reason)."""


class LaunchError(DetcommError):
    """The machine lacks something the chosen launch backend needs (an mpiexec, say); the message says what."""


class CollectiveFailed(DetcommError):
    """A collective call failed in the communication library (a peer died, closed its connection or its process
    group); the message names the site, the call, this rank and the library's error."""


class ConcurrentCall(DetcommError):
    """A second thread called a collective while another call was in flight on the same communicator."""


class CaptureUnprepared(DetcommError):
    """A call under CUDA graph capture needed a step that capture forbids (loading kernels, allocating device
    memory). Every such refusal has one wording (``CaptureUnprepared.before_capture``): what needed the step and
    what to run once before capturing."""

    @classmethod
    def before_capture(cls, what: str, prepare: str) -> CaptureUnprepared:
        return cls(f"{what} must load kernels or allocate device memory, which CUDA graph capture forbids: "
                   f"{prepare} once before capturing")


class CaptureThroughHost(DetcommError):
    """A call whose CUDA tensors travel through host memory (a gloo group staging them: ranks sharing a GPU) was
    issued inside a CUDA graph capture, which cannot hold a host copy. Raised at the first host copy, before any
    communication; only the calls the CUDA-IPC workspace serves (route ipc_fold) capture on such a group."""


class KernelBuildFailed(DetcommError):
    """NVRTC could not compile detcomm's kernels for this GPU; the message carries the compiler's log."""


class NoFoldLeaf(DetcommError):
    """No registered fold leaf serves the device type with the features the envelope requires."""


class LogprobMismatch(DetcommError):
    """The trainer's recomputed logprob of a rollout token is not bit-equal to the rollout's (detcomm.rl's gate
    refused the training step; the message names the request, the token position, both values and their ulp
    distance)."""


class ContractMismatch(DetcommError):
    """The trainer's and the rollout engine's arithmetic contracts differ (detcomm.rl's gate refused before the
    first step; the message names every differing field and both values)."""
