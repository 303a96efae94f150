"""The oldest torch the package supports, checked where the package first imports torch.

``pyproject.toml`` declares ``torch>=2.11`` and CI's second job (.ci/torch_floor.sh) runs the backend, trainer
and core tests on exactly that torch, so the declared range is tested at both ends (2.11 there, the main job's
2.13). An older torch is refused at import with the version needed, instead of failing later inside a
collective (issue 40 item 10: torch before 2.13 has no ``ReduceOp.factor``, and nothing older than 2.11 runs in
CI, so nothing older is claimed)."""

from __future__ import annotations

import re

TORCH_FLOOR = (2, 11)


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.11.0+cu130", "2.13.0a0+git...")."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def require(version: str) -> None:
    """Raise ImportError naming the version needed unless ``version`` is at least ``TORCH_FLOOR``. Local."""
    if parse(version) < TORCH_FLOOR:
        need = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"detcomm needs torch >= {need} (the oldest version its CI tests); this is torch "
                          f"{version}. Install a newer torch, e.g. pip install 'torch>={need}' --index-url "
                          "https://download.pytorch.org/whl/cpu (or your CUDA build's index)")
