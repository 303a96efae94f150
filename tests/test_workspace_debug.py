"""The tests' and the bench's way to other kernel builds and to the code-path record (detcomm/workspace/debug.py):
the production factory has neither, the runtime never imports the debug module, and a build reaches the kernels'
options. No GPU needed (the GPU tests in tests/gpu/ use these entry points on real workspaces)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from detcomm.workspace import Workspace, debug, kernels

PACKAGE = Path(__file__).resolve().parents[1] / "detcomm"


def test_the_production_factories_serve_the_canonical_build_only():
    for factory in (Workspace.create, Workspace.in_process):
        params = set(inspect.signature(factory).parameters)
        assert not {"build", "_variant", "variant", "record"} & params, params
    assert Workspace._kernel_build == "canonical" and Workspace.__init__.__module__ == "detcomm.workspace.workspace"


def test_a_debug_class_carries_its_build_and_record():
    rotated = debug.workspace_class("rotated", record=True)
    assert issubclass(rotated, Workspace) and rotated is not Workspace
    assert rotated._kernel_build == "rotated" and rotated.__init__ is not Workspace.__init__  # it starts recording
    assert debug.workspace_class("rotated").__init__ is Workspace.__init__
    assert debug.workspace_class("rotated", record=True) is rotated  # one class per (build, record)
    assert debug.workspace_class()._kernel_build == "canonical"
    # The build reaches the options the class's kernel set is compiled with.
    assert f"-D{kernels.ROTATE_MACRO}=1" in kernels.nvrtc_options(3, "sm_90", build=rotated._kernel_build)
    with pytest.raises(ValueError, match="kernel build"):
        debug.workspace_class("fast_math")


def test_record_starts_an_empty_record():
    ws = object.__new__(Workspace)  # a stand-in: record() only sets the attribute
    ws.variants_run, ws._record_path = None, None
    debug.record(ws)
    assert ws.variants_run == set()
    ws._record_path(("all_reduce", "bfloat16", "one_shot"))  # the hook the launches call
    assert ws.variants_run == {("all_reduce", "bfloat16", "one_shot")}
    debug.record(ws)
    assert ws.variants_run == set()


def _imports_debug(source: str) -> bool:
    """Whether Python source imports detcomm.workspace.debug (absolutely or relatively, at any depth)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.endswith("workspace.debug") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.endswith("debug") or (module.endswith("workspace") or not module) and any(
                    a.name == "debug" for a in node.names):
                return True
    return False


def test_the_runtime_never_imports_the_debug_module():
    """Only tests and benches reach other builds. The control: the check sees the imports debug.py's users write."""
    for user in ("from detcomm.workspace import Workspace, debug", "from .debug import record",
                 "from . import debug", "import detcomm.workspace.debug"):
        assert _imports_debug(user), user
    texts = {p: p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "debug.py"}
    users = [p.relative_to(PACKAGE).as_posix() for p, text in texts.items() if "debug" in text and _imports_debug(text)]
    assert users == [], users


def _sets_the_hook(source: str) -> list[str]:
    """What source assigns to a `_record_path` attribute (the unparsed values)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "_record_path":
                out.append(ast.unparse(node.value))  # type: ignore[union-attr, arg-type]
    return out


def test_only_the_debug_module_sets_the_path_recorder():
    """The path recorder is a hook: the workspace starts it unset (None) and only debug.record sets it. The
    control: the check sees debug.py's own assignment."""
    assert _sets_the_hook((PACKAGE / "workspace" / "debug.py").read_text()) == ["ws.variants_run.add"]
    found = {p.relative_to(PACKAGE).as_posix(): _sets_the_hook(p.read_text()) for p in PACKAGE.rglob("*.py")
             if p.name != "debug.py"}
    assert {p: v for p, v in found.items() if v} == {"workspace/workspace.py": ["None"]}
