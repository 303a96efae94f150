"""Route implementations, one mechanism per file. Each backend's ``bind(site)`` returns the route.BoundRoute
the communicator calls (base.py)."""

from .a2a_fold import A2AFoldBackend
from .base import Bound
from .gather_fold import GatherFoldBackend
from .native import NativeBackend
from .rs_ag_fold import RsAgFoldBackend

__all__ = ["Bound", "NativeBackend", "GatherFoldBackend", "A2AFoldBackend", "RsAgFoldBackend"]
