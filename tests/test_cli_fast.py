"""``detcomm routes`` is a static view: it must not import torch (the import was most of the command's time), and
its table must be what the router decides on real torch dtypes for a live group of that kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Runs the command in a fresh interpreter, then reports whether torch got imported (stderr, last line).
_WRAPPER = ("import json, sys; from detcomm.cli import main; rc = main(sys.argv[1:]); {extra}"
            "print(json.dumps({{'rc': rc, 'torch': 'torch' in sys.modules}}), file=sys.stderr)")


def _run(*args: str, extra: str = "") -> tuple[list[dict[str, str]], dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != "DETCOMM_NUMERICS"}
    proc = subprocess.run([sys.executable, "-c", _WRAPPER.format(extra=extra), "routes", "--json", *args],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), json.loads(proc.stderr.strip().splitlines()[-1])


def _live_decisions(rows: list[dict[str, str]], backend: str, world: int) -> list[tuple[str, str]]:
    """The router's (route, why) for each row's site built with a torch dtype, on the capabilities a live group of
    this kind has at startup (one NCCL node: the workspace armed at the default max_rows and bytes; gloo: none)."""
    import torch

    from detcomm.envelope import resolve_numerics
    from detcomm.route import Router
    from detcomm.sites import (
        DEFAULT_WORKSPACE_BYTES,
        DEFAULT_WORKSPACE_MAX_ROWS,
        Capabilities,
        Collective,
        ReduceOp,
        Site,
    )

    if backend == "nccl":
        caps = Capabilities(backend="nccl", device_type="cuda", world_size=world, workspace=True,
                            workspace_max_rows=DEFAULT_WORKSPACE_MAX_ROWS, workspace_bytes=DEFAULT_WORKSPACE_BYTES)
    else:
        caps = Capabilities(backend="gloo", device_type="cpu", world_size=world, workspace=False,
                            workspace_reason="CPU group: no CUDA-IPC workspace")
    router = Router(resolve_numerics("rl-bitwise"), caps)
    out = []
    for r in rows:
        site = Site(r["site"], Collective(r["collective"]), getattr(torch, r["dtype"]),
                    tuple(int(d) for d in r["shape"].split(",") if d), int(r["max_rows"]), ReduceOp(r["op"] or "sum"))
        assert isinstance(site.dtype, torch.dtype)
        d = router.decide(site)
        out.append((d.route.value, d.why))
    return out


@pytest.mark.parametrize("backend, world", [("nccl", 8), ("gloo", 4)])
def test_routes_import_no_torch_and_match_the_router(backend: str, world: int) -> None:
    rows, status = _run("--numerics", "rl-bitwise", "--backend", backend, "--world-size", str(world))
    assert status == {"rc": 0, "torch": False}
    assert {r["dtype"] for r in rows} >= {"bfloat16", "float32", "int64"} and len(rows) >= 9  # the default sites
    assert [(r["route"], r["why"]) for r in rows] == _live_decisions(rows, backend, world)


def test_the_torch_check_can_fail() -> None:
    """Negative control: the same wrapper reports torch once something touches a torch-side name."""
    _, status = _run("--backend", "gloo", extra="import detcomm; detcomm.Work; ")
    assert status == {"rc": 0, "torch": True}


def test_python_m_detcomm_routes_imports_no_torch() -> None:
    """The entry point users type (``python -m detcomm routes``: the package, its __main__ and the CLI)."""
    env = {k: v for k, v in os.environ.items() if k != "DETCOMM_NUMERICS"}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "detcomm", "routes", "--backend", "gloo"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert {"detcomm.cli", "detcomm.sites", "detcomm.route"} <= set(imported)
    assert not [m for m in imported if m.split(".")[0] == "torch"]


def test_routes_show_layer_boundary_norm_sites() -> None:
    """all_reduce_rmsnorm sites (the layer boundary: plain, shard-order and tree-order virtual shards) in the static
    table are the router's decisions for the same sites built with torch dtypes; the tree site reads fused on the
    workspace and the shard-order site the composition, so the table can tell them apart (the control)."""
    import torch

    from detcomm.envelope import resolve_numerics
    from detcomm.route import Router
    from detcomm.sites import DEFAULT_WORKSPACE_BYTES, Capabilities, Collective, Site

    specs = ["b.add_norm:all_reduce_rmsnorm:bf16:4096:2048", "o.add_norm:all_reduce_rmsnorm:bf16:4096:2048:sum:vs=8",
             "t.add_norm:all_reduce_rmsnorm:bf16:4096:2048:sum:vs=8:fold=tree"]
    rows, status = _run("--numerics", "rl-bitwise", "--world-size", "4", *(a for s in specs for a in ("--site", s)))
    # The fusion rule's numerics part lives with the canonical norm (detcomm.numerics.norm), which loads torch: a
    # table with norm sites pays that import; the default sites' table stays torch-free (the tests above).
    assert status["rc"] == 0
    caps = Capabilities(backend="nccl", device_type="cuda", world_size=4, workspace=True, workspace_max_rows=2048,
                        workspace_bytes=DEFAULT_WORKSPACE_BYTES)
    router = Router(resolve_numerics("rl-bitwise"), caps)
    for r, (vs, fold) in zip(rows, [(None, "order"), (8, "order"), (8, "tree")], strict=True):
        site = Site(r["site"], Collective.ALL_REDUCE_RMSNORM, torch.bfloat16, (4096,), 2048, virtual_shards=vs,
                    shard_fold=fold)
        d = router.decide(site)
        assert (r["route"], r["why"]) == (d.route.value, d.why)
    assert "fused with the residual add" in rows[2]["why"] and "fused with the residual add" in rows[0]["why"]
    assert "composition: no fused kernel folds the shard order" in rows[1]["why"]
