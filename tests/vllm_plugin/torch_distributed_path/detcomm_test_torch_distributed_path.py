"""A vLLM general plugin for the negative control of tests/vllm_plugin only: vLLM's CPU communicator takes its
torch.distributed (gloo) path instead of its shared-memory kernel.

vLLM 0.32's ``CpuCommunicator`` uses its shared-memory all-reduce (``_CPUSHMDistributed``) wherever its C extension
has one and the ranks agree on the segment's name, else torch.distributed. The shared-memory kernel sums each
element in one fixed order whatever the tensor's size, so at a fixed TP size it is batch-invariant (measured: alone
== packed for all 8 requests at TP = 4); it is not the canonical fold. gloo's ring at W = 4 sums in an order that
follows the tensor's size: the end-to-end control needs that path. vLLM's own fallback (the ranks disagree on the
segment's name) is the switch, so nothing else in vLLM changes. Put on ``PYTHONPATH`` only for the control's run
(tests/vllm_plugin/vllm_engine.py); vLLM loads general plugins in every process, its workers included.
"""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    CpuCommunicator._all_group_ranks_share_shm_group_name = lambda self: False
