"""The fused all-reduce + residual + RMSNorm's policy and geometry on the CPU (docs/spec.md §9.2): the envelope
switch, the static route table, the workspace's fused-launch arithmetic and the kernel names the module loads.
The kernel's bits are tested on the accelerator (tests/gpu/test_norm_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from detcomm.envelope import resolve_numerics
from detcomm.numerics import norm
from detcomm.numerics.fold import BATCH_INVARIANT
from detcomm.route import Router
from detcomm.route import fusion_refusal as route_fusion_refusal
from detcomm.sites import Capabilities, Collective, Route, Site
from detcomm.workspace import kernels, plan

GPU2_WS = Capabilities(backend="nccl", device_type="cuda", world_size=2, workspace=True, workspace_max_rows=2048)


def _site(shape: tuple[int, ...] = (4096,)) -> Site:
    return Site("layer.add_norm", Collective.ALL_REDUCE_RMSNORM, torch.bfloat16, shape, 256)


def test_switch_defaults_and_veto() -> None:
    assert resolve_numerics("rl-bitwise").switches.batch_invariant_fusion
    assert resolve_numerics("auto").switches.batch_invariant_fusion
    off = resolve_numerics("rl-bitwise", layer_boundary_norm="unfused")
    assert not off.switches.batch_invariant_fusion
    with pytest.raises(ValueError, match="conflicting switches: batch_invariant_fusion=True"):
        resolve_numerics("rl-bitwise", layer_boundary_norm="unfused", batch_invariant_fusion=True)
    with pytest.raises(ValueError, match="True or False"):
        resolve_numerics("rl-bitwise", batch_invariant_fusion="yes")


def test_fusion_refusal_reasons() -> None:
    bitwise = resolve_numerics("rl-bitwise")
    assert norm.fusion_refusal(bitwise, _site()) is None
    assert "batch_invariant_fusion=False" in norm.fusion_refusal(
        resolve_numerics("rl-bitwise", batch_invariant_fusion=False), _site())
    assert "layer_boundary_norm='unfused'" in norm.fusion_refusal(
        resolve_numerics("rl-bitwise", layer_boundary_norm="unfused"), _site())
    # A kernel without the feature is refused under a bitwise envelope only.
    assert BATCH_INVARIANT in norm.FUSED_KERNEL_FEATURES
    assert "'batch_invariant' feature" in norm.fusion_refusal(bitwise, _site(), features=frozenset())
    assert norm.fusion_refusal(resolve_numerics("auto"), _site(), features=frozenset()) is None
    assert "one dimension" in norm.fusion_refusal(bitwise, _site((2, 4096)))


def test_route_table_names_the_fused_kernel_or_why_not() -> None:
    fused = Router(resolve_numerics("rl-bitwise"), GPU2_WS).decide(_site())
    assert fused.route is Route.IPC_FOLD and "fused with the residual add + RMSNorm in one kernel" in fused.why
    unfused = Router(resolve_numerics("rl-bitwise", layer_boundary_norm="unfused"), GPU2_WS).decide(_site())
    assert unfused.route is Route.IPC_FOLD and "composition: fusion off (layer_boundary_norm='unfused')" in unfused.why
    # Without the workspace the fold route composes (no fused kernel there), whatever the switch says.
    cpu = Router(resolve_numerics("rl-bitwise"), Capabilities(backend="gloo", device_type="cpu", world_size=2))
    d = cpu.decide(_site())
    assert d.route is Route.GATHER_FOLD and d.why.endswith("(composition)")
    # Plain all-reduce sites are untouched.
    ar = Site("o_proj", Collective.ALL_REDUCE, torch.bfloat16, (4096,), 256)
    assert "RMSNorm" not in Router(resolve_numerics("rl-bitwise"), GPU2_WS).decide(ar).why


def test_fused_launch_geometry() -> None:
    grid = 132
    stride = plan.stride_packs(grid)
    slot = plan.slot_bytes(32 << 20, 2, grid)
    # bf16 4096: one region of BLOCK_THREADS packs per row; 8192: two.
    per4k = plan.fused_norm_rows_per_launch(4096, "bfloat16", grid=grid, slot_bytes=slot)
    per8k = plan.fused_norm_rows_per_launch(8192, "bfloat16", grid=grid, slot_bytes=slot)
    assert per4k == (slot // 16) // stride * grid and per8k == (slot // 16) // (2 * stride) * grid
    # The highest slot pack any row touches stays inside the slot.
    for hidden, dtype in ((4096, "bfloat16"), (8192, "bfloat16"), (77, "float32"), (2049, "float16")):
        per = plan.fused_norm_rows_per_launch(hidden, dtype, grid=grid, slot_bytes=slot)
        packs = -(-hidden // plan.pack_elems(dtype))
        regions = -(-packs // plan.BLOCK_THREADS)
        local_rows = -(-per // grid)
        last = ((local_rows - 1) * regions + regions - 1) * stride + (grid - 1) * plan.BLOCK_THREADS + plan.BLOCK_THREADS
        assert last * 16 <= slot, (hidden, dtype)
    assert plan.fused_norm_rows_per_launch(1 << 20, "float32", grid=grid, slot_bytes=1 << 20) == 0
    v = plan.fused_norm_variants(hidden=4096, dtype="bfloat16", max_rows=256, grid=grid, slot_bytes=slot,
                                 one_shot_max_bytes=512 * 1024)
    assert v == ["fused_one_shot", "fused_two_shot"]
    assert plan.fused_norm_variants(hidden=4096, dtype="bfloat16", max_rows=per4k + 1, grid=grid, slot_bytes=slot,
                                    one_shot_max_bytes=512 * 1024)[-1] == "fused_chunked"
    assert plan.fused_norm_variants(hidden=1 << 20, dtype="float32", max_rows=4, grid=grid, slot_bytes=1 << 20,
                                    one_shot_max_bytes=512 * 1024) == []
    # With the one-store kernel (W >= 2): decode launches (up to 32 rows of 8 KiB in 256 KiB) take it.
    one_store = 256 * 1024  # forced, as the stream bench does (never by default on a shared GPU)
    assert plan.fused_norm_one_store_rows(4096, "bfloat16", one_store) == 32
    assert plan.fused_norm_variants(hidden=4096, dtype="bfloat16", max_rows=256, grid=grid, slot_bytes=slot,
                                    one_shot_max_bytes=512 * 1024, one_store_max=one_store) == [
        "fused_one_store", "fused_one_shot", "fused_two_shot"]


def test_module_loads_every_fused_kernel() -> None:
    names = kernels.module_functions("bfloat16")
    for algo in ("1shot", "2shot", "one_store"):
        for w in ("f32", "bf16", "f16"):
            assert f"detcomm_fused_rmsnorm_{algo}_bf16_w{w}" in names
    assert plan.fused_norm_kernel("two_shot", "float16", "float32") == "detcomm_fused_rmsnorm_2shot_f16_wf32"
    assert plan.fused_norm_kernel("one_store", "bfloat16", "float32") == "detcomm_fused_rmsnorm_one_store_bf16_wf32"
    assert "fused_rmsnorm.cu" in kernels.KERNEL_FILES and "fused_rmsnorm_one_store.cu" in kernels.KERNEL_FILES
    src = kernels.flatten_source()
    assert "detcomm_fused_rmsnorm_" in src and "norm_inv_rms" in src and '#include "' not in src


def _stand_in_workspace(one_store_max: int, variant: str = "canonical") -> tuple[object, list[tuple[str, list[float]]]]:
    """A Workspace with no device (object.__new__): the host logic of all_reduce_rmsnorm runs on CPU tensors and
    its launches are recorded (kernel name, argument values) instead of run."""
    import contextlib
    from types import SimpleNamespace

    from detcomm.workspace import Workspace, debug

    ws = object.__new__(Workspace)
    ws.device, ws._dead, ws.refused = torch.device("cpu"), None, {}
    debug.record(ws)
    ks = object.__new__(kernels.KernelSet)  # no modules: only its layout rule runs
    ks.key = kernels.ModuleKey(0, 2, "sm_90", variant, False)
    ws._kernels = ks
    ws._ctrl = SimpleNamespace(tagged=lambda: False, words=[0])
    ws.grid, ws.world_size, ws.capacity_bytes = 132, 2, 4 << 20
    ws._slot_bytes = plan.slot_bytes(4 << 20, 2, ws.grid)
    ws.one_shot_max_bytes, ws.one_store_max_bytes = 512 << 10, one_store_max
    ws.one_store_tiers = plan.one_store_tiers(one_store_max, 2, ws.grid, base=777)
    ws._tail, ws._calls, ws._label_ring = [], 0, [None] * 4096
    ws._launchers, ws._bound, ws._in_flight = {}, {}, contextlib.nullcontext(0)
    launches: list[tuple[str, list[float]]] = []
    grids: list[int | None] = []

    def prepare(name: str, grid: int, args: list) -> object:
        def launch(stream: int) -> None:  # the arguments before the call number (the kernel's own)
            launches.append((name, [a.value for a in args[:-1]]))
            grids.append(grid)

        return launch

    ks.prepare = prepare  # type: ignore[method-assign]
    ws.grids = grids
    return ws, launches


def test_fused_launches_take_the_one_store_kernel_per_launch() -> None:
    """all_reduce_rmsnorm's host side: launches of up to fused_norm_one_store_rows rows take the one-store kernel
    on the first tier that holds them (its sub-region's offset and area bytes as the two extra arguments, its
    blocks as the grid), larger ones one-shot; a forced 'one_store' chunks to what the largest areas hold;
    chunk_rows above that, or the one-store path off, raise."""
    ws, launches = _stand_in_workspace(256 << 10)  # tiers: 8 rows of bf16 x 4096 on 16 blocks, 32 on the grid
    small, big = ws.one_store_tiers
    assert (small.blocks, big.blocks, small.offset) == (16, 132, 777) and big.offset > small.offset + 4 * small.cap
    x = torch.zeros(80, 4096, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    one_store, one = "detcomm_fused_rmsnorm_one_store_bf16_wbf16", "detcomm_fused_rmsnorm_1shot_bf16_wbf16"

    def run(rows: int, **kw: object) -> list[tuple[str, int, int]]:
        launches.clear()
        ws.grids.clear()
        ws.all_reduce_rmsnorm(x[:rows], x[:rows], w, 1e-6, **kw)
        # (kernel, rows, x offset in rows); the one-store launches end with their tier's offset and area bytes
        for (name, args), grid in zip(launches, ws.grids, strict=True):
            tier = small if args[5] <= 8 else big
            assert (args[-2:] == [tier.offset, tier.cap]) == (name == one_store), (name, args)
            assert grid == (tier.blocks if name == one_store else ws.grid), (name, grid)
        return [(name, int(args[5]), int(args[0] - x.data_ptr()) // (4096 * 2)) for name, args in launches]

    assert run(8) == [(one_store, 8, 0)]
    assert run(9) == [(one_store, 9, 0)]
    assert run(32) == [(one_store, 32, 0)]
    assert run(33) == [(one, 33, 0)]
    assert run(80, algo="one_store") == [(one_store, 32, 0), (one_store, 32, 32), (one_store, 16, 64)]
    assert run(20, chunk_rows=6) == [(one_store, 6, 0), (one_store, 6, 6), (one_store, 6, 12), (one_store, 2, 18)]
    assert run(20, chunk_rows=12) == [(one_store, 12, 0), (one_store, 8, 12)]
    assert run(3, algo="one_shot") == [(one, 3, 0)]
    assert ("all_reduce_rmsnorm", "bfloat16", "fused_one_store") in ws.variants_run
    with pytest.raises(ValueError, match="algo='one_store'"):
        run(40, algo="one_store", chunk_rows=33)
    off, launches = _stand_in_workspace(0)  # W = 1: no one-store region
    with pytest.raises(ValueError, match="algo='one_store'"):
        off.all_reduce_rmsnorm(x, x, w, 1e-6, algo="one_store")
    off.all_reduce_rmsnorm(x[:1], x[:1], w, 1e-6)
    assert [name for name, _ in launches] == [one]


def test_fused_row_layout_follows_the_header_rule() -> None:
    """plan.fused_norm_layout (C = the elements one half holds: the load batch x 256 lanes x 8): registers up to C,
    the wide kernels up to 2C, streaming above, from (H, dtype, W) alone; the bench's builds move it (batch 4) or
    switch the wide kernels off. tests/test_workspace_csrc.py holds C to csrc/fused_norm_row.cuh."""
    c = plan.fused_norm_register_elems
    assert [c("bfloat16", w) for w in (1, 2, 3, 4, 5, 8)] == [4096, 4096, 4096, 4096, 2048, 2048]
    assert [c("float32", w) for w in (1, 2, 4, 8)] == [4096, 4096, 2048, 2048]
    assert c("float16", 2, batch=4) == 8192 and c("float16", 4, batch=4) == 4096
    lay = plan.fused_norm_layout
    assert [lay(h, "bfloat16", 2) for h in (1, 4096, 4097, 8192, 8193)] == [
        "registers", "registers", "wide", "wide", "streaming"]
    assert [lay(h, "bfloat16", 8) for h in (2048, 2049, 4096, 4097, 8192)] == [
        "registers", "wide", "wide", "streaming", "streaming"]
    assert lay(8192, "bfloat16", 2, wide=False) == "streaming" and lay(8192, "bfloat16", 2, batch=4) == "registers"
    assert lay(3000, "float32", 4) == "wide" and lay(6144, "float32", 2) == "wide"
    for bad in (lambda: lay(0, "bfloat16", 2), lambda: c("bfloat16", 9), lambda: c("bfloat16", 2, batch=0)):
        with pytest.raises(ValueError):
            bad()
    assert plan.fused_norm_kernel("one_store", "bfloat16", "bfloat16", wide=True) == (
        "detcomm_fused_rmsnorm_one_store_wide_bf16_wbf16")
    names = kernels.module_functions("float16")
    for algo in ("1shot", "2shot", "one_store"):
        assert {f"detcomm_fused_rmsnorm_{algo}_f16_wbf16", f"detcomm_fused_rmsnorm_{algo}_wide_f16_wbf16"} <= set(names)


def test_fused_launches_take_the_wide_kernels_exactly_for_wide_rows() -> None:
    """all_reduce_rmsnorm's host side at W = 2: rows of 4097..8192 bf16 elements take the wide kernel of whichever
    algorithm the launch takes (one-store, one-shot, two-shot), every other width the row kernel; the bench's
    fused_no_wide build never takes a wide kernel. variants_run records the layout."""
    ws, launches = _stand_in_workspace(256 << 10)
    for hidden, rows, algo, want in ((4096, 1, None, "detcomm_fused_rmsnorm_one_store_bf16_wbf16"),
                                     (4097, 1, None, "detcomm_fused_rmsnorm_one_store_wide_bf16_wbf16"),
                                     (8192, 2, None, "detcomm_fused_rmsnorm_one_store_wide_bf16_wbf16"),
                                     (8192, 20, None, "detcomm_fused_rmsnorm_1shot_wide_bf16_wbf16"),
                                     (8192, 3, "two_shot", "detcomm_fused_rmsnorm_2shot_wide_bf16_wbf16"),
                                     (8193, 1, None, "detcomm_fused_rmsnorm_one_store_bf16_wbf16"),
                                     (8193, 3, "one_shot", "detcomm_fused_rmsnorm_1shot_bf16_wbf16")):
        launches.clear()
        x = torch.zeros(rows, hidden, dtype=torch.bfloat16)
        ws.all_reduce_rmsnorm(x, x, torch.ones(hidden, dtype=torch.bfloat16), 1e-6, algo=algo)
        assert {name for name, _ in launches} == {want}, (hidden, rows, algo, launches)
    layouts = {v for c, d, v in ws.variants_run if v.startswith("layout_")}
    assert layouts == {"layout_registers", "layout_wide", "layout_streaming"}
    off, launches = _stand_in_workspace(256 << 10, variant="fused_no_wide")
    x = torch.zeros(1, 8192, dtype=torch.bfloat16)
    off.all_reduce_rmsnorm(x, x, torch.ones(8192, dtype=torch.bfloat16), 1e-6)
    assert [name for name, _ in launches] == ["detcomm_fused_rmsnorm_one_store_bf16_wbf16"]


class _LayoutOnlyWorkspace:
    """What IpcFoldRoute reads of a workspace to bind a fused site, on the CPU: its W, no all-reduce variants
    (the site's plain all-reduce is not bound to kernels) and the fused kernel's paths."""

    world_size = 2

    def variants(self, collective: str, dtype: torch.dtype, row_numel: int, max_rows: int) -> list[str]:
        return []

    def fused_norm_variants(self, dtype: torch.dtype, hidden: int, max_rows: int) -> list[str]:
        return ["fused_one_shot"]


def test_sites_the_fused_kernels_would_stream_take_the_composition() -> None:
    """A fused site is served by the fused kernel when its rows are in registers or wide (up to 8192 bf16 at W =
    2, 4096 at W = 8), and by the composition when the kernel would stream them: the route table says why
    (Router.decide) and the workspace route binds no fused kernel (IpcFoldRoute), from the same rule."""
    from detcomm.route_impls.ipc_fold import IpcFoldRoute

    bitwise = resolve_numerics("rl-bitwise")
    backend = IpcFoldRoute(_LayoutOnlyWorkspace(), resolved=bitwise)  # type: ignore[arg-type]
    gpu8 = Capabilities(backend="nccl", device_type="cuda", world_size=8, workspace=True, workspace_max_rows=2048)
    for caps, hidden, fused in ((GPU2_WS, 4096, True), (GPU2_WS, 8192, True), (GPU2_WS, 8193, False),
                                (GPU2_WS, 16384, False), (gpu8, 4096, True), (gpu8, 8192, False)):
        d = Router(bitwise, caps).decide(_site((hidden,)))
        assert d.route is Route.IPC_FOLD, d
        assert ("fused with the residual add + RMSNorm in one kernel" in d.why) == fused, (hidden, d.why)
        assert ("composition: rows of" in d.why and "wider rows take the composition" in d.why) == (not fused), d.why
        if caps is GPU2_WS:
            bound = backend.bind(_site((hidden,)))
            assert (bound.fused is not None) == fused and bool(bound.variants) == fused, (hidden, bound)
    assert "16384 elements exceed the 8192" in route_fusion_refusal(bitwise, _site((16384,)), world_size=2)
    assert route_fusion_refusal(bitwise, _site((8192,)), world_size=2) is None
    assert norm.fusion_refusal(bitwise, _site((16384,))) is None  # what the numerics allow: any row length
    assert "16384 elements exceed the 8192" in plan.fused_norm_refusal(16384, "bfloat16", 2)  # the workspace's rule
    assert plan.fused_norm_refusal(8192, "bfloat16", 2) is None


def _tree_site(fold: str = "tree", shape: tuple[int, ...] = (4096,), route: Route | None = None) -> Site:
    return Site("layer.add_norm", Collective.ALL_REDUCE_RMSNORM, torch.bfloat16, shape, 256, virtual_shards=8,
                shard_fold=fold, route=route)


def test_virtual_norm_sites_route_fused_or_composed() -> None:
    """docs/spec.md §9.2 "Tree sites": an all_reduce_rmsnorm site with virtual shards routes as its virtual all-reduce
    does; the tree order takes the workspace's fused tree kernels where fusion is allowed, the shard order the
    composition (no fused kernel folds it); both routes' reasons say which, from the rule's owners. A tree row the
    fused kernels cannot hold in registers is the composition, with plan.fused_norm_refusal's reason."""
    bitwise = resolve_numerics("rl-bitwise")
    for w in (2, 4):
        caps = Capabilities(backend="nccl", device_type="cuda", world_size=w, workspace=True, workspace_max_rows=2048,
                            workspace_bytes=32 << 20)
        auto = Router(bitwise, caps)
        d = auto.decide(_tree_site())
        assert d.route is Route.IPC_FOLD and "tree kernels" in d.why, d
        assert "fused with the residual add + RMSNorm in one kernel" in d.why, d
        assert route_fusion_refusal(bitwise, _tree_site(), world_size=w) is None
        wide = route_fusion_refusal(bitwise, _tree_site(shape=(65536,)), world_size=w)
        assert wide is not None and wide == plan.fused_norm_refusal(65536, "bfloat16", w), wide
        assert "composition: " + wide in auto.decide(_tree_site(shape=(65536,))).why
        d = auto.decide(_tree_site("order"))
        assert d.route is Route.IPC_FOLD and "composition: no fused kernel folds the shard order" in d.why, d
        off = Router(resolve_numerics("rl-bitwise", layer_boundary_norm="unfused"), caps).decide(_tree_site())
        assert off.route is Route.IPC_FOLD and "composition: fusion off" in off.why, off
        d = auto.decide(_tree_site(route=Route.A2A_FOLD))
        assert d.route is Route.A2A_FOLD and d.why.endswith("(composition)"), d
        assert [c.route for c in auto.candidates(_tree_site())] == [Route.IPC_FOLD, Route.GATHER_FOLD, Route.A2A_FOLD]
    cpu = Router(bitwise, Capabilities(backend="gloo", device_type="cpu", world_size=4))
    for fold in ("tree", "order"):
        d = cpu.decide(_tree_site(fold))
        assert d.route is Route.GATHER_FOLD and d.why.endswith("(composition)"), d
    with pytest.raises(ValueError, match="shard_fold='order' serves every W"):
        Router(bitwise, Capabilities(backend="gloo", device_type="cpu", world_size=3)).decide(_tree_site())
    with pytest.raises(ValueError, match="all_reduce, reduce_scatter and all_reduce_rmsnorm sites, not all_gather"):
        Site("g", Collective.ALL_GATHER, torch.bfloat16, (8,), 4, virtual_shards=8)
    with pytest.raises(ValueError, match="all_reduce sites only, and of all_reduce_rmsnorm sites"):
        Site("rs", Collective.REDUCE_SCATTER, torch.bfloat16, (8,), 4, virtual_shards=8, route=Route.IPC_FOLD)
    assert _tree_site(route=Route.IPC_FOLD).route is Route.IPC_FOLD
