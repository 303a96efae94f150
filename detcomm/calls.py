"""One declared site's call path (``SiteCall``) and the checks of a call's arguments.

A ``SiteCall`` is built once, when its site is declared and bound: everything a call must match that depends
only on the site (dtype, trailing shape, rows, device, the output's rows and bytes per row, the call's proof and
the route) is cached then, so a call compares values and makes no decision. Every collective goes through one entry,
``SiteCall.run``: the communicator's lock, the proof that every rank makes this call (the call checker's
fingerprint with ``init(check=True)``, else the call guard, route_impls/guard.py), the bound route, and the
mapping of a library error to ``PeerTimeout`` / ``CollectiveFailed``, once per call.

The arguments a collective takes beyond its tensor (``rows_per_rank``, ``splits``, ``vocab_start``, the fused
norm's residual and weight) are checked by the functions below, which depend on no site: the communicator runs
them before it looks the site up, because the first call of an undeclared site declares it (a collective) and a
bad call must raise before any communication.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .dtypes import SUPPORTED_DTYPES, name_of
from .errors import CollectiveMismatch, ConcurrentCall, DetcommError
from .numerics import norm as _norm
from .numerics.fold import FLOAT_DTYPES
from .route_impls import guard as _guard
from .route_impls.base import Bound
from .route_impls.guard import CallHeader
from .sites import NO_ARGS, BoundRoute, CallArgs, Collective, Site
from .work import Work

if TYPE_CHECKING:
    import threading

    from .route_impls.native import NativeRoute
    from .verify import CallChecker


class CallOwner(Protocol):
    """What a SiteCall reads of the communicator that owns it (comm.Communicator): the calls sit below the
    communicator, which builds them, so they see it through this interface and never import it."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def backend_name(self) -> str: ...
    @property
    def call_guard(self) -> str: ...
    @property
    def _lock(self) -> threading.RLock: ...
    @property
    def _native(self) -> NativeRoute: ...
    @property
    def _verifier(self) -> CallChecker | None: ...

    def _declared_as(self, s: Site) -> str: ...

    def _failure(self, name: str, call: int, e: RuntimeError) -> DetcommError: ...

__all__ = ["SiteCall", "check_tensor", "busy", "check_grad", "rs_rows", "token_counts", "a2a_splits", "argmax_start", "norm_args"]

Call = Callable[[torch.Tensor, CallArgs], Any]  # a bound route, or the fused norm in its place
Proof = Callable[["SiteCall", torch.Tensor, Sequence[int] | None, bool], None]  # the proof that every rank calls

# ``CallArgs(out=t)`` built as a plain tuple: the named tuple's keyword constructor is a Python frame and costs a
# call's out= path about twice as much (bench/host_path.py).
_new_tuple = tuple.__new__
_Tensor = torch.Tensor  # a module global: ``torch.Tensor`` is a second lookup on every check
assert CallArgs._fields[-1] == "out", "SiteCall.call builds CallArgs with out as its last field"
_BEFORE_OUT = tuple(NO_ARGS[:-1])


