"""Envelope precedence and refusals, the launcher environment, and Router's static decisions."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import detcomm
from detcomm.envelope import (
    BITWISE_ENVELOPES,
    MULTICAST_OFF_ENV,
    apply_environment,
    envelope_environment,
    missing_environment,
    multicast_allowed,
    register_numerics_envelope,
    resolve_numerics,
    unregister_numerics_envelope,
    warn_missing_environment,
)
from detcomm.route import Router
from detcomm.sites import Capabilities, Collective, ReduceOp, Route, Site


def test_auto_defaults_and_rl_bitwise_tightens() -> None:
    auto = resolve_numerics("auto")
    assert not auto.bitwise and not auto.switches.batch_invariant_collectives and not auto.switches.nccl_ring_simple
    rl = resolve_numerics("rl-bitwise")
    assert rl.bitwise and "rl-bitwise" in BITWISE_ENVELOPES and "auto" not in BITWISE_ENVELOPES
    sw = rl.switches
    assert sw.batch_invariant_collectives and sw.nccl_ring_simple and sw.disable_tf32
    assert not sw.force_deterministic_rsag  # the user's own knob, not folded in


def test_every_switch_settable_on_its_own_under_auto() -> None:
    r = resolve_numerics("auto", nccl_ring_simple=True)
    assert r.switches.nccl_ring_simple and not r.switches.batch_invariant_collectives
    r = resolve_numerics("auto", batch_invariant_collectives=True)
    assert r.switches.batch_invariant_collectives and not r.switches.nccl_ring_simple
    r = resolve_numerics("auto", layer_boundary_norm="unfused")
    assert not r.switches.batch_invariant_fusion  # implied
    r = resolve_numerics("auto", force_deterministic_rsag=True, disable_tf32=True)
    assert r.switches.force_deterministic_rsag and r.switches.disable_tf32 and r.explicit == {"force_deterministic_rsag", "disable_tf32"}


@pytest.mark.parametrize("switch,value", [("batch_invariant_collectives", False), ("nccl_ring_simple", False),
                                          ("disable_tf32", False)])
def test_rl_bitwise_refuses_what_it_cannot_tighten(switch: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"cannot keep the explicit choice {switch}"):
        resolve_numerics("rl-bitwise", **{switch: value})


def test_rl_bitwise_accepts_explicit_tight_values() -> None:
    r = resolve_numerics("rl-bitwise", nccl_ring_simple=True, batch_invariant_collectives=True)
    assert r.switches.batch_invariant_collectives and r.explicit == {"nccl_ring_simple", "batch_invariant_collectives"}


def test_conflicting_switches_refused() -> None:
    with pytest.raises(ValueError, match="conflicting switches: batch_invariant_fusion=True with layer_boundary_norm"):
        resolve_numerics("auto", layer_boundary_norm="unfused", batch_invariant_fusion=True)


def test_unknown_names_and_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown numerics envelope 'bitwise'"):
        resolve_numerics("bitwise")
    with pytest.raises(ValueError, match="unknown numerics switch"):
        resolve_numerics("auto", batch_invariant=True)
    with pytest.raises(ValueError, match="must be True or False"):
        resolve_numerics("auto", disable_tf32="yes")
    for gone in ("enable_allreduce_fusion", "comm_fusion_max_num_tokens"):  # advisory switches nothing read
        with pytest.raises(ValueError, match="unknown numerics switch"):
            resolve_numerics("auto", **{gone: -1})
    with pytest.raises(ValueError, match="layer_boundary_norm"):
        resolve_numerics("auto", layer_boundary_norm="sometimes")


def test_plugin_envelope_inherits_bitwise_pins() -> None:
    register_numerics_envelope("test-strict", bitwise=True, tight={"force_deterministic_rsag": True})
    try:
        assert "test-strict" in BITWISE_ENVELOPES
        r = resolve_numerics("test-strict")
        assert r.bitwise and r.switches.batch_invariant_collectives and r.switches.force_deterministic_rsag
        with pytest.raises(ValueError, match="already registered"):
            register_numerics_envelope("test-strict", bitwise=True)
        with pytest.raises(ValueError, match="cannot set batch_invariant_collectives=False"):
            register_numerics_envelope("test-loose", bitwise=True, tight={"batch_invariant_collectives": False})
    finally:
        unregister_numerics_envelope("test-strict")
    assert "test-strict" not in BITWISE_ENVELOPES


def test_environment_for_launchers() -> None:
    env = envelope_environment("rl-bitwise")
    assert env["NCCL_ALGO"] == "Ring" and env["NCCL_PROTO"] == "Simple" and env["NVIDIA_TF32_OVERRIDE"] == "0"
    for k, v in MULTICAST_OFF_ENV.items():
        assert env[k] == v
    auto = envelope_environment("auto")
    assert "NCCL_ALGO" not in auto and auto["NCCL_NVLS_ENABLE"] == "0" and auto["DETCOMM_NUMERICS"] == "auto"
    assert "NCCL_NVLS_ENABLE" not in envelope_environment("auto", allow_multicast=True)
    target: dict[str, str] = {"NCCL_ALGO": "Tree"}
    apply_environment("rl-bitwise", env=target)
    assert target["NCCL_ALGO"] == "Ring"


ROOT = Path(__file__).resolve().parents[1]
_MULTICAST_SH = ROOT / ".ci" / "multicast_off.sh"


def _exported(text: str) -> dict[str, str]:
    """NAME=value pairs of the ``export`` lines of a shell text."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("export "):
            out.update(pair.split("=", 1) for pair in line.removeprefix("export ").split() if "=" in pair)
    return out


