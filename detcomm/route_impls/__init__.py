"""Route implementations, one mechanism per file. Each backend's ``bind(site)`` returns the route.BoundRoute
the communicator calls (base.py)."""

from .a2a_fold import A2AFoldRoute
from .base import Bound
from .gather_fold import GatherFoldRoute
from .native import NativeRoute
from .rs_ag_fold import RsAgFoldRoute

__all__ = ["Bound", "NativeRoute", "GatherFoldRoute", "A2AFoldRoute", "RsAgFoldRoute"]
