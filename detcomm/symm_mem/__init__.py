"""Symmetric device memory for the CUDA-IPC workspace: one buffer per rank, every rank maps every peer's.

Two transports with the same surface (`rank`, `world_size`, `device_index`, `nbytes`, `ptrs`, `close()`,
`abort()`):
- `IpcSymmetricBuffer.create(nbytes, *, group, device_index, probe_offset)`: W processes (on W GPUs or sharing
  one), CUDA IPC handles exchanged over the group's CPU side channel. Collective.
- `create_local_group(world_size, nbytes, *, device_index, probe_offset)`: W ranks inside one process on one GPU,
  plain device pointers, for the W-stream harness and benchmarks. Not collective.

Importing this package needs neither cupy nor a GPU; creating buffers needs both.
"""

from .ipc import IpcSymmetricBuffer, SymmMemUnavailable
from .local import LocalSymmetricView, create_local_group

__all__ = ["IpcSymmetricBuffer", "LocalSymmetricView", "SymmMemUnavailable", "create_local_group"]