def _copies(paths: list[Path]) -> list[str]:
    """Scripts that export a multicast variable themselves instead of sourcing .ci/multicast_off.sh."""
    names = "|".join(MULTICAST_OFF_ENV)
    return [p.name for p in paths if p != _MULTICAST_SH
            and re.search(rf"^\s*export\b.*\b({names})=", p.read_text(errors="replace"), re.M)]


def _shell_scripts() -> list[Path]:
    return [p for d in (".ci", "gpu", "launch") for p in sorted((ROOT / d).rglob("*")) if p.is_file()
            and (p.suffix == ".sh" or p.read_text(errors="replace").startswith("#!/usr/bin/env bash"))]


def test_shell_scripts_source_the_one_multicast_off_file() -> None:
    """docs/spec.md §8 in shell: one file holds MULTICAST_OFF_ENV's values, and the scripts that create an
    environment source it rather than keep a copy."""
    assert _exported(_MULTICAST_SH.read_text()) == dict(MULTICAST_OFF_ENV)
    scripts = _shell_scripts()
    assert len(scripts) >= 6 and _copies(scripts) == []
    for rel in (".ci/common.sh", ".ci/hf.sh", "gpu/run.sh", "gpu/wheel.sh"):
        assert ". .ci/multicast_off.sh" in (ROOT / rel).read_text(), rel


def test_multicast_file_checks_can_fail(tmp_path: Path) -> None:
    """Negative controls: a changed value, and a script with its own export, are caught."""
    assert _exported("export NCCL_NVLS_ENABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1") != dict(
        MULTICAST_OFF_ENV)
    own = tmp_path / "own.sh"
    own.write_text("#!/usr/bin/env bash\nexport NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1\n")
    assert _copies([own]) == ["own.sh"]


def test_missing_environment_refuses_nccl_under_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    rl = resolve_numerics("rl-bitwise")
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.delenv("NCCL_PROTO", raising=False)
    assert missing_environment(rl, backend="nccl")["NCCL_ALGO"] == "Ring"
    assert missing_environment(rl, backend="gloo") == {}
    with pytest.raises(RuntimeError, match="before the NCCL communicator is created"):
        warn_missing_environment(rl, "nccl")
    warn_missing_environment(rl, "gloo")  # gloo reads none of them
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    with pytest.warns(RuntimeWarning, match="NVIDIA_TF32_OVERRIDE=0"):
        warn_missing_environment(rl, "nccl")


def test_multicast_needs_all_three_conditions() -> None:
    off = resolve_numerics("auto")
    on = resolve_numerics("auto", allow_multicast=True)
    assert multicast_allowed(off, hardware_supports=True, env={})[0] is False
    ok, why = multicast_allowed(on, hardware_supports=True, env={"NCCL_NVLS_ENABLE": "0"})
    assert not ok and "NCCL_NVLS_ENABLE=0" in why
    assert multicast_allowed(on, hardware_supports=False, env={})[0] is False
    assert multicast_allowed(on, hardware_supports=True, env={})[0] is True


# -- routing ------------------------------------------------------------------------------------------

CPU4 = Capabilities(backend="gloo", device_type="cpu", world_size=4)
GPU8_WS = Capabilities(backend="nccl", device_type="cuda", world_size=8, workspace=True, workspace_max_rows=2048)


def _site(coll: str, dtype: torch.dtype = torch.bfloat16, op: str = "sum", max_rows: int = 2048, **kw: object) -> Site:
    shape = (4096,)
    return Site("s", Collective(coll), dtype, shape, max_rows, ReduceOp(op), **kw)  # type: ignore[arg-type]


def test_route_is_static_no_tensor_argument() -> None:
    params = list(inspect.signature(Router.route).parameters)
    assert params == ["self", "site"]


