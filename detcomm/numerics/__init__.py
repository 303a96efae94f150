"""The numerics: the canonical fold and its leaves (fold, cuda_leaf), the order keys of the selections (keys),
and the canonical RMSNorm (norm, norm_cuda). Pure arithmetic from docs/spec.md: no group, no route.

The CUDA fold leaf registers itself where cupy is installed. It is imported here, by the package, so that every
import of the fold (``detcomm.numerics.fold`` loads this package first) finds it registered, while the fold's
registry imports none of its leaves."""

from . import cuda_leaf as _cuda_leaf  # noqa: F401
