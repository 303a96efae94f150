"""Symmetric device buffers over CUDA IPC: one buffer per rank, every rank maps every peer's.

Mechanism: each rank cudaMalloc's its own buffer (cupy.cuda.runtime.malloc), exports it with
cudaIpcGetMemHandle, the handles travel over the group's CPU side channel (torch.distributed
all_gather_object), and each rank opens its peers' handles with cudaIpcOpenMemHandle (lazy peer access).
Works for W processes on W GPUs and for W processes sharing one GPU (CUDA IPC between processes on the same
device is supported). It cannot serve W ranks inside ONE process on one device: opening a handle in the process
that exported it fails, which is why detcomm/symm_mem/local.py exists for the in-process harness.

Why cupy's runtime calls rather than torch's storage._share_cuda_: torch's handle covers the caching
allocator's whole segment (callers must carry an offset and torch's cross-process ref-counting file), the
segment's lifetime belongs to the allocator (and expandable segments change the handle type), and the API is
private. A dedicated cudaMalloc per rank gives a handle for exactly our buffer and a lifetime we control:
created by create(), released by close().

Peer access is proven, not trusted: after opening, every rank writes a token into every peer's probe area
through the opened mapping with an SM store (a device copy kernel, the same path the workspace kernels take)
and reads back the token the owner wrote; each owner then checks, on its own buffer, that every peer's token
arrived. Any failure on any rank fails create() on every rank, with every rank's reason.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from ..errors import SymmMemUnavailable

PROBE_MAGIC = 0xDC0FFEE5
PROBE_SLOT_BYTES = 16


def _cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415  (lazy: detcomm imports without cupy or a GPU)
    except ImportError as e:
        raise SymmMemUnavailable("CUDA-IPC symmetric memory needs cupy (cupy-cuda12x / cupy-cuda13x)") from e
    return cupy


def _u32_view(cupy: Any, ptr: int, count: int, device_index: int) -> Any:
    """A cupy uint32 array over raw device memory that cupy does not own (so it never frees it)."""
    mem = cupy.cuda.UnownedMemory(ptr, count * 4, None, device_index)
    return cupy.ndarray((count,), dtype=cupy.uint32, memptr=cupy.cuda.MemoryPointer(mem, 0))


def probe_token(writer: int, owner: int, nonce: int) -> np.ndarray:
    return np.array([PROBE_MAGIC, writer, owner, nonce & 0xFFFFFFFF], dtype=np.uint32)


def write_probe(cupy: Any, base_ptr: int, probe_offset: int, writer: int, owner: int, nonce: int, device_index: int) -> None:
    """Store writer's token into owner's probe slot [writer] via a device copy kernel (SM stores through base_ptr)."""
    dst = _u32_view(cupy, base_ptr + probe_offset + writer * PROBE_SLOT_BYTES, 4, device_index)
    dst[...] = cupy.asarray(probe_token(writer, owner, nonce))


def read_probe(cupy: Any, base_ptr: int, probe_offset: int, slot: int, device_index: int) -> np.ndarray:
    """Load probe slot [slot] through base_ptr with a device copy kernel (SM loads), then bring it to the host."""
    src = _u32_view(cupy, base_ptr + probe_offset + slot * PROBE_SLOT_BYTES, 4, device_index)
    return cupy.asnumpy(src.copy())


class IpcSymmetricBuffer:
    """This rank's view of a group of symmetric buffers. `ptrs[p]` is rank p's buffer as mapped here.

    Lifecycle:
    - `create(...)` (collective over `group`): allocate, exchange handles, open, prove peer access.
      On failure every rank raises SymmMemUnavailable and has released what it allocated or opened.
    - `close()` (collective): waits for the device, meets the peers, unmaps peers' buffers, meets again so no
      peer still maps ours, then frees our buffer.
    - `abort()` (local, for failures): never talks to peers and never waits on the device. The object is
      unusable afterwards; our buffer and our mappings of the peers' buffers stay allocated until the process
      exits (a peer's kernel may still be writing barrier flags into our buffer, and freeing memory under a
      running kernel is worse than leaking it; the driver reclaims everything at process exit).
    """

    def __init__(self, *, group: Any, rank: int, world_size: int, device_index: int, nbytes: int,
                 own_ptr: int, ptrs: tuple[int, ...]) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device_index = device_index
        self.nbytes = nbytes
        self._own_ptr = own_ptr
        self.ptrs = ptrs
        self.closed = False

    # ---- creation --------------------------------------------------------------------------------------
    @classmethod
    def create(cls, nbytes: int, *, group: Any, device_index: int, probe_offset: int) -> IpcSymmetricBuffer:
        """Collective over `group` (a torch.distributed ProcessGroup or None for the default group)."""
        import torch.distributed as dist  # noqa: PLC0415

        if nbytes <= probe_offset + 8 * PROBE_SLOT_BYTES:
            raise ValueError(f"nbytes {nbytes} leaves no room for the probe area at {probe_offset}")
        rank, world = dist.get_rank(group), dist.get_world_size(group)

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * world
            dist.all_gather_object(out, obj, group=group)
            return out

        cupy = _cupy()
        rt = cupy.cuda.runtime
        own = 0
        opened: dict[int, int] = {}

        def release() -> None:
            with cupy.cuda.Device(device_index):
                for p in opened.values():
                    try:
                        rt.ipcCloseMemHandle(p)
                    except Exception:  # noqa: BLE001 - best effort on the failure path
                        pass
                if own:
                    try:
                        rt.free(own)
                    except Exception:  # noqa: BLE001
                        pass

        def fail_if_any(stage: str, errs: list[Any]) -> None:
            # Every rank sees the same errs (gathered), so all release and raise together.
            bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
            if bad:
                release()
                raise SymmMemUnavailable(f"symmetric memory {stage} failed: " + "; ".join(bad))

        nonce = secrets.randbits(32)
        err, handle = None, None
        try:
            with cupy.cuda.Device(device_index):
                own = rt.malloc(nbytes)
                rt.memset(own, 0, nbytes)
                write_probe(cupy, own, probe_offset, rank, rank, nonce, device_index)  # the owner's own token
                rt.deviceSynchronize()
                handle = rt.ipcGetMemHandle(own)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            err = f"allocate/export: {e}"
        infos = gather((err, handle, nonce))
        fail_if_any("allocation", [i[0] for i in infos])

        # Stage 2: open every peer's handle, write our token into its probe slot, read back the owner's token.
        err = None
        try:
            with cupy.cuda.Device(device_index):
                for p in range(world):
                    if p == rank:
                        continue
                    opened[p] = rt.ipcOpenMemHandle(infos[p][1])
                    write_probe(cupy, opened[p], probe_offset, rank, p, infos[rank][2], device_index)
                    got = read_probe(cupy, opened[p], probe_offset, p, device_index)
                    if not np.array_equal(got, probe_token(p, p, infos[p][2])):
                        raise SymmMemUnavailable(f"read of rank {p}'s buffer through its IPC handle returned {got.tolist()}")
                rt.deviceSynchronize()
        except Exception as e:  # noqa: BLE001
            err = f"open/probe peers: {e}"
        errs = gather(err)
        fail_if_any("peer mapping", errs)

        # Stage 3: every peer's write must be visible in our own buffer, read by the owner.
        err = None
        try:
            with cupy.cuda.Device(device_index):
                for p in range(world):
                    got = read_probe(cupy, own, probe_offset, p, device_index)
                    if not np.array_equal(got, probe_token(p, rank, infos[p][2])):
                        raise SymmMemUnavailable(f"rank {p}'s write through our IPC handle did not arrive (read {got.tolist()})")
        except Exception as e:  # noqa: BLE001
            err = f"probe read-back: {e}"
        errs = gather(err)
        fail_if_any("peer-access proof", errs)

        ptrs = tuple(own if p == rank else opened[p] for p in range(world))
        return cls(group=group, rank=rank, world_size=world, device_index=device_index, nbytes=nbytes,
                   own_ptr=own, ptrs=ptrs)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def exchange(self, obj: Any) -> list[Any]:
        """Collective: every rank's `obj`, in rank order (the group's CPU side channel)."""
        import torch.distributed as dist  # noqa: PLC0415

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        """Collective: release the peers' mappings and our buffer. Idempotent after success."""
        if self.closed:
            return
        cupy = _cupy()
        rt = cupy.cuda.runtime
        with cupy.cuda.Device(self.device_index):
            rt.deviceSynchronize()  # our kernels no longer touch any buffer
            self.exchange(None)  # ... nor do the peers' kernels
            for p, ptr in enumerate(self.ptrs):
                if p != self.rank:
                    rt.ipcCloseMemHandle(ptr)
            self.exchange(None)  # no peer maps our buffer any more
            rt.free(self._own_ptr)
        self.closed = True

    def abort(self) -> None:
        """Local: mark unusable; leaves memory and mappings to process exit (see the class docstring)."""
        self.closed = True
