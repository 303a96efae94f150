"""``detcomm.use(comm)``: two communicators in one process, the module default switched for a block.

On real spawned gloo ranks (W = 2: the default group's communicator and a second one on a new group of both
ranks): inside the block ``get_communicator()`` and the module-level calls (a site declared and reduced by name)
go to ``comm`` and not to the default; blocks nest and each exit restores the default it found; an exception in
the block restores it too; the default is process-wide, not per thread (a thread started inside the block sees
``comm``, one after it the default: the documented behaviour, tested so a change to it is noticed); a shut-down
communicator, or something that is no communicator, is refused with ValueError and the fix; a ``shutdown()``
inside the block leaves no closed default behind. Negative control: the same calls outside the block go to the
default communicator (the site lands there), so the block is what moved them.
"""

from __future__ import annotations

import threading

import pytest
import torch


def job_use(rank: int, w: int) -> dict:
    import torch.distributed as dist

    import detcomm
    from detcomm.errors import DetcommError

    out: dict = {}
    detcomm.shutdown()  # a job before this one on the shared cluster may have left its communicator
    default = detcomm.init(numerics="rl-bitwise")
    try:
        second = detcomm.init(numerics="rl-bitwise", group=dist.new_group(list(range(w))))
        x = torch.full((3, 4), float(rank + 1))
        with detcomm.use(second) as got:
            out["yielded"] = got is second
            out["inside"] = detcomm.get_communicator() is second
            detcomm.site("use.inner", collective="all_reduce", dtype=torch.float32, shape=(4,), max_rows=3)
            out["sum"] = detcomm.all_reduce(x, site="use.inner").tolist()
            seen: list = []
            t = threading.Thread(target=lambda: seen.append(detcomm.get_communicator()))
            t.start()
            t.join()
            out["thread_inside"] = seen[0] is second
            with detcomm.use(default):  # nesting
                out["nested"] = detcomm.get_communicator() is default
            out["after_nested"] = detcomm.get_communicator() is second
        out["after"] = detcomm.get_communicator() is default
        seen.clear()
        t = threading.Thread(target=lambda: seen.append(detcomm.get_communicator()))
        t.start()
        t.join()
        out["thread_after"] = seen[0] is default
        try:
            with detcomm.use(second):
                raise KeyError("inside")
        except KeyError:
            pass
        out["after_raise"] = detcomm.get_communicator() is default
        # the negative control: outside the block the same declaration goes to the default communicator
        detcomm.site("use.outer", collective="all_reduce", dtype=torch.float32, shape=(4,), max_rows=3)
        out["sites"] = {"default": sorted(n for n in default._site_calls if n.startswith("use.")),
                        "second": sorted(n for n in second._site_calls if n.startswith("use."))}
        for bad in (object(), None):
            try:
                with detcomm.use(bad):  # type: ignore[arg-type]
                    pass
            except ValueError as e:
                out.setdefault("refused_other", []).append(str(e))
    finally:
        detcomm.shutdown()
    try:
        with detcomm.use(second):
            pass
    except ValueError as e:
        out["refused_closed"] = str(e)
    default = detcomm.init(numerics="rl-bitwise")
    third = detcomm.init(numerics="rl-bitwise", group=dist.new_group(list(range(w))))
    with detcomm.use(third):
        detcomm.shutdown()  # inside the block: the default the block found is closed too
    try:
        detcomm.get_communicator()
        out["after_shutdown"] = "a default"
    except DetcommError as e:
        out["after_shutdown"] = str(e)
    return out


@pytest.mark.slow
def test_use_switches_the_module_default(cluster2) -> None:  # noqa: ANN001
    for got in cluster2.run(job_use):
        assert got["yielded"] and got["inside"] and got["nested"] and got["after_nested"], got
        assert got["after"] and got["after_raise"], got
        assert got["sum"] == [[3.0] * 4] * 3  # 1 + 2 on both ranks: the second communicator's reduction
        assert got["sites"] == {"default": ["use.outer"], "second": ["use.inner"]}, got["sites"]
        assert got["thread_inside"] and got["thread_after"], "the module default is process-wide, not per thread"
        for msg in [got["refused_closed"], *got["refused_other"]]:
            assert "not a live communicator" in msg and "detcomm.init(group=...) again" in msg, msg
        assert len(got["refused_other"]) == 2
        assert "shut down" in got["after_shutdown"], got["after_shutdown"]
