"""Route implementations. Each file is one mechanism behind the ``Backend`` protocol of ``base``."""

from .a2a_fold import A2AFoldBackend
from .base import Backend
from .gather_fold import GatherFoldBackend
from .native import NativeBackend

__all__ = ["Backend", "NativeBackend", "GatherFoldBackend", "A2AFoldBackend"]
