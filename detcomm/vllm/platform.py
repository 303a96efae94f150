"""vLLM platforms whose only change is the device communicator (and the settings that communicator needs).

``DetcommCpuPlatform`` and ``DetcommCudaPlatform`` subclass vLLM's own CPU and CUDA platforms, so every kernel,
attention backend and memory decision stays vLLM's; ``get_device_communicator_cls`` names detcomm's communicator
(detcomm/vllm/communicator.py), and ``check_and_update_config``, after vLLM's own, turns off what would bypass it:

* the all-reduce + RMSNorm fusion pass (``pass_config.fuse_allreduce_rms``, CUDA): it rewrites vLLM's
  ``torch.ops.vllm.all_reduce`` into FlashInfer's fused kernel, whose sum order is its own. The plugin's layers
  call detcomm's op, which the pass does not match; the flag goes off as well so that no other caller is fused;
* vLLM's custom all-reduce (``disable_custom_all_reduce``, CUDA): detcomm's communicator answers every float TP
  all-reduce, so the custom all-reduce's IPC buffers would only cost memory;
* and it keys vLLM's compile cache with the plugin's settings (``additional_config["detcomm"]``): a graph compiled
  without the plugin, or with another layout, calls other ops and must not be reused.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform

from . import settings as _settings

__all__ = [  # noqa: F822  (the CUDA class is built on first use, by __getattr__)
    "DetcommCpuPlatform", "DetcommCudaPlatform", "adjust_config"]

_CPU_COMMUNICATOR = "detcomm.vllm.communicator.DetcommCpuCommunicator"
_CUDA_COMMUNICATOR = "detcomm.vllm.communicator.DetcommCudaCommunicator"


def adjust_config(vllm_config: Any, *, cuda: bool) -> None:
    """The plugin's changes to a vLLM config, after the platform's own ``check_and_update_config``."""
    s = _settings.read()
    extra = vllm_config.additional_config
    if isinstance(extra, dict):
        extra["detcomm"] = s.fingerprint()
    pass_config = getattr(vllm_config.compilation_config, "pass_config", None)
    if s.enabled and pass_config is not None and getattr(pass_config, "fuse_allreduce_rms", False):
        pass_config.fuse_allreduce_rms = False
    if s.enabled and cuda:
        vllm_config.parallel_config.disable_custom_all_reduce = True


class DetcommCpuPlatform(CpuPlatform):
    """vLLM's CPU platform with detcomm's TP communicator."""

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return _CPU_COMMUNICATOR

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        super().check_and_update_config(vllm_config)
        adjust_config(vllm_config, cuda=False)


def _cuda_platform() -> type:
    from vllm.platforms.cuda import CudaPlatform

    class DetcommCudaPlatform(CudaPlatform):  # type: ignore[misc,valid-type]
        """vLLM's CUDA platform with detcomm's TP communicator."""

        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return _CUDA_COMMUNICATOR

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            super().check_and_update_config(vllm_config)
            adjust_config(vllm_config, cuda=True)

    DetcommCudaPlatform.__module__ = __name__
    return DetcommCudaPlatform


def __getattr__(name: str) -> Any:
    # Built on first use: vllm.platforms.cuda needs a CUDA build of vLLM.
    if name == "DetcommCudaPlatform":
        cls = _cuda_platform()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
