"""The fused all-reduce + residual + RMSNorm's policy and geometry on the CPU (docs/spec.md §9.2): the envelope
switch, the static route table, the workspace's fused-launch arithmetic and the kernel names the module loads.
The kernel's bits are tested on the accelerator (tests/gpu/test_norm_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from detcomm import norm
from detcomm.envelope import resolve_numerics
from detcomm.fold import BATCH_INVARIANT
from detcomm.route import AutoBackend, Capabilities, Collective, Route, Site
from detcomm.workspace import kernels, plan

GPU2_WS = Capabilities(backend="nccl", device_type="cuda", world_size=2, workspace=True, workspace_max_rows=2048)


def _site(shape: tuple[int, ...] = (4096,)) -> Site:
    return Site("layer.add_norm", Collective.ALL_REDUCE_RMSNORM, torch.bfloat16, shape, 256)


def test_switch_defaults_and_veto() -> None:
    assert resolve_numerics("rl-bitwise").switches.batch_invariant_fusion
    assert resolve_numerics("auto").switches.batch_invariant_fusion
    # The engine's own fusion stays pinned off under rl-bitwise, with the reason naming detcomm's switch.
    with pytest.raises(ValueError, match="batch_invariant_fusion"):
        resolve_numerics("rl-bitwise", enable_allreduce_fusion=True)
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
    fused = AutoBackend(resolve_numerics("rl-bitwise"), GPU2_WS).decide(_site())
    assert fused.route is Route.IPC_FOLD and "fused with the residual add + RMSNorm in one kernel" in fused.why
    unfused = AutoBackend(resolve_numerics("rl-bitwise", layer_boundary_norm="unfused"), GPU2_WS).decide(_site())
    assert unfused.route is Route.IPC_FOLD and "composition: fusion off (layer_boundary_norm='unfused')" in unfused.why
    # Without the workspace the fold route composes (no fused kernel there), whatever the switch says.
    cpu = AutoBackend(resolve_numerics("rl-bitwise"), Capabilities(backend="gloo", device_type="cpu", world_size=2))
    d = cpu.decide(_site())
    assert d.route is Route.GATHER_FOLD and d.why.endswith("(composition)")
    # Plain all-reduce sites are untouched.
    ar = Site("o_proj", Collective.ALL_REDUCE, torch.bfloat16, (4096,), 256)
    assert "RMSNorm" not in AutoBackend(resolve_numerics("rl-bitwise"), GPU2_WS).decide(ar).why


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
    lam = plan.lamport_max_bytes(2)
    assert plan.fused_norm_lamport_rows(4096, "bfloat16", lam) == 32
    assert plan.fused_norm_variants(hidden=4096, dtype="bfloat16", max_rows=256, grid=grid, slot_bytes=slot,
                                    one_shot_max_bytes=512 * 1024, lamport_max=lam) == [
        "fused_lamport", "fused_one_shot", "fused_two_shot"]


def test_module_loads_every_fused_kernel() -> None:
    names = kernels.module_functions("bfloat16")
    for algo in ("1shot", "2shot", "lamport"):
        for w in ("f32", "bf16", "f16"):
            assert f"detcomm_fused_rmsnorm_{algo}_bf16_w{w}" in names
    assert plan.fused_norm_kernel("two_shot", "float16", "float32") == "detcomm_fused_rmsnorm_2shot_f16_wf32"
    assert plan.fused_norm_kernel("lamport", "bfloat16", "float32") == "detcomm_fused_rmsnorm_lamport_bf16_wf32"
    assert "fused_rmsnorm.cu" in kernels.KERNEL_FILES and "fused_rmsnorm_lamport.cu" in kernels.KERNEL_FILES
    src = kernels.flatten_source()
    assert "detcomm_fused_rmsnorm_" in src and "norm_inv_rms" in src and '#include "' not in src
