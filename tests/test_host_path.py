"""The communicator's one call path (comm.SiteCall) and in-place calls, on real gloo groups.

A declared site called by name goes straight to its bound call (one lookup), never through the site
resolution an undeclared or contradicting call takes; its one validator (SiteCall.check) refuses every bad
call with the precise error before any communication. ``out=x`` is handed to routes that write in place (the native route's library reduction here; the
workspace's site-bound kernels on GPU, tests/gpu/test_fold_capture.py) and copied for the others (gather_fold),
with the canonical bits either way (tests/oracle.py)."""

from __future__ import annotations

import numpy as np
import torch

import oracle
from datagen import ill_bits, to_bits, to_torch


def _spy(comm, name: str, seen: list) -> None:  # noqa: ANN001
    """Record what the site's route is handed as CallArgs.out (every call reaches it through SiteCall.bound)."""
    sc = comm._site_calls[name]
    inner = sc.bound
    sc.bound = lambda x, a: (seen.append(a.out), inner(x, a))[1]


def job_in_place(rank: int, w: int) -> list[str]:
    import detcomm

    detcomm.shutdown()
    comm = detcomm.init(numerics="rl-bitwise")
    problems: list[str] = []
    try:
        # A float SUM site takes gather_fold (the fold returns a new tensor): out=x is copied back.
        bits = [ill_bits(5, 12, "bfloat16", seed=41, rank=r) for r in range(w)]
        want = oracle.fold_oracle(bits, "bfloat16")
        detcomm.site("hp.f", collective="all_reduce", dtype=torch.bfloat16, shape=(12,), max_rows=8)
        routes = {e.site.name: e.decision.route.value for e in detcomm.routes().entries}
        seen_f: list = []
        _spy(comm, "hp.f", seen_f)
        x = to_torch(bits[rank], "bfloat16")
        if np.array_equal(to_bits(x), want):
            problems.append("negative control: the input already holds the result")
        if detcomm.all_reduce(x, "hp.f", out=x) is not x or not np.array_equal(to_bits(x), want):
            problems.append("gather_fold out=x is not the canonical fold in x")
        if seen_f != [None]:
            problems.append(f"gather_fold was handed out={seen_f!r}, not None (it does not write in place)")
        # An int32 SUM site takes the native route, which reduces x itself: no copy.
        ints = [np.arange(60, dtype=np.int32).reshape(5, 12) * (r + 1) - 7 * r for r in range(w)]
        detcomm.site("hp.i", collective="all_reduce", dtype=torch.int32, shape=(12,), max_rows=8)
        routes.update({e.site.name: e.decision.route.value for e in detcomm.routes().entries})
        seen_i: list = []
        _spy(comm, "hp.i", seen_i)
        xi = torch.from_numpy(ints[rank].copy())
        ptr = xi.data_ptr()
        got = detcomm.all_reduce(xi, "hp.i", out=xi)
        if got is not xi or xi.data_ptr() != ptr or not np.array_equal(xi.numpy(), np.sum(ints, axis=0)):
            problems.append("native out=x did not reduce x itself")
        if len(seen_i) != 1 or seen_i[0] is not xi:
            problems.append(f"native was not handed x as out: {seen_i!r}")
        # Another view of x's bytes is in place too; so is a call naming the site by its Site object.
        xi2 = torch.from_numpy(ints[rank].copy())
        detcomm.all_reduce(xi2, "hp.i", out=xi2.view(5, 12))
        if not np.array_equal(xi2.numpy(), np.sum(ints, axis=0)) or seen_i[-1] is None:
            problems.append("a view of x as out was not reduced in place")
        xi3 = torch.from_numpy(ints[rank].copy())
        detcomm.all_reduce(xi3, comm._sites["hp.i"], out=xi3)
        if not np.array_equal(xi3.numpy(), np.sum(ints, axis=0)) or seen_i[-1] is not xi3:
            problems.append("a Site-named call did not hand x to the in-place route")
        return [f"{routes['hp.f']},{routes['hp.i']}", *problems]
    finally:
        detcomm.shutdown()


def test_out_x_is_handed_only_to_routes_that_write_in_place(cluster) -> None:  # noqa: ANN001
    assert cluster.run(job_in_place) == [["gather_fold,native"]] * cluster.world_size


