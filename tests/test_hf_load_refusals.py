"""detcomm.hf.load refuses a checkpoint that is not the config's, on every rank with one message (issue 40, items
3, 4, 5 and 15), on real spawned gloo ranks at W = 3: tensors stored larger than the config (a rank's slice alone
would load), a tensor missing under sliced=False (from_pretrained would initialise it at random), a tensor only
one rank's slice finds short, a file that one rank's copy has cut short, and a truncated file, named.

Oracle: the refusals are checked against the definition (each stored tensor's full shape must be the unsharded
parameter's, transformers' module names both ways), by the tensor names and shapes written into each mutated
copy. Negative control: the unmutated checkpoint loads on every rank, sliced and whole, and its parameters hold
the checkpoint's bits (rank r's o_proj columns, compared bit for bit with a numpy slice of the file).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from clusters import get_cluster  # noqa: E402
from detcomm.hf import write_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

W = 3
O_PROJ = "model.layers.1.self_attn.o_proj.weight"  # llama-tiny: (192, 192), cut by columns (64 a rank at W = 3)
UP_PROJ = "model.layers.0.mlp.up_proj.weight"  # (384, 192), cut by rows (128 a rank)


def job_load(rank: int, w: int, dirs: list[str], sliced: bool) -> tuple[str, str] | tuple[str, np.ndarray]:
    """detcomm.hf.load of ``dirs[rank]`` (each rank its own copy): ("ok", this rank's o_proj bits) or
    (exception type, message)."""
    import detcomm
    import detcomm.hf

    torch.set_num_threads(1)
    detcomm.init(numerics="rl-bitwise")
    try:
        lm = detcomm.hf.load(dirs[rank], dtype=torch.float32, sliced=sliced)
        o = lm.model.model.layers[1].self_attn.o_proj.weight
        return "ok", o.detach().contiguous().view(torch.int32).numpy().copy()
    except Exception as e:  # noqa: BLE001 - the test compares every rank's error
        return type(e).__name__, str(e)
    finally:
        detcomm.shutdown()


def _mutate(good: str, bad: str, change) -> str:  # noqa: ANN001 - a function of the tensors dict
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    return bad


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:  # noqa: ANN001
    base = tmp_path_factory.mktemp("refusals")
    good = write_tiny_checkpoint("llama-tiny", str(base / "good"), seed=21)
    out = {"good": good}

    def larger(t: dict) -> None:  # o_proj with 48 extra columns, up_proj with 96 extra rows
        t[O_PROJ] = torch.cat([t[O_PROJ], torch.ones(192, 48)], dim=1).contiguous()
        t[UP_PROJ] = torch.cat([t[UP_PROJ], torch.ones(96, 192)]).contiguous()

    def short(t: dict) -> None:  # 180 columns: only rank 2's slice [128, 192) runs past the end
        t[O_PROJ] = t[O_PROJ][:, :180].contiguous()

    def missing(t: dict) -> None:
        del t[UP_PROJ]
        t["model.layers.0.mlp.extra.weight"] = torch.zeros(4)

    out["larger"] = _mutate(good, str(base / "larger"), larger)
    out["short"] = _mutate(good, str(base / "short"), short)
    out["missing"] = _mutate(good, str(base / "missing"), missing)
    trunc = str(base / "truncated")
    shutil.copytree(good, trunc)
    path = os.path.join(trunc, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 4096)  # an interrupted copy
    out["truncated"] = trunc
    return out


def _same_error_everywhere(results: list, kind: str = "ValueError") -> str:
    assert all(r[0] == kind for r in results), [r[0] for r in results]
    assert len({r[1] for r in results}) == 1, [r[1] for r in results]
    return results[0][1]


def test_good_checkpoint_loads_with_its_bits(ckpts: dict[str, str]) -> None:
    """Negative control: the unmutated checkpoint loads, sliced and whole, and rank r holds columns
    [64 r, 64 (r + 1)) of o_proj, bit for bit."""
    from safetensors.numpy import load_file

    ref = load_file(os.path.join(ckpts["good"], "model.safetensors"))[O_PROJ]
    for sliced in (True, False):
        results = get_cluster(W).run(job_load, [ckpts["good"]] * W, sliced)
        for r, (status, bits) in enumerate(results):
            assert status == "ok", bits
            want = np.ascontiguousarray(ref[:, r * 64 : (r + 1) * 64]).view(np.int32)
            assert np.array_equal(bits, want), (sliced, r)


def test_tensors_stored_larger_than_the_config_are_refused(ckpts: dict[str, str]) -> None:
    """Item 3: each stored tensor's full shape against the unsharded parameter's, on every rank."""
    msg = _same_error_everywhere(get_cluster(W).run(job_load, [ckpts["larger"]] * W, True))
    assert f"{O_PROJ} is (192, 240) in the checkpoint, (192, 192) in the model" in msg, msg
    assert f"{UP_PROJ} is (480, 192) in the checkpoint, (384, 192) in the model" in msg, msg
    assert "ranks 0, 1, 2 found" in msg, msg


def test_missing_and_unexpected_tensors_are_refused_whole_and_sliced(ckpts: dict[str, str]) -> None:
    """Item 4: sliced=False (from_pretrained would initialise up_proj at random) and the sliced load both name the
    missing and the unexpected tensor."""
    for sliced in (False, True):
        msg = _same_error_everywhere(get_cluster(W).run(job_load, [ckpts["missing"]] * W, sliced))
        assert "missing from the checkpoint" in msg and UP_PROJ in msg, msg
        assert "model.layers.0.mlp.extra.weight" in msg, msg


def test_a_tensor_short_for_one_rank_is_refused_on_every_rank(ckpts: dict[str, str]) -> None:
    """Item 5: o_proj stored (192, 180), which only rank 2's slice runs past: every rank raises, the same error."""
    msg = _same_error_everywhere(get_cluster(W).run(job_load, [ckpts["short"]] * W, True))
    assert f"{O_PROJ} is (192, 180) in the checkpoint, (192, 192) in the model" in msg, msg


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "whole"])
def test_a_file_only_one_rank_cannot_read_is_refused_on_every_rank(ckpts: dict[str, str], sliced: bool) -> None:
    """Items 5 and 15: rank 1's copy of the checkpoint is cut short (an interrupted copy on its host), the other
    ranks' copies are whole: every rank raises the same ValueError, naming rank 1 and the file."""
    dirs = [ckpts["good"], ckpts["truncated"], ckpts["good"]]
    msg = _same_error_everywhere(get_cluster(W).run(job_load, dirs, sliced))
    assert "rank 1 found" in msg and os.path.join(ckpts["truncated"], "model.safetensors") in msg, msg
    assert "ranks 0, 2 found nothing wrong" in msg, msg


def test_a_truncated_file_is_named(ckpts: dict[str, str]) -> None:
    """Item 15: the truncated file is named, sliced and whole."""
    for sliced in (True, False):
        msg = _same_error_everywhere(get_cluster(W).run(job_load, [ckpts["truncated"]] * W, sliced))
        assert os.path.join(ckpts["truncated"], "model.safetensors") in msg and "cannot be read" in msg, msg