class SiteCall:
    """One declared site's call path, built once at declaration; every entry (eager, ``out=``, async, the fused
    norm, graph capture) goes through it.

    ``check(x, out)`` is the site's one validator: each fact a call must match (type, dtype, trailing shape,
    rows, device, contiguity, autograd, the output's shape, dtype, device and overlap) is one comparison against
    a value cached here, and a failed comparison raises its precise error, before any communication.
    ``run(x, args)`` is the one way a call reaches the route: it refuses a second thread, counts the site's user
    calls, proves across ranks that every rank makes this call (``init(check=True)``'s full comparison, else the
    call guard: its separate fixed-size header, or the header the route carries in its messages, armed here;
    route_impls/guard.py), calls the bound route and turns a library error into a
    ``PeerTimeout`` or ``CollectiveFailed`` that names the site, the call, this rank and the cause."""

    __slots__ = ("comm", "site", "name", "_bound", "_call", "collective", "op", "dtype", "in_dtype", "ndim", "row_dim",
                 "width", "tail", "lead", "max_rows", "device", "cpu", "index", "in_place", "mul", "div", "same_shape",
                 "x_row_bytes", "out_row_bytes", "_header", "message", "_prove", "calls", "virtual", "fused", "agreed",
                 "_lock")

    def __init__(self, comm: CallOwner, site: Site, bound: BoundRoute) -> None:
        self.comm = comm
        self.site = site
        self.name = site.name
        self.bound = bound
        self.collective = site.collective
        self.op = site.op
        self.dtype = site.dtype
        v = site.virtual_shards
        self.virtual = v is not None
        # A virtual-shard call passes this rank's V/W fp32 partials [V/W, rows, *shape] (docs/spec.md §9.1).
        self.lead: tuple[int, ...] = () if v is None else (v // comm.world_size,)
        self.in_dtype = torch.float32 if self.virtual else site.dtype
        self.row_dim = len(self.lead)
        self.ndim = self.row_dim + 1 + len(site.shape)
        self.tail = site.shape
        # One trailing dimension (a hidden size: the usual site) is compared as an int: slicing a torch.Size
        # builds a new one on every call. None: compare the whole trailing shape.
        self.width = site.shape[0] if len(site.shape) == 1 and not self.virtual else None
        self.max_rows = site.max_rows
        self.device = comm.device
        # A tensor is on the communicator's device when it is a CPU tensor (cpu) or a CUDA tensor of this index:
        # two queries of the tensor, where ``x.device != device`` builds a torch.device on every call.
        self.cpu = comm.device == torch.device("cpu")
        self.index = comm.device.index
        self.in_place = bound.in_place and not self.virtual
        # The output's rows are the input's * mul // div; a reduce_scatter's input rows must divide by div.
        self.mul = comm.world_size if site.collective is Collective.ALL_GATHER else 1
        self.div = comm.world_size if site.collective is Collective.REDUCE_SCATTER else 1
        self.same_shape = self.mul == self.div == 1 and not self.virtual  # out's shape is x's
        # The bytes of one row of x and of out: a checked tensor's extent is its rows times these (the overlap test).
        row = site.row_numel
        self.x_row_bytes = row * math.prod(self.lead) * self.in_dtype.itemsize
        self.out_row_bytes = row * site.dtype.itemsize
        self.calls = 0  # this site's user calls on this communicator (named in errors; self-checks not counted)
        self.fused = getattr(bound, "fused", None)  # the workspace's fused norm kernel, where routing chose it
        self.agreed = False  # the next call's fingerprint was already compared (Communicator._resolve)
        self._lock = comm._lock  # one collective call at a time per communicator: the ranks pair calls by order
        # The call guard (route_impls/guard.py): the separate header, or the one the route carries in its messages;
        # setting ``header`` chooses the call's proof (``_prove``) again.
        self.message = getattr(bound, "guard", None)
        self.header = (CallHeader(site, native=comm._native, device=comm.device)
                       if comm.call_guard == _guard.HEADER else None)

    @property
    def bound(self) -> BoundRoute:
        """The site's bound route: what every call runs (replaceable, as the tests' spies do)."""
        return self._bound

    @bound.setter
    def bound(self, bound: BoundRoute) -> None:
        self._bound = bound
        # A route_impls.base.Bound's own method, called directly: its __call__ would be one more frame per call.
        self._call: Call = bound.call if isinstance(bound, Bound) else bound

    @property
    def header(self) -> CallHeader | None:
        """The call guard's separate header (None: the communicator's guard is another; tests remove it)."""
        return self._header

    @header.setter
    def header(self, header: CallHeader | None) -> None:
        self._header = header
        # The one proof every call of this site makes, chosen once: the communicator's guard mode is static. The
        # class's function, called with self: a bound method stored on its own instance is a reference cycle, which
        # kept every SiteCall (and through its header the native backend and the process group) alive past
        # ``close`` until a garbage collection, one that can come at interpreter exit, where gloo's worker threads
        # abort the process (tests/test_shutdown_frees_the_group.py).
        self._prove: Proof | None = (SiteCall._fingerprint if self.comm._verifier is not None
                                     else SiteCall._exchange if header is not None
                                     else SiteCall._arm if self.message is not None else None)

    def check(self, x: object, out: object) -> torch.Tensor | None:
        """Validate a call (see the class docstring); returns what the route gets as ``CallArgs.out`` (None:
        it allocates, and the collective copies the result into ``out``)."""
        if type(x) is not _Tensor and not isinstance(x, _Tensor):
            raise TypeError(f"site {self.name!r}: expected a torch.Tensor, got {type(x).__name__}")
        sh = x.shape
        if (len(sh) != self.ndim or x.dtype is not self.in_dtype
                or (sh[1] != self.width if self.width is not None else sh[self.row_dim + 1:] != self.tail)
                or (self.virtual and sh[0] != self.lead[0])):
            self._contradiction(x)
        rows = sh[self.row_dim]
        if rows > self.max_rows:
            raise ValueError(f"site {self.name!r}: {rows} rows exceed the declared max_rows={self.max_rows}; "
                             "declare the site with a larger max_rows (the most rows it will ever carry)")
        if rows % self.div:
            raise ValueError(rs_rows(self.name, rows, self.div))
        if (not x.is_cpu) if self.cpu else (not x.is_cuda or x.get_device() != self.index):
            check_tensor(self.name, x, device=self.device, backend=self.comm.backend_name)
        if not x.is_contiguous():
            raise ValueError(f"site {self.name!r}: tensor is not contiguous; pass x.contiguous()")
        if x.requires_grad:
            check_grad(self.name, x)
        if out is None:
            return None
        if out is x:
            return x if self.in_place else None
        if type(out) is not _Tensor and not isinstance(out, _Tensor):
            raise TypeError(f"site {self.name!r}: out must be a torch.Tensor, got {type(out).__name__}")
        osh = out.shape
        if self.same_shape:
            bad = osh != sh
        else:
            bad = (len(osh) != 1 + len(self.tail) or osh[0] != rows * self.mul // self.div
                   or osh[1:] != sh[self.row_dim + 1:])
        if (bad or out.dtype is not self.dtype
                or ((not out.is_cpu) if self.cpu else (not out.is_cuda or out.get_device() != self.index))):
            want = [rows * self.mul // self.div, *self.tail]
            raise ValueError(
                f"site {self.name!r}: out must be a {name_of(self.dtype)} tensor of shape {want} on {self.device}, "
                f"got {str(out.dtype).replace('torch.', '')} {list(osh)} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(f"site {self.name!r}: out is not contiguous; pass a contiguous buffer")
        a, b = out.data_ptr(), x.data_ptr()
        if a == b:  # x's bytes (x itself, or another view of them): in place
            return out if self.in_place else None
        # Both extents from the checked shapes: x holds rows rows, out osh[0] (nbytes would be two more queries).
        if a < b + rows * self.x_row_bytes and b < a + osh[0] * self.out_row_bytes:
            raise ValueError(f"site {self.name!r}: out partially overlaps the input; pass out=x (in place) or a "
                             "separate buffer")
        return None if self.virtual else out

    def _contradiction(self, x: torch.Tensor) -> None:
        name, s = self.name, self.site
        if x.dim() < 1:
            raise ValueError(f"site {name!r}: expected a tensor of rows (at least 1-D, dim 0 = rows), got a 0-d tensor")
        if self.virtual:
            k, v = self.lead[0], s.virtual_shards
            r = self.comm.rank
            want = f"float32 [V/W={k}, rows, {', '.join(map(str, s.shape))}]"
            mine = f"this rank's {k} fp32 partial sums (shards {r * k}..{r * k + k - 1} of {v})"
            if x.dtype != torch.float32:
                raise ValueError(f"site {name!r}: a virtual-shard call takes {mine} as {want}; got dtype "
                                 f"{str(x.dtype).replace('torch.', '')}: pass the GEMM's fp32 partials "
                                 "(out_dtype=torch.float32), not values rounded to the output dtype")
            raise ValueError(f"site {name!r}: a virtual-shard call takes {mine} as {want}; got shape "
                             f"{list(x.shape)}: stack this rank's shards on dim 0 (V={v}, W={self.comm.world_size})")
        problems = []
        if x.dtype != s.dtype:
            problems.append(f"dtype {str(x.dtype).replace('torch.', '')} != {name_of(s.dtype)}")
        if tuple(x.shape[1:]) != s.shape:
            problems.append(f"trailing shape {tuple(x.shape[1:])} != {s.shape}")
        raise ValueError(
            f"site {name!r} was {self.comm._declared_as(s)}; this call contradicts it: {'; '.join(problems)}. "
            "A site is static: declare another site for this call (or cast/reshape the input)."
        )

    # -- the collectives: each validates what depends on the site, then the one entry ---------------------------
    def call(self, x: torch.Tensor, out: torch.Tensor | None, async_op: bool) -> torch.Tensor | Work:
        """A plain collective (all_reduce, reduce_scatter, all_gather): validate, run, deliver into ``out``
        where given, wrap in a ``Work`` for ``async_op``. Collective."""
        target = self.check(x, out)
        result = self.run(x, NO_ARGS if target is None else _new_tuple(CallArgs, (*_BEFORE_OUT, target)))
        if out is not None and result is not out:
            out.copy_(result)
            result = out
        return Work(result) if async_op else result

    def norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """An all_reduce_residual_rmsnorm call: x as every call of the site (``check``: a virtual-shard site's fp32
        partials [V/W, rows, *shape]), the residual as the all-reduced rows ([rows, *shape] in the site's dtype,
        on this communicator's device), the weight [H] and eps, before any communication; then the fused kernel
        where routing chose it, else the all-reduce and the canonical norm. Collective."""
        what = f"site {self.name!r}: all_reduce_residual_rmsnorm"
        if not self.virtual:
            _norm._check_add(what, x, residual, weight)
        self.check(x, None)
        if self.virtual:
            _norm.check_residual(what, residual, weight, dtype=self.dtype, shape=tuple(x.shape[1:]),
                                 device=self.device)
        _norm.eps_fp32(eps)
        fused = self.fused
        if fused is None:
            return _norm.add_rms_norm(self.run(x, NO_ARGS), residual, weight, eps=eps)
        return self.run(x, NO_ARGS, route=lambda x, _a: fused(x, residual, weight, eps))  # type: ignore[no-any-return]

    def token_all_gather(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``counts``: ``token_counts``'s rows_per_rank. Collective."""
        if max(counts) > self.max_rows:
            raise ValueError(f"site {self.name!r}: rows_per_rank {counts} exceeds the declared max_rows="
                             f"{self.max_rows}; declare the site with a larger max_rows")
        self.check(x, None)
        return self.run(x, CallArgs(rows_per_rank=tuple(counts)), rows_per_rank=counts)  # type: ignore[no-any-return]

    def all_to_all(self, x: torch.Tensor, in_splits: list[int] | None, known: list[int] | None) -> torch.Tensor:
        """``a2a_splits``'s counts: even blocks (None), else ``in_splits`` with the received counts ``known`` (proven
        against the senders') or exchanged, under the call's lock, after its guard. Collective."""
        self.check(x, None)
        comm = self.comm
        w = comm.world_size
        if in_splits is None:
            n = x.shape[0] // w
            return self.run(x, CallArgs(in_splits=(n,) * w, out_splits=(n,) * w))  # type: ignore[no-any-return]
        splits = in_splits

        def counts() -> CallArgs:  # one collective call, after the guard proved that every rank makes it
            outs = (comm._native.exchange_splits(splits, comm.device) if known is None
                    else self._agree_splits(splits, known))
            return CallArgs(in_splits=tuple(splits), out_splits=tuple(outs))

        return self.run(x, NO_ARGS, uneven=True, prepare=counts)  # type: ignore[no-any-return]

    def _agree_splits(self, in_splits: list[int], out_splits: list[int]) -> list[int]:
        """``out_splits`` after proving that every rank's ``out_splits[q]`` equals rank q's ``splits[r]``: every rank
        gathers every rank's two count lists and checks the whole matrix, so every rank reaches the same verdict.
        Collective (the call guard already proved that every rank makes this call, so the gathers pair)."""
        comm, name = self.comm, self.name
        w = comm.world_size
        if w == 1:
            if out_splits != in_splits:
                raise ValueError(f"site {name!r}: out_splits {out_splits} != splits {in_splits} on one rank")
            return out_splits
        mine = torch.tensor([*in_splits, *out_splits], dtype=torch.int64, device=comm.device)
        both = comm._native.all_gather(mine).view(w, 2, w).tolist()
        wrong = [f"rank {r} expects out_splits[{q}]={both[r][1][q]} rows from rank {q}, which sends it "
                 f"splits[{r}]={both[q][0][r]}" for r in range(w) for q in range(w) if both[r][1][q] != both[q][0][r]]
        if wrong:
            raise CollectiveMismatch(
                f"site {name!r} on rank {comm.rank}: the uneven all_to_all's counts disagree ({'; '.join(wrong)}); "
                "nothing was sent. Pass each rank the out_splits its peers send (rank r's out_splits[q] = rank q's "
                "splits[r]), or leave out_splits=None and the counts are exchanged"
            )
        return out_splits

    def argmax(self, logits: torch.Tensor, vocab_start: int) -> torch.Tensor:
        """``vocab_start``: checked by ``argmax_start``. Collective."""
        self.check(logits, None)
        return self.run(logits, CallArgs(vocab_start=vocab_start))  # type: ignore[no-any-return]

    # -- the one entry ----------------------------------------------------------------------------------------
    def run(self, x: torch.Tensor, args: CallArgs, *, rows_per_rank: Sequence[int] | None = None,
            uneven: bool = False, prepare: Callable[[], CallArgs] | None = None, route: Call | None = None) -> Any:
        """The call through the bound route (see the class docstring); ``route`` replaces it (the fused norm's
        kernel). ``prepare``: builds the route's arguments after the call is proven and before its data moves (an
        uneven all_to_all's count exchange). Collective."""
        lock = self._lock
        if not lock.acquire(False):
            raise busy(self.name, self.comm.rank)
        try:
            self.calls += 1
            # Prove across ranks that every rank makes this call, before its data moves (``_prove``, chosen when
            # the site was bound; None: one rank).
            prove = self._prove
            if prove is not None:
                prove(self, x, rows_per_rank, uneven)
            if prepare is not None:
                args = prepare()
            return (self._call if route is None else route)(x, args)
        except RuntimeError as e:  # torch.distributed.DistError derives from it
            if isinstance(e, DetcommError):
                raise
            raise self.comm._failure(self.name, self.calls, e) from e
        finally:
            lock.release()

    # -- the proofs (one per communicator's guard mode, route_impls/guard.py) --------------------------------------
    def _fingerprint(self, x: torch.Tensor, rows_per_rank: Sequence[int] | None, uneven: bool) -> None:
        """With checking on: the call checker's full fingerprint."""
        if self.agreed:  # the first call's fingerprint went before the site's implicit declaration
            self.agreed = False
            return
        verifier = self.comm._verifier
        assert verifier is not None, "the fingerprint proof is chosen only with a call checker"
        verifier.agree(self.name, self.collective, self.op, x, rows_per_rank=rows_per_rank, uneven=uneven)

    def _exchange(self, x: torch.Tensor, rows_per_rank: Sequence[int] | None, uneven: bool) -> None:
        """The call guard's separate header, all-gathered before the data moves. Inside a CUDA-graph capture no
        header can be exchanged (host traffic): captured calls carry no guard, as with the in-message guard. This
        is what lets a gloo-staged CUDA group capture its ipc_fold calls, whose kernels compare their own per-call
        descriptor."""
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            assert self._header is not None
            self._header.exchange(self.calls, -1 if uneven or rows_per_rank is not None else x.shape[self.row_dim],
                                  rows_per_rank)

    def _arm(self, x: torch.Tensor, rows_per_rank: Sequence[int] | None, uneven: bool) -> None:
        """The header the route carries in its messages, armed with this call (compared before the route returns)."""
        assert self.message is not None
        self.message.arm(self.calls, -1 if uneven or rows_per_rank is not None else x.shape[self.row_dim],
                         rows_per_rank)


# -- the arguments of a call, checked before its site is looked up -------------------------------------------------
def check_tensor(name: str, x: object, *, device: torch.device, backend: str) -> None:
    """What any call's tensor must be before its site is known (an undeclared site's first call), and the device
    a declared site's call names when its tensor is elsewhere."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"site {name!r}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"site {name!r}: dtype {x.dtype} is not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}"
        )
    if x.dim() < 1:
        raise ValueError(f"site {name!r}: expected a tensor of rows (at least 1-D, dim 0 = rows), got a 0-d tensor")
    if x.device != device:
        raise ValueError(
            f"site {name!r}: tensor is on {x.device}, but this communicator ({backend}) works on "
            f"{device}; move it with x.to({str(device)!r})"
        )
    if not x.is_contiguous():
        # Refused, not copied: a hidden copy on the hot path costs a full pass over the data, and for a
        # transposed view "row = dim 0" would be ambiguous.
        raise ValueError(f"site {name!r}: tensor is not contiguous; pass x.contiguous()")
    check_grad(name, x)


def busy(name: str, rank: int) -> ConcurrentCall:
    """The error of a call made while another thread is inside one of the same communicator."""
    return ConcurrentCall(
        f"site {name!r} on rank {rank}: another thread is inside a collective call of this communicator. "
        "The ranks pair calls by their order, which two threads cannot keep: make "
        "one thread issue the group's collectives, or give each thread its own process group and communicator "
        "(detcomm.init(group=torch.distributed.new_group(...)))"
    )


def check_grad(name: str, x: torch.Tensor) -> None:
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"site {name!r}: the input requires grad, and detcomm's collectives are forward-only (no backward: "
            "gradients would silently stop here). Call it under torch.no_grad() / torch.inference_mode() "
            "(serving), pass x.detach(), or use torch.distributed.nn.functional's collectives to train through it"
        )


def rs_rows(name: str, rows: int, w: int) -> str:
    return (f"site {name!r}: reduce_scatter needs a row count divisible by the world size {w} (rank r receives "
            f"row block r); got {rows} rows: pad to {-(-rows // w) * w}")


def _int_list(values: Sequence[int], site: str, what: str) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"site {site!r}: {what} must be ints, got {list(values)!r}")
        if v < 0:
            raise ValueError(f"site {site!r}: {what} must be non-negative, got {list(values)!r}")
        out.append(v)
    return out


def _rows(x: object) -> int | None:
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 1 else None


def token_counts(name: str, x: object, rows_per_rank: Sequence[int], *, world_size: int, rank: int) -> list[int]:
    """A token_all_gather's ``rows_per_rank``: W non-negative ints, this rank's entry its rows."""
    counts = _int_list(rows_per_rank, name, "rows_per_rank")
    if len(counts) != world_size:
        raise ValueError(f"site {name!r}: rows_per_rank has {len(counts)} entries, the group has {world_size} ranks")
    rows = _rows(x)
    if rows is not None and rows != counts[rank]:
        raise ValueError(
            f"site {name!r}: this rank ({rank}) passes {rows} rows but rows_per_rank[{rank}] = "
            f"{counts[rank]}; every rank must pass the same rows_per_rank"
        )
    return counts


def a2a_splits(name: str, x: object, splits: Sequence[int] | None, out_splits: Sequence[int] | None, *,
               world_size: int) -> tuple[list[int] | None, list[int] | None]:
    """An all_to_all's (splits, out_splits) as lists (None: even blocks; no out_splits: exchanged)."""
    rows = _rows(x)
    in_splits: list[int] | None = None
    if splits is None:
        if rows is not None and rows % world_size:
            raise ValueError(
                f"site {name!r}: an even all_to_all needs rows divisible by {world_size}, got "
                f"{rows}; pass splits=[rows for each rank] for an uneven one"
            )
    else:
        in_splits = _int_list(splits, name, "splits")
        if len(in_splits) != world_size:
            raise ValueError(f"site {name!r}: splits has {len(in_splits)} entries, the group has {world_size} ranks")
        if rows is not None and sum(in_splits) != rows:
            raise ValueError(f"site {name!r}: splits sum to {sum(in_splits)}, the tensor has {rows} rows")
    known: list[int] | None = None
    if out_splits is not None:
        if splits is None:
            raise ValueError(f"site {name!r}: out_splits is for an uneven all_to_all; pass splits= too")
        known = _int_list(out_splits, name, "out_splits")
        if len(known) != world_size:
            raise ValueError(f"site {name!r}: out_splits has {len(known)} entries, the group has {world_size} ranks")
    return in_splits, known


def argmax_start(name: str, logits: object, vocab_start: object) -> None:
    """An argmax's ``vocab_start`` (a non-negative int) and logits ([rows, vocab_shard] floats, indices < 2**31)."""
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int):
        raise TypeError(f"site {name!r}: vocab_start must be an int, got {type(vocab_start).__name__}")
    if vocab_start < 0:
        raise ValueError(f"site {name!r}: vocab_start must be a non-negative int, got {vocab_start!r}")
    if isinstance(logits, torch.Tensor):
        if logits.dim() != 2:
            raise ValueError(f"site {name!r}: argmax takes [rows, vocab_shard] logits, got shape {tuple(logits.shape)}")
        if logits.dtype not in FLOAT_DTYPES:
            raise ValueError(f"site {name!r}: argmax takes floating-point logits, got {logits.dtype}")
        if vocab_start + logits.shape[1] > 2**31:
            raise ValueError(f"site {name!r}: global vocabulary indices must stay below 2**31")


def norm_args(name: str, x: object, residual: object, weight: object, eps: float) -> None:
    """The fused norm's arguments as the call declaring its site from them must pass (``SiteCall.norm`` checks
    a declared site's)."""
    _norm._check_add(f"site {name!r}: all_reduce_residual_rmsnorm", x, residual, weight)  # type: ignore[arg-type]
    _norm.eps_fp32(eps)
