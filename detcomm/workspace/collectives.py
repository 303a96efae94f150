"""The workspace's collective calls as a caller makes them (Workspace's base class): each checks its tensors, binds
its call shape (Workspace.bind: the options checked once per shape) and runs it (Workspace.run), or, for the
site-bound calls (bind_all_reduce, bind_all_reduce_tree), binds once and leaves the tensors' checks to the
communicator; and the variants a site's calls reach (plan.reached), which the self-checks run forced.

Inputs are contiguous tensors on the workspace's device, [rows, *trailing], rows along dim 0 (the slab families:
[S, rows, *trailing] fp32). reduce_scatter and all_gather launch their one kernel each here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from ..dtypes import FLOAT_DTYPES, FLOAT_NAMES, info, name_of
from ..errors import WorkspaceUnavailable
from . import plan
from .kernels import KernelSet
from .launch import BoundCall, InFlight


def _u64(x: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(x)


def _i64(x: int) -> ctypes.c_int64:
    return ctypes.c_int64(x)


class Collectives:
    """The collective calls of a Workspace (every rank must make them, in the same order, with the same shapes)."""

    # Set by Workspace (detcomm/workspace/workspace.py).
    world_size: int
    grid: int
    capacity_bytes: int
    one_shot_max_bytes: int
    one_store_max_bytes: int
    device: torch.device
    refused: dict[str, str]
    _kernels: KernelSet
    _slot_bytes: int
    _dead: str | None
    _ctrl: Any
    _tail: list[Any]
    _record_path: Callable[[tuple[str, str, str]], None] | None
    _in_flight: InFlight
    bind: Callable[..., BoundCall]
    run: Callable[..., None]
    check: Callable[[], None]
    _next_call: Callable[[str | None], int]

    # ---- the variants a site's calls reach (plan.reached: the rule over its breakpoints) --------------------
    def variants(self, collective: str, dtype: torch.dtype, row_numel: int, max_rows: int) -> list[str]:
        """LOCAL: the code paths calls of a site can take (plan.variants: "one_store", "one_shot", "two_shot",
        "reduce_scatter", "all_gather", "chunked"); [] when the workspace cannot serve it (a row larger than a
        launch, or a dtype whose kernels were refused). The self-checks run each before the site's first use:
        all_reduce(algo=...) forces a kernel, chunk_rows=1 (with 2+ rows) forces chunking."""
        if collective == "all_gather":
            module, elem = "bytes", torch.empty((), dtype=dtype).element_size()
        else:
            if dtype not in FLOAT_DTYPES:
                raise ValueError(f"the workspace folds float32, bfloat16 and float16, got {dtype}")
            module, elem = name_of(dtype), info(dtype).size
        if module in self.refused:
            return []
        return plan.variants(collective, row_bytes=row_numel * elem, max_rows=max_rows, world_size=self.world_size,
                             capacity_bytes=self.capacity_bytes, one_shot_max_bytes=self.one_shot_max_bytes,
                             one_store_max=self.one_store_max_bytes)

    def family_variants(self, family: str, dtype: torch.dtype, row_numel: int, max_rows: int, *,
                        shards: int = 1) -> list[str]:
        """LOCAL: the code paths calls of 1..max_rows rows of an all-reduce family's site reach (plan.reached over
        plan.rows_per_launch; the fused families' carry the prefix "fused_"); [] when the workspace cannot serve
        it (output dtype refused, the tree kernels not folding V = shards * W here, a row larger than a launch)."""
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"the workspace folds into {list(FLOAT_NAMES)}, got {dtype}")
        name = name_of(dtype)
        if name in self.refused or (family in ("tree", "fused_tree")
                                    and plan.tree_refusal(shards * self.world_size, self.world_size)):
            return []
        per = plan.rows_per_launch(family, row_elems=row_numel, dtype=name, shards=shards,
                                   capacity_bytes=self.capacity_bytes, world_size=self.world_size, grid=self.grid)
        got = plan.reached(family, per, max_rows, row_elems=row_numel, dtype=name, shards=shards,
                           one_store_max=self.one_store_max_bytes if "one_store" in plan.FAMILY_ALGOS[family] else 0,
                           one_shot_max_bytes=self.one_shot_max_bytes)
        return [f"fused_{v}" for v in got] if family.startswith("fused") else got

    # The families' variants by the names ipc_fold asks them by (and the tests' stand-in workspaces answer).
    def virtual_variants(self, dtype: torch.dtype, row_numel: int, max_rows: int, shards_per_rank: int) -> list[str]:
        """LOCAL: family_variants of a shard-order virtual-shard site ("one_shot", "two_shot", "chunked")."""
        return self.family_variants("virtual", dtype, row_numel, max_rows, shards=shards_per_rank)

    def tree_variants(self, dtype: torch.dtype, row_numel: int, max_rows: int, shards_per_rank: int) -> list[str]:
        """LOCAL: family_variants of a tree-order site ("one_store", "one_shot", "two_shot", "chunked")."""
        return self.family_variants("tree", dtype, row_numel, max_rows, shards=shards_per_rank)

    def fused_norm_variants(self, dtype: torch.dtype, hidden: int, max_rows: int) -> list[str]:
        """LOCAL: family_variants of the fused kernels ("fused_one_store", ..., "fused_chunked")."""
        return self.family_variants("fused", dtype, hidden, max_rows)

    def fused_norm_tree_variants(self, dtype: torch.dtype, hidden: int, max_rows: int) -> list[str]:
        """LOCAL: family_variants of the fused tree kernels ("fused_one_shot", "fused_two_shot", "fused_chunked")."""
        return self.family_variants("fused_tree", dtype, hidden, max_rows)

    def fused_norm_layout(self, dtype: torch.dtype, hidden: int) -> str:
        """LOCAL: how the fused kernels cover rows of `hidden` elements (plan.fused_norm_layout: "registers",
        "wide" or "streaming"), from the site's static facts and this workspace's W."""
        return self._kernels.fused_norm_layout(hidden, name_of(dtype))

    # ---- collectives -----------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor | None = None, algo: str | None = None,
                   chunk_rows: int | None = None, label: str | None = None) -> torch.Tensor:
        """COLLECTIVE. SUM of x over the group by the canonical fold; every rank gets identical bits.

        algo: None chooses per launch (plan.launch_kernel: the one-store kernel up to one_store_max_bytes, one-shot
        up to one_shot_max_bytes, two-shot above); "one_store" / "one_shot" / "two_shot" force one (self-checks,
        tests, bench; a forced "one_store" launch carries at most one_store_max_bytes, and one row larger raises).
        chunk_rows: rows per launch (default: as many as the capacity holds; smaller forces chunking). label: named
        in failure messages (the site). All choices and any chunking give the same bits."""
        dtype = self._fold_dtype(x)
        out = self._output(x, out, tuple(x.shape))
        rows, row_elems, _ = self._rows(x)
        if rows and row_elems:
            call = self.bind("plain", dtype, row_elems, algo=algo, chunk_rows=chunk_rows, label=label)
            self.run(call, (x.data_ptr(), out.data_ptr()), rows)
        return out

    def bind_all_reduce(self, dtype: torch.dtype, row_numel: int, *, label: str | None = None
                        ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """LOCAL, once per site: the site's all-reduce as ``call(x, out) -> out`` (COLLECTIVE when called), bound
        here (bind), so a call does O(1) work: a liveness check, the output, the launches. ``x`` and ``out`` (None:
        allocated) must already be validated as the communicator does before any route sees them: contiguous, on
        this device, the site's dtype and row width, and ``out`` either separate from x or x itself. In place
        (``out`` is x) is exact: in every launch (one-store, one-shot, two-shot, each chunk) the thread that writes
        an element of ``out`` is the one that copied (or pushed) that element of x, and it did so before the START
        barrier (one-store: before its first wait), while every write to ``out`` comes after it (the kernels' pack
        ownership, csrc/detcomm_common.cuh "Work assignment"); at W = 1 the kernels fold x straight into out, each
        pack loaded and then stored by the same thread; chunks cover disjoint rows. A call that fails midway leaves
        x partly overwritten."""
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"the workspace folds {list(FLOAT_NAMES)}, got {dtype}")
        bound = self.bind("plain", name_of(dtype), row_numel, label=label)
        run, empty_like, ctrl = self.run, torch.empty_like, self._ctrl.words

        def call(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            if self._dead is not None or ctrl[0]:
                self.check()
            assert x.dtype is dtype, (x.dtype, dtype)  # the communicator checked the site's dtype
            out = empty_like(x) if out is None else out
            run(bound, (x.data_ptr(), out.data_ptr()), x.shape[0])
            return out

        return call

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps32: float, *,
                           algo: str | None = None, chunk_rows: int | None = None,
                           label: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """COLLECTIVE. (y, r) of docs/spec.md §9.2 in one kernel per launch: s = the canonical fold of x, r =
        round(residual + s), y = the canonical RMSNorm of r; the same bits as all_reduce then
        detcomm.numerics.norm.add_rms_norm. x, residual: contiguous [rows, H] of one float dtype; weight: [H] of any
        float dtype; eps32: eps already rounded to fp32 (detcomm.numerics.norm validates all of it). algo: None
        chooses per launch (plan.launch_kernel, family "fused": the one-store kernel up to
        plan.fused_norm_one_store_rows rows, one-shot up to one_shot_max_bytes, two-shot above) or forces one;
        chunk_rows forces chunking as in all_reduce. Every choice gives the same bits."""
        dtype = self._fold_dtype(x)
        assert x.dim() == 2 and residual.shape == x.shape and weight.shape == x.shape[1:], (x.shape, weight.shape)
        rows, hidden = x.shape
        y, r = torch.empty_like(x), torch.empty_like(x)
        if rows and hidden:
            call = self.bind("fused", dtype, hidden, weight=name_of(weight.dtype), algo=algo, chunk_rows=chunk_rows,
                             label=label)
            self.run(call, (x.data_ptr(), residual.data_ptr(), weight.data_ptr(), y.data_ptr(), r.data_ptr()), rows,
                     eps=eps32)
        return y, r

    def all_reduce_rmsnorm_tree(self, partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps32: float, *, algo: str | None = None, chunk_rows: int | None = None,
                                label: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """COLLECTIVE. (y, r) of docs/spec.md §9.2 whose step 1 is the tree-order virtual-shard all-reduce (§9.1,
        shard_fold="tree") of ``partials``, this rank's contiguous fp32 [S, rows, H] (S = V/W; slab j is global
        shard rank*S + j), in one kernel per launch (csrc/fused_rmsnorm.cu, the tree variants): the same bits as
        all_reduce_tree then detcomm.numerics.norm.add_rms_norm. residual: contiguous [rows, H] of the site's dtype;
        weight: [H] of any float dtype; eps32 as all_reduce_rmsnorm. algo: None chooses per launch by the rows'
        bytes in the site's dtype (plan.launch_kernel, family "fused_tree"), or forces one; chunk_rows forces
        chunking. Every choice gives the same bits."""
        dtype = self._fold_dtype(residual)
        self._check_tensor(partials)
        if partials.dtype != torch.float32 or partials.dim() != 3 or partials.shape[1:] != residual.shape:
            raise ValueError(f"partials must be float32 [S, rows, H] with [rows, H] = the residual's "
                             f"{list(residual.shape)}, got {partials.dtype} {list(partials.shape)}")
        assert residual.dim() == 2 and weight.shape == residual.shape[1:], (residual.shape, weight.shape)
        rows, hidden = residual.shape
        y, r = torch.empty_like(residual), torch.empty_like(residual)
        call = self.bind("fused_tree", dtype, max(hidden, 1), shards=partials.shape[0], weight=name_of(weight.dtype),
                         algo=algo, chunk_rows=chunk_rows, label=label)
        if rows and hidden:
            self.run(call, (partials.data_ptr(), residual.data_ptr(), weight.data_ptr(), y.data_ptr(),
                            r.data_ptr()), rows, eps=eps32)
        return y, r

    def all_reduce_virtual(self, partials: torch.Tensor, *, dtype: torch.dtype, out: torch.Tensor | None = None,
                           algo: str | None = None, chunk_rows: int | None = None,
                           label: str | None = None) -> torch.Tensor:
        """COLLECTIVE. The virtual-shard all-reduce of docs/spec.md §9.1: ``partials`` is this rank's contiguous
        fp32 [S, rows, *shape] (S = V/W; slab j is global shard rank*S + j, the same S on every rank); returns
        [rows, *shape] in ``dtype``: the fold over the V shards in global order from +0.0 in fp32, rounded once,
        identical on every rank and for every W dividing V. algo: None chooses per launch by its fp32 input bytes
        (plan.launch_kernel, family "virtual"); "one_shot" / "two_shot" force one. chunk_rows: rows per launch
        (default: plan.virtual_rows_per_launch; smaller forces chunking). Every choice gives the same bits."""
        return self._slab_call("virtual", partials, dtype, out, algo, chunk_rows, label)

    def all_reduce_tree(self, partials: torch.Tensor, *, dtype: torch.dtype, out: torch.Tensor | None = None,
                        algo: str | None = None, chunk_rows: int | None = None,
                        label: str | None = None) -> torch.Tensor:
        """COLLECTIVE. The tree-order virtual-shard all-reduce of docs/spec.md §9.1 (shard_fold="tree"):
        ``partials`` is this rank's contiguous fp32 [S, rows, *shape] (S = V/W, a power of two, the same on every
        rank; W a power of two; slab j is global shard rank*S + j); returns [rows, *shape] in ``dtype``: the
        balanced binary tree over the V shards in global order (every node one fp32 add), +0.0 at the root, one
        rounding, identical on every rank and for every W dividing V. Each rank folds its own subtree in the kernel
        that publishes it, so one fp32 row per rank crosses the workspace. algo: None chooses per launch
        (plan.launch_kernel, family "tree"), or forces one (a forced "one_store" launch carries at most
        one_store_max_bytes). chunk_rows: rows per launch (default: plan.tree_rows_per_launch). Every choice gives
        the same bits."""
        return self._slab_call("tree", partials, dtype, out, algo, chunk_rows, label)

    def _slab_call(self, family: str, partials: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None,
                   algo: str | None, chunk_rows: int | None, label: str | None) -> torch.Tensor:
        self._check_tensor(partials)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"the workspace folds into {list(FLOAT_NAMES)}, got {dtype}")
        if partials.dtype != torch.float32 or partials.dim() < 2 or partials.shape[0] < 1:
            raise ValueError(f"partials must be float32 [S >= 1, rows, *shape], got {partials.dtype} "
                             f"{list(partials.shape)}")
        shape = tuple(partials.shape[1:])
        out = self._output(partials, out, shape, dtype=dtype)
        rows, row_elems = shape[0], out[0].numel() if shape[0] else 0
        call = self.bind(family, name_of(dtype), max(row_elems, 1), shards=partials.shape[0], algo=algo,
                         chunk_rows=chunk_rows, label=label)
        if rows and row_elems:
            self.run(call, (partials.data_ptr(), out.data_ptr()), rows)
        return out

    def bind_all_reduce_tree(self, dtype: torch.dtype, row_numel: int, shards_per_rank: int, *,
                             label: str | None = None) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """LOCAL, once per site: the tree-order all-reduce of a site as ``call(partials, out) -> out`` (COLLECTIVE
        when called), bound here (as bind_all_reduce). ``partials`` must already be validated as the communicator
        does: contiguous fp32 [shards_per_rank, rows, *shape] on this device with rows * prod(shape) = rows *
        row_numel; ``out`` (None: allocated) a separate contiguous tensor of ``dtype``."""
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"the workspace folds {list(FLOAT_NAMES)}, got {dtype}")
        bound = self.bind("tree", name_of(dtype), row_numel, shards=shards_per_rank, label=label)
        run, ctrl = self.run, self._ctrl.words

        def call(partials: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            if self._dead is not None or ctrl[0]:
                self.check()
            assert partials.dtype is torch.float32 and partials.shape[0] == shards_per_rank, partials.shape
            if out is None:
                out = torch.empty(partials.shape[1:], dtype=dtype, device=partials.device)
            run(bound, (partials.data_ptr(), out.data_ptr()), partials.shape[1])
            return out

        return call

    def reduce_scatter(self, x: torch.Tensor, *, out: torch.Tensor | None = None, chunk_rows: int | None = None,
                       label: str | None = None) -> torch.Tensor:
        """COLLECTIVE. x is [W * R, *trailing]; rank r gets the canonical fold over ranks of rows [r*R, (r+1)*R).
        chunk_rows: shard rows per launch (smaller than the capacity allows forces chunking)."""
        dtype = self._fold_dtype(x)
        rows, row_elems, row_bytes = self._rows(x)
        if rows % self.world_size:
            raise ValueError(f"reduce_scatter needs rows divisible by the world size {self.world_size}, got {rows}")
        shard = rows // self.world_size
        out = self._output(x, out, (shard, *x.shape[1:]))
        if shard == 0 or row_elems == 0:
            return out
        sfx = plan.DTYPE_SUFFIX[dtype]
        per = self._per_chunk(row_bytes, chunk_rows, self.world_size)
        with self._in_flight as stream_ptr:
            for a, b in plan.chunks(shard, per):
                geo = plan.reduce_scatter_slices(b - a, row_elems, dtype, self.grid)
                assert geo.slot_bytes_used(self.world_size) <= self._slot_bytes, (geo, self._slot_bytes)
                self._launch(f"detcomm_reduce_scatter_{sfx}",
                             [_u64(x.data_ptr() + a * row_bytes), _i64(shard * row_elems),
                              _u64(out.data_ptr() + a * row_bytes), _i64(geo.length), _i64(geo.stride_packs)],
                             stream_ptr, label)
                self._record(("reduce_scatter", dtype, "reduce_scatter"))
            if shard > per:
                self._record(("reduce_scatter", dtype, "chunked"))
        return out

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None, chunk_rows: int | None = None,
                   label: str | None = None) -> torch.Tensor:
        """COLLECTIVE. x is [R, *trailing] on every rank; returns [W * R, *trailing], rank r's rows at r*R.
        Data movement only (any dtype). chunk_rows: rows per launch (smaller forces chunking)."""
        self._check_tensor(x)
        if "bytes" in self.refused:
            raise WorkspaceUnavailable(f"the workspace's all-gather kernel was refused: {self.refused['bytes']}")
        rows, row_elems, row_bytes = self._rows(x)
        out = self._output(x, out, (self.world_size * rows, *x.shape[1:]))
        if rows == 0 or row_bytes == 0:
            return out
        per = self._per_chunk(row_bytes, chunk_rows, 1)
        dt = str(x.dtype).removeprefix("torch.")
        with self._in_flight as stream_ptr:
            for a, b in plan.chunks(rows, per):
                self._launch("detcomm_all_gather",
                             [_u64(x.data_ptr() + a * row_bytes), _u64(out.data_ptr() + a * row_bytes),
                              _i64((b - a) * row_bytes), _i64(rows * row_bytes)], stream_ptr, label)
            self._record(("all_gather", dt, "all_gather"))
            if rows > per:
                self._record(("all_gather", dt, "chunked"))
        return out

    # ---- helpers ---------------------------------------------------------------------------------------
    def _record(self, path: tuple[str, str, str]) -> None:
        if self._record_path is not None:
            self._record_path(path)

    def _check_tensor(self, x: torch.Tensor) -> None:
        if self._dead is not None or self._ctrl.tagged():
            self.check()
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
        if x.device != self.device:
            raise ValueError(f"tensor on {x.device}, workspace on {self.device}")
        if x.dim() < 1:
            raise ValueError("tensor must have a row dimension (dim 0)")
        if not x.is_contiguous():
            raise ValueError("tensor must be contiguous")

    def _fold_dtype(self, x: torch.Tensor) -> str:
        self._check_tensor(x)
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"the workspace folds {list(FLOAT_NAMES)}, got {x.dtype}")
        dtype = name_of(x.dtype)
        if dtype in self.refused:
            raise WorkspaceUnavailable(f"the workspace's {dtype} kernels were refused: {self.refused[dtype]}")
        return dtype

    def _output(self, x: torch.Tensor, out: torch.Tensor | None, shape: tuple[int, ...], *,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = x.dtype if dtype is None else dtype
        if out is None:
            return torch.empty(shape, dtype=dtype, device=x.device)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != shape or out.dtype != dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape} on {x.device}")
        # Chunk k's output would overwrite chunk k+1's input (and the kernels read x while writing out): any
        # overlap of the two byte ranges is refused, before any communication.
        x0, o0 = x.data_ptr(), out.data_ptr()
        x1, o1 = x0 + x.numel() * x.element_size(), o0 + out.numel() * out.element_size()
        if x0 < o1 and o0 < x1:
            raise ValueError(f"out [{o0:#x}, {o1:#x}) overlaps x [{x0:#x}, {x1:#x}); pass a separate output tensor")
        return out

    def _per_chunk(self, row_bytes: int, chunk_rows: int | None, parts: int) -> int:
        per = plan.rows_per_chunk(self.capacity_bytes, row_bytes, parts=parts)
        if chunk_rows is None:
            return per
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int):
            raise TypeError(f"chunk_rows must be an int, got {type(chunk_rows).__name__}")
        if not 1 <= chunk_rows <= per:
            raise ValueError(f"chunk_rows must be in 1..{per} (rows one launch carries), got {chunk_rows}")
        return chunk_rows

    @staticmethod
    def _rows(x: torch.Tensor) -> tuple[int, int, int]:
        rows = x.shape[0]
        row_elems = x[0].numel() if rows else 0
        return rows, row_elems, row_elems * x.element_size()

    def _launch(self, name: str, args: list[Any], stream_ptr: int, label: str | None) -> None:
        call = self._next_call(label)
        self._kernels.launch(name, self.grid, args + [ctypes.c_uint32(call)] + self._tail, stream_ptr=stream_ptr)
