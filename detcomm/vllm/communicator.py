"""vLLM device communicators whose TP reductions are detcomm's (the platforms of detcomm/vllm/platform.py return
these classes from ``get_device_communicator_cls``).

vLLM builds one device communicator per process group (world, TP, PP, DP, EP ...). Only the TP group's, with more
than one rank, starts detcomm (``tp.attach``): its ``all_reduce`` and ``reduce_scatter`` of floating-point tensors
become detcomm calls, every other collective (gathers, broadcasts, point-to-point: data movement, exact) and every
other group stays vLLM's. Integer and bool all-reduces stay vLLM's too: an integer sum is exact in any order.

With the plugin off and ``DETCOMM_VLLM_AUDIT`` set, the same classes leave vLLM's arithmetic alone and only
record its TP all-reduces (the negative control of tests/vllm_plugin).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from . import settings as _settings
from . import tp

__all__ = [  # noqa: F822  (the CUDA class is built on first use, by __getattr__)
    "DetcommCpuCommunicator", "DetcommCudaCommunicator", "scheduler_max_rows"]


def scheduler_max_rows() -> int:
    """The most token rows one forward step carries: vLLM's scheduler budget (``max_num_batched_tokens``), which
    the warm-up and profiling runs also use."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is None or cfg.scheduler_config is None:
        raise RuntimeError("detcomm: vLLM built its TP group outside a vLLM config context, so the scheduler's "
                           "token budget (the sites' max_rows) is unknown; report the vLLM version (docs/vllm.md)")
    return int(cfg.scheduler_config.max_num_batched_tokens)


class _Detcomm:
    """The part both communicators share (a mixin ahead of vLLM's class in the MRO)."""

    unique_name: str
    world_size: int
    rank_in_group: int
    device_group: Any
    device: torch.device

    def _start_detcomm(self) -> None:
        self.detcomm: tp.TPGroup | None = None
        self.detcomm_audit: tp.Audit | None = None
        if self.unique_name.split(":")[0] != "tp" or self.world_size == 1:
            return
        s = _settings.read()
        if s.enabled:
            self.detcomm = tp.attach(group=self.device_group, unique_name=self.unique_name, device=self.device,
                                     settings=s, max_rows=scheduler_max_rows())
        elif s.audit_dir:
            self.detcomm_audit = tp.Audit(s.audit_dir, rank=self.rank_in_group, world_size=self.world_size,
                                          path="vllm", mechanism=self.vllm_mechanism())
            tp.AUDITED[self.unique_name] = self

    def _site(self, collective: str, x: torch.Tensor) -> str:
        # Built from the tensor's static facts (dtype, row shape) while torch.compile traces; declared by the op.
        return f"{tp.CATCH_ALL}{self.unique_name.split(':')[0]}.{collective}.{tp.describe(x)}"

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if self.detcomm is not None and input_.is_floating_point():
            x = input_ if input_.dim() > 1 else input_.reshape(-1, 1)
            return torch.ops.detcomm.vllm_all_reduce(x, self._site("all_reduce", x)).reshape(input_.shape)
        if self.detcomm_audit is not None and input_.is_floating_point():
            return torch.ops.detcomm.vllm_audited_all_reduce(input_, self.unique_name)
        return super().all_reduce(input_)  # type: ignore[misc]

    def vllm_mechanism(self) -> str:
        """Which of vLLM's reductions this communicator's ``all_reduce`` runs: vLLM's CPU communicator picks its
        shared-memory kernel (``_CPUSHMDistributed``) where its C extension has one and the ranks agree on the
        segment's name, else ``torch.distributed`` (gloo). The two sum in different orders (docs/vllm.md)."""
        module = getattr(self, "dist_module", None)
        if module is None:
            # vLLM's CUDA communicator dispatches per call (custom all-reduce, symmetric memory, pynccl): its class.
            return next(c.__name__ for c in type(self).__mro__ if c.__module__.startswith("vllm."))
        if module is torch.distributed:
            return f"torch.distributed/{torch.distributed.get_backend(self.device_group)}"
        return type(module).__name__

    def vllm_all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """vLLM's own all-reduce (the audit's path)."""
        return super().all_reduce(input_)  # type: ignore[misc]

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.detcomm is None or not input_.is_floating_point():
            return super().reduce_scatter(input_, dim)  # type: ignore[misc]
        if input_.shape[dim] % self.world_size:
            raise ValueError(f"detcomm: reduce_scatter over dim {dim} of {tuple(input_.shape)}: the size must divide "
                             f"by the TP size {self.world_size}")
        x = input_.movedim(dim, 0).contiguous()
        x = x if x.dim() > 1 else x.reshape(-1, 1)
        y = torch.ops.detcomm.vllm_reduce_scatter(x, self._site("reduce_scatter", x))
        shape = list(input_.movedim(dim, 0).shape)
        shape[0] //= self.world_size
        return y.reshape(shape).movedim(0, dim).contiguous()

    def destroy(self) -> None:
        if self.detcomm is not None:
            tp.detach()
            self.detcomm = None
        super().destroy()  # type: ignore[misc]


class DetcommCpuCommunicator(_Detcomm, CpuCommunicator):
    """vLLM's CPU communicator with the TP reductions on detcomm (gloo: the gather_fold route)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start_detcomm()


def _cuda_class() -> type:
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    class DetcommCudaCommunicator(_Detcomm, CudaCommunicator):
        """vLLM's CUDA communicator with the TP reductions on detcomm: the CUDA-IPC workspace (ipc_fold) on one
        node's GPUs, else gather_fold over vLLM's NCCL group. The platform turns vLLM's custom all-reduce off
        (its buffers would only cost memory); the sites are declared before vLLM captures its CUDA graphs, and
        detcomm's routes are capturable (a captured call carries no host-side guard, docs/spec.md §2)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._start_detcomm()

    return DetcommCudaCommunicator


def __getattr__(name: str) -> Any:
    # The CUDA class is built on first use: vllm's CUDA communicator module imports CUDA-only pieces.
    if name == "DetcommCudaCommunicator":
        cls = _cuda_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