def job_fast_path(rank: int, w: int) -> list[str]:
    import detcomm
    from detcomm.errors import DetcommError
    from detcomm.sites import Collective, ReduceOp, Site

    detcomm.shutdown()
    comm = detcomm.init(numerics="rl-bitwise")
    problems: list[str] = []
    full: list[str] = []
    inner = comm._resolve
    comm._resolve = lambda site, *a, **k: (full.append(str(site)), inner(site, *a, **k))[1]
    try:
        site = detcomm.site("hp.e", collective="all_reduce", dtype=torch.float32, shape=(12,), max_rows=4)
        x = torch.full((3, 12), float(rank + 1))
        want = torch.full((3, 12), float(w * (w + 1) // 2))
        buf = torch.empty_like(x)
        # out right after x in one storage: touching, not overlapping (the overlap test's boundary, from the rows).
        pair = torch.empty(6, 12)
        xa, after = pair[:3], pair[3:]
        xa.copy_(x)
        for label, call in (("name", lambda: detcomm.all_reduce(x, "hp.e")),
                            ("out adjacent", lambda: detcomm.all_reduce(xa, "hp.e", out=after)),
                            ("out=buf", lambda: detcomm.all_reduce(x, "hp.e", out=buf)),
                            ("Site", lambda: detcomm.all_reduce(x, site)),
                            ("op=ReduceOp", lambda: detcomm.all_reduce(x, "hp.e", op=ReduceOp.SUM)),
                            ("async", lambda: detcomm.all_reduce(x, "hp.e", async_op=True).result()[0])):
            got = call()
            if not torch.equal(got, want):
                problems.append(f"{label}: wrong result")
        detcomm.site("hp.rs", collective="reduce_scatter", dtype=torch.float32, shape=(12,), max_rows=4 * w)
        detcomm.site("hp.ag", collective="all_gather", dtype=torch.float32, shape=(12,), max_rows=4)
        xs = torch.full((2 * w, 12), float(rank + 1))
        gathered = torch.cat([torch.full((3, 12), float(r + 1)) for r in range(w)])
        for label, call, expect in (
                ("rs", lambda: detcomm.reduce_scatter(xs, "hp.rs"), want[:2]),
                ("rs out=", lambda: detcomm.reduce_scatter(xs, "hp.rs", out=torch.empty(2, 12)), want[:2]),
                ("ag", lambda: detcomm.all_gather(x, "hp.ag"), gathered),
                ("ag out=", lambda: detcomm.all_gather(x, "hp.ag", out=torch.empty(3 * w, 12)), gathered)):
            if not torch.equal(call(), expect):
                problems.append(f"{label}: wrong result")
        if [f for f in full if not f.startswith("Site(")]:
            problems.append(f"declared calls by name took the site resolution: {full}")
        full.clear()
        # Every bad call is refused with its precise error, before any communication.
        storage = torch.zeros((3 * w + 1) * 12)  # an all_gather output starting one row into its input
        xo, oo = storage[:36].view(3, 12), storage[12:].view(3 * w, 12)
        bad = {
            "dtype": (lambda: detcomm.all_reduce(x.half(), "hp.e"), ValueError, "contradicts it: dtype"),
            "shape": (lambda: detcomm.all_reduce(torch.zeros(3, 6), "hp.e"), ValueError, "trailing shape"),
            "rows": (lambda: detcomm.all_reduce(torch.zeros(5, 12), "hp.e"), ValueError, "exceed the declared"),
            "0-d": (lambda: detcomm.all_reduce(torch.zeros(()), "hp.e"), ValueError, "0-d tensor"),
            "strided": (lambda: detcomm.all_reduce(torch.zeros(12, 3).t(), "hp.e"), ValueError, "not contiguous"),
            "op": (lambda: detcomm.all_reduce(x, "hp.e", op="max"), ValueError, "op max != sum"),
            "bad op": (lambda: detcomm.all_reduce(x, "hp.e", op="prod"), ValueError, "unknown op"),
            "not a tensor": (lambda: detcomm.all_reduce([1.0], "hp.e"), TypeError, "expected a torch.Tensor"),
            "out shape": (lambda: detcomm.all_reduce(x, "hp.e", out=torch.empty(2, 12)), ValueError, "out must be"),
            "out dtype": (lambda: detcomm.all_reduce(x, "hp.e", out=buf.double()), ValueError, "out must be"),
            "out type": (lambda: detcomm.all_reduce(x, "hp.e", out=3), TypeError, "out must be a torch.Tensor"),
            "out overlap": (lambda: detcomm.all_reduce(x[:2], "hp.e", out=x[1:]), ValueError, "partially overlaps"),
            "x device": (lambda: detcomm.all_reduce(x.to("meta"), "hp.e"), ValueError,
                         "site 'hp.e': tensor is on meta, but this communicator (gloo) works on cpu; move it with "
                         "x.to('cpu')"),
            "out device": (lambda: detcomm.all_reduce(x, "hp.e", out=torch.empty(3, 12, device="meta")), ValueError,
                           "site 'hp.e': out must be a float32 tensor of shape [3, 12] on cpu, got float32 [3, 12] on "
                           "meta"),
            "rs out device": (lambda: detcomm.reduce_scatter(xs, "hp.rs", out=torch.empty(2, 12, device="meta")),
                              ValueError, "out must be a float32 tensor of shape [2, 12] on cpu, got float32 [2, 12] "
                              "on meta"),
            "out strided": (lambda: detcomm.all_reduce(x, "hp.e", out=torch.empty(12, 3).t()), ValueError,
                            "out is not contiguous"),
            "foreign Site": (lambda: detcomm.all_reduce(x, Site("hp.e", Collective.ALL_REDUCE, torch.float32,
                             (12,), 4, group="other")), ValueError, "was not declared"),
            "site type": (lambda: detcomm.all_reduce(x, 7), TypeError, "site must be a site name"),
            "rs rows": (lambda: detcomm.reduce_scatter(xs[1:], "hp.rs"), ValueError, "divisible by the world size"),
            "rs out rows": (lambda: detcomm.reduce_scatter(xs, "hp.rs", out=torch.empty(3, 12)), ValueError,
                            "out must be"),
            "rs as all_reduce": (lambda: detcomm.all_reduce(xs, "hp.rs"), ValueError, "collective all_reduce"),
            "ag out rows": (lambda: detcomm.all_gather(x, "hp.ag", out=torch.empty(3, 12)), ValueError,
                            "out must be"),
            "ag overlap": (lambda: detcomm.all_gather(xo, "hp.ag", out=oo), ValueError, "partially overlaps"),
        }
        for label, (call, err, text) in bad.items():
            n = len(full)
            try:
                call()
                problems.append(f"{label}: accepted")
            except err as e:
                if text not in str(e):
                    problems.append(f"{label}: {e}")
            # A contradicting collective or op, a foreign Site and a wrong site type take the resolution's error.
            if label in ("op", "bad op", "rs as all_reduce", "foreign Site", "site type") and len(full) == n:
                problems.append(f"{label}: the site resolution never ran")
        # A virtual-shard site's out (the folded rows, bf16) against its fp32 partials [V/W, rows, H]: the overlap
        # test counts every row's V/W partials (an out inside their last bytes is refused, one right after them
        # is accepted and receives the fold).
        detcomm.site("hp.v", collective="all_reduce", dtype=torch.bfloat16, shape=(8,), max_rows=4,
                     virtual_shards=2 * w)
        st = torch.zeros(2 * 3 * 8 + 12)
        part = st[:48].view(2, 3, 8)
        part.fill_(float(rank + 1))
        inside, beside = part.view(-1).view(torch.bfloat16)[72:].view(3, 8), st[48:].view(torch.bfloat16).view(3, 8)
        try:
            detcomm.all_reduce(part, "hp.v", out=inside)
            problems.append("virtual: an out inside the partials' bytes was accepted")
        except ValueError as e:
            if "partially overlaps" not in str(e):
                problems.append(f"virtual inside: {e}")
        folded = torch.full((3, 8), float(w * (w + 1)), dtype=torch.bfloat16)  # 2 shards of rank + 1 per rank
        if detcomm.all_reduce(part, "hp.v", out=beside) is not beside or not torch.equal(beside, folded):
            problems.append(f"virtual: the out beside the partials did not receive the fold: {beside[0].tolist()}")
        # The spy sees a resolution (negative control of the 'declared calls skip it' assertion above).
        detcomm.all_reduce(x, "hp.undeclared")
        if not full or full[-1] != "hp.undeclared":
            problems.append("negative control: the spy missed a site resolution")
        detcomm.get_communicator().close()
        try:
            detcomm.all_reduce(x, "hp.e")
            problems.append("a closed communicator accepted a call")
        except DetcommError:
            pass
        return problems
    finally:
        detcomm.shutdown()


def test_declared_calls_go_straight_to_their_bound_call_and_bad_calls_are_refused(cluster2) -> None:  # noqa: ANN001
    assert cluster2.run(job_fast_path) == [[]] * 2
