"""The vLLM plugin's settings (detcomm/vllm/settings.py): read without vLLM, so they run in the README's venv."""

from __future__ import annotations

import pytest

from detcomm.vllm import settings


def test_off_by_default_and_rl_bitwise() -> None:
    s = settings.read({})
    assert (s.enabled, s.numerics, s.layout, s.virtual_shards, s.audit_dir) == (False, "rl-bitwise", "fold", 8, None)


def test_on_with_the_tree_layout_and_the_envelope_of_detcomm_numerics() -> None:
    s = settings.read({"DETCOMM_VLLM": "1", "DETCOMM_NUMERICS": "auto", "DETCOMM_VLLM_LAYOUT": "tree",
                       "DETCOMM_VLLM_VIRTUAL_SHARDS": "16", "DETCOMM_VLLM_AUDIT": "/tmp/a"})
    assert (s.enabled, s.numerics, s.layout, s.virtual_shards, s.audit_dir) == (True, "auto", "tree", 16, "/tmp/a")
    assert s.fingerprint() != settings.read({"DETCOMM_VLLM": "1"}).fingerprint()


@pytest.mark.parametrize(("env", "names"), [
    ({"DETCOMM_VLLM": "maybe"}, "DETCOMM_VLLM='maybe'"),
    ({"DETCOMM_VLLM_LAYOUT": "virtual"}, "DETCOMM_VLLM_LAYOUT='virtual'"),
    ({"DETCOMM_VLLM_VIRTUAL_SHARDS": "6"}, "DETCOMM_VLLM_VIRTUAL_SHARDS=6"),
    ({"DETCOMM_VLLM_VIRTUAL_SHARDS": "eight"}, "DETCOMM_VLLM_VIRTUAL_SHARDS='eight'"),
])
def test_a_malformed_variable_is_named(env: dict[str, str], names: str) -> None:
    with pytest.raises(ValueError, match=names.replace("(", r"\(")):
        settings.read(env)


def test_the_package_declares_vllms_entry_points() -> None:
    from importlib.metadata import entry_points

    general = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    platform = {e.name: e.value for e in entry_points(group="vllm.platform_plugins")}
    assert general.get("detcomm") == "detcomm.vllm:register"
    assert platform.get("detcomm") == "detcomm.vllm:platform_plugin"