@pytest.mark.parametrize("numerics,caps,coll,dtype,op,max_rows,expected", [
    ("auto", CPU4, "all_reduce", torch.bfloat16, "sum", 2048, Route.NATIVE),
    ("rl-bitwise", CPU4, "all_reduce", torch.bfloat16, "sum", 2048, Route.RS_AG_FOLD),  # 16 MiB >= break-even
    ("rl-bitwise", CPU4, "all_reduce", torch.bfloat16, "sum", 64, Route.GATHER_FOLD),
    ("rl-bitwise", CPU4, "reduce_scatter", torch.float16, "sum", 2048, Route.A2A_FOLD),
    ("rl-bitwise", CPU4, "all_reduce", torch.float32, "max", 2048, Route.NATIVE),
    ("rl-bitwise", CPU4, "all_reduce", torch.int32, "sum", 2048, Route.NATIVE),
    ("rl-bitwise", CPU4, "all_gather", torch.bfloat16, "sum", 2048, Route.NATIVE),
    ("rl-bitwise", GPU8_WS, "all_reduce", torch.bfloat16, "sum", 2048, Route.IPC_FOLD),
    ("rl-bitwise", GPU8_WS, "all_reduce", torch.bfloat16, "sum", 16384, Route.RS_AG_FOLD),
    ("rl-bitwise", GPU8_WS, "reduce_scatter", torch.bfloat16, "sum", 2048, Route.IPC_FOLD),
    ("auto", GPU8_WS, "all_reduce", torch.bfloat16, "sum", 2048, Route.NATIVE),
])
def test_route_decisions(numerics, caps, coll, dtype, op, max_rows, expected) -> None:  # noqa: ANN001
    auto = Router(resolve_numerics(numerics), caps)
    d = auto.decide(_site(coll, dtype, op, max_rows))
    assert d.route is expected, d.why
    assert auto.decide(_site(coll, dtype, op, max_rows)) == d  # a pure function of static facts


def test_force_deterministic_rsag_keeps_native_plus_fold() -> None:
    auto = Router(resolve_numerics("rl-bitwise", force_deterministic_rsag=True), GPU8_WS)
    assert auto.decide(_site("all_reduce")).route is Route.RS_AG_FOLD  # 16 MiB at W = 8: above its break-even
    assert auto.decide(_site("all_reduce", max_rows=8)).route is Route.GATHER_FOLD
    assert auto.decide(_site("reduce_scatter")).route is Route.A2A_FOLD
    assert "force_deterministic_rsag" in auto.decide(_site("all_gather")).why


def test_forced_routes_validated() -> None:
    rl = Router(resolve_numerics("rl-bitwise"), CPU4)
    with pytest.raises(ValueError, match="not batch-invariant"):
        rl.decide(_site("all_reduce", route=Route.NATIVE))
    with pytest.raises(ValueError, match="route='ipc_fold' is unavailable"):
        rl.decide(_site("all_reduce", route=Route.IPC_FOLD))
    with pytest.raises(ValueError, match="cannot carry all_reduce"):
        _site("all_reduce", route=Route.A2A_FOLD)
    auto = Router(resolve_numerics("auto"), CPU4)
    assert auto.decide(_site("all_reduce", route=Route.GATHER_FOLD)).route is Route.GATHER_FOLD
    with pytest.raises(ValueError, match="MAX reductions run on the native route"):
        auto.decide(_site("all_reduce", op="max", route=Route.GATHER_FOLD))


@pytest.mark.parametrize("kw,match", [
    (dict(shape=(2.0,)), "tuple of ints"),
    (dict(max_rows=2.5), "max_rows must be an int"),
    (dict(name=3), "name is a str"),
])
def test_site_declarations_of_the_wrong_type(kw: dict, match: str) -> None:
    args = dict(name="s", collective=Collective.ALL_REDUCE, dtype=torch.float32, shape=(8,), max_rows=4)
    args.update(kw)
    with pytest.raises(TypeError, match=match):
        Site(**args)


@pytest.mark.parametrize("kw,match", [
    (dict(dtype=torch.complex64), "not supported"),
    (dict(shape=(-1,)), "non-negative"),
    (dict(max_rows=0), ">= 1"),
    (dict(name=""), "non-empty"),
])
def test_bad_site_declarations(kw: dict, match: str) -> None:
    args = dict(name="s", collective=Collective.ALL_REDUCE, dtype=torch.float32, shape=(8,), max_rows=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        Site(**args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="argmax takes floating-point"):
        Site("a", Collective.ARGMAX, torch.int32, (8,), 4, ReduceOp.MAX)
    with pytest.raises(ValueError, match="takes no reduce op"):
        Site("g", Collective.ALL_GATHER, torch.float32, (8,), 4, ReduceOp.MAX)


def test_cli_routes_static_table(capsys: pytest.CaptureFixture[str]) -> None:
    from detcomm.cli import main

    assert main(["routes", "--numerics", "rl-bitwise", "--world-size", "4", "--backend", "gloo",
                 "--site", "o:all_reduce:bfloat16:4096:2048", "--site", "m:all_reduce:float32:1:64:max"]) == 0
    out = capsys.readouterr().out
    assert "gather_fold" in out and "native" in out and "W=4" in out
    assert main(["routes", "--site", "bad"]) == 2


def test_public_api_names() -> None:
    for name in ("init", "site", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "token_all_gather",
                 "argmax", "routes", "shutdown", "BITWISE_ENVELOPES", "register_numerics_envelope",
                 "envelope_environment", "apply_environment"):
        assert callable(getattr(detcomm, name)) or name == "BITWISE_ENVELOPES"
    assert list(inspect.signature(detcomm.all_reduce).parameters) == ["x", "site", "op", "out", "async_op"]
    assert list(inspect.signature(detcomm.argmax).parameters) == ["logits_shard", "site", "vocab_start"]
