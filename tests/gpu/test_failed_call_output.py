"""A failed workspace call's output (docs/spec.md §9.3): no element holds a value computed from incomplete inputs,
and the failure is raised by the next call or by synchronize, never swallowed. One GPU, W = 3 ranks as streams
(Workspace.in_process); rank 2 never launches, so no row's inputs all arrive and no element may be written.

The negative control runs the same call with every rank present: it writes the canonical fold (tests/oracle.py)
over the same sentinel, so the "untouched" check can fail."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("algo", ["one_store", "one_shot", "two_shot"])
def test_a_failed_call_writes_no_element_and_raises_before_its_output_is_trusted(algo: str) -> None:
    script = f"""
        import numpy as np
        import torch
        from detcomm.errors import WorkspaceFailed
        from detcomm.workspace import Workspace
        from oracle import fold_oracle

        def run(ranks):
            views = Workspace.in_process(3, device="cuda:0", capacity_bytes=1 << 16, timeout_s=0.3,
                                         one_store_max_bytes=1 << 16)
            streams = [torch.cuda.Stream() for _ in views]
            xs = [torch.full((8, 256), float(r + 1), device="cuda:0") for r in range(3)]
            outs = [torch.full((8, 256), float("nan"), device="cuda:0") for _ in range(3)]
            for r in ranks:
                with torch.cuda.stream(streams[r]):
                    views[r].all_reduce(xs[r], out=outs[r], algo="{algo}", label="site.failed")
            torch.cuda.synchronize()  # waits for the kernels; raises nothing
            raised = []
            for r in ranks:
                try:
                    views[r].synchronize()
                except WorkspaceFailed:
                    raised.append(r)
            return outs, raised

        outs, raised = run((0, 1))
        print("FAILED-RAISED", raised)
        print("FAILED-WRITTEN", [int((~torch.isnan(outs[r])).sum()) for r in (0, 1)])
        outs, raised = run((0, 1, 2))
        want = fold_oracle([np.full((8, 256), float(r + 1), dtype=np.float32).view(np.uint32) for r in range(3)],
                           "float32")
        print("CONTROL-RAISED", raised)
        print("CONTROL-EQUAL", all(np.array_equal(outs[r].cpu().numpy().view(np.uint32), want) for r in range(3)))
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=180,
                       check=False, env=env, cwd=REPO)
    out = p.stdout + p.stderr
    assert "FAILED-RAISED [0, 1]" in out, out
    assert "FAILED-WRITTEN [0, 0]" in out, out  # every element still the NaN sentinel
    assert "CONTROL-RAISED []" in out and "CONTROL-EQUAL True" in out, out
