"""In-process "transport": W ranks as W views inside one process on one GPU, each rank with its own buffer.

The pointers are plain device pointers of this process (no IPC: opening an IPC handle in the process that
exported it fails). The workspace kernels cannot tell the difference, so the same kernels are exercised and timed
with W ranks driven from W CUDA streams of one process. Peer access is proven the same way as over IPC (a device
store into every peer's probe slot, read back by the owner), which here mainly checks the layout.
"""

from __future__ import annotations

import secrets

import numpy as np

from .ipc import SymmMemUnavailable, _cupy, probe_token, read_probe, write_probe


class _Shared:
    """The W buffers, freed when every view has closed."""

    def __init__(self, ptrs: tuple[int, ...], device_index: int) -> None:
        self.ptrs = ptrs
        self.device_index = device_index
        self.open_views = len(ptrs)
        self.freed = False

    def release_one(self) -> None:
        self.open_views -= 1
        if self.open_views == 0 and not self.freed:
            cupy = _cupy()
            with cupy.cuda.Device(self.device_index):
                cupy.cuda.runtime.deviceSynchronize()
                for p in self.ptrs:
                    cupy.cuda.runtime.free(p)
            self.freed = True


class LocalSymmetricView:
    """Rank `rank`'s view of an in-process symmetric group. Same surface as IpcSymmetricBuffer.

    Lifecycle: `create_local_group(...)` makes all W views at once. `close()` on a view is that rank's part of
    the collective close: the buffers are freed when the last view closes (after a device synchronize).
    `abort()` is local: the view becomes unusable and the buffers are left allocated until process exit, since
    the other ranks' kernels may still touch them.
    """

    def __init__(self, shared: _Shared, rank: int, nbytes: int) -> None:
        self._shared = shared
        self.group = None
        self.rank = rank
        self.world_size = len(shared.ptrs)
        self.device_index = shared.device_index
        self.nbytes = nbytes
        self.ptrs = shared.ptrs
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._shared.release_one()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._shared.open_views = -(1 << 30)  # never reaches 0 again: nothing is freed


def create_local_group(world_size: int, nbytes: int, *, device_index: int, probe_offset: int) -> list[LocalSymmetricView]:
    """Allocate W zeroed buffers on one device and return the W rank views. Not collective (one process)."""
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size must be in 1..8, got {world_size}")
    if nbytes <= probe_offset + world_size * 16:
        raise ValueError(f"nbytes {nbytes} leaves no room for the probe area at {probe_offset}")
    cupy = _cupy()
    rt = cupy.cuda.runtime
    ptrs: list[int] = []
    try:
        with cupy.cuda.Device(device_index):
            for _ in range(world_size):
                ptrs.append(rt.malloc(nbytes))
                rt.memset(ptrs[-1], 0, nbytes)
            nonce = secrets.randbits(32)
            for owner in range(world_size):
                for writer in range(world_size):
                    write_probe(cupy, ptrs[owner], probe_offset, writer, owner, nonce, device_index)
            rt.deviceSynchronize()
            for owner in range(world_size):
                for writer in range(world_size):
                    got = read_probe(cupy, ptrs[owner], probe_offset, writer, device_index)
                    if not np.array_equal(got, probe_token(writer, owner, nonce)):
                        raise SymmMemUnavailable(f"probe of rank {owner}'s buffer, slot {writer}, read {got.tolist()}")
    except Exception:
        with cupy.cuda.Device(device_index):
            for p in ptrs:
                try:
                    rt.free(p)
                except Exception:  # noqa: BLE001 - best effort on the failure path
                    pass
        raise
    shared = _Shared(tuple(ptrs), device_index)
    return [LocalSymmetricView(shared, r, nbytes) for r in range(world_size)]
