"""The handle ``async_op=True`` returns, with the surface of torch.distributed's ``Work``.

detcomm's collectives are stream-ordered already: on a GPU a call enqueues its kernels (or NCCL's) on the
current CUDA stream and returns, so the host is free as soon as the call returns; on the CPU (gloo) the call has
finished when it returns. The handle therefore records a CUDA event after the call and ``wait()`` makes the
caller's current stream wait for it, which is what ``Work.wait()`` of torch's NCCL backend does. Code written
against torch's API (``work = all_reduce(..., async_op=True); ...; work.wait()``) runs unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["Work"]


class Work:
    """A collective's completion handle: ``wait()``, ``is_completed()``, ``result()`` (local calls)."""

    def __init__(self, output: torch.Tensor) -> None:
        self._output = output
        self._event: torch.cuda.Event | None = None
        if output.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(output.device))

    def wait(self, timeout: float | None = None) -> bool:
        """Make the current stream wait for the collective (GPU); a no-op on the CPU. Returns True."""
        if self._event is not None:
            torch.cuda.current_stream(self._output.device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[torch.Tensor]:
        return [self._output]

    def __repr__(self) -> str:
        return f"detcomm.Work(completed={self.is_completed()}, output={tuple(self._output.shape)})"
