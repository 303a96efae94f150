"""What the group's ranks share physically: the host, the GPU, and the link between their GPUs.

Found once at init (collective: one all_gather_object of each rank's facts) and shown in the route table's
header. What it decides:
- the CUDA-IPC workspace is armed only when every rank runs on the same host (CUDA IPC handles do not cross
  hosts); a multi-host group keeps the collective-library routes (gather_fold, rs_ag_fold, a2a_fold) and the
  table says why, without trying to arm;
- the number of hosts is a routing fact: across hosts a rank's link is a NIC, so rs_ag_fold pays from smaller
  sites on (route.py's break-even rule);
- everything else is reported, not acted on: the link (NVLink, PCIe or "same GPU" when ranks share one
  device) explains the speed a user sees, and the workspace still proves peer access with a real write and
  read-back before any site uses it (a driver's P2P report is not trusted for correctness).

A rank's host is ``socket.gethostname()``, unless ``DETCOMM_HOSTS`` names every rank's host: a comma-separated
list indexed by the global rank (``DETCOMM_HOSTS=a,a,b,b``: ranks 0-1 on host a, 2-3 on host b), the same on
every rank. It exists to simulate a multi-host group on one machine (tests, and checking a deployment's routes
before it has its nodes); every decision above then follows the named hosts, not the real one.

The link comes from NVML (pynvml, from the nvidia-ml-py package: the ``cuda12``/``cuda13`` extras install it):
``nvmlDeviceGetP2PStatus(..., NVML_P2P_CAPS_INDEX_NVLINK)`` between the local GPUs of the group. Without
pynvml the link reads "unknown (pip install nvidia-ml-py)". Rejected: parsing ``nvidia-smi topo -m`` (a
subprocess per init, and its text format is not an interface).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HOSTS_ENV", "RankFacts", "Topology", "discover", "from_facts", "host_name"]

HOSTS_ENV = "DETCOMM_HOSTS"

_log = logging.getLogger("detcomm")


@dataclass(frozen=True)
class RankFacts:
    host: str
    device_index: int
    pci_bus_id: str


@dataclass(frozen=True)
class Topology:
    """The group's physical layout, identical on every rank."""

    same_host: bool
    gpus: int  # distinct GPUs in the group (0 on a CPU group)
    link: str  # "nvlink", "pcie", "same GPU", "multi-host", "CPU" or "unknown (...)"
    hosts: int = 1

    def describe(self) -> str:
        host = "one host" if self.same_host else f"{self.hosts} hosts"
        if self.link == "CPU":
            return f"CPU, {host}"
        return f"{host}, {self.gpus} GPU(s), link: {self.link}"


def host_name(rank: int, world_size: int, env: Mapping[str, str] = os.environ) -> str:
    """The host of global rank ``rank`` of ``world_size``: ``DETCOMM_HOSTS``'s entry where it is set, else this
    machine's host name. Local."""
    spec = env.get(HOSTS_ENV, "").strip()
    if not spec:
        return socket.gethostname()
    hosts = [h.strip() for h in spec.split(",")]
    if len(hosts) != world_size or not all(hosts):
        raise ValueError(f"{HOSTS_ENV}={spec!r} names {len(hosts)} hosts for {world_size} ranks: it must name one "
                         "non-empty host per global rank, comma-separated (at W=4 on two simulated hosts: "
                         f"{HOSTS_ENV}=a,a,b,b); unset it to use the real host names")
    return hosts[rank]


def _local_facts(device: torch.device) -> RankFacts:
    host = host_name(dist.get_rank(), dist.get_world_size())
    if device.type != "cuda":
        return RankFacts(host, -1, "")
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    # NVML's bus id spelling: 8 hex digits of domain, then bus and device.
    bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}"  # type: ignore[attr-defined]
    return RankFacts(host, index, bus)


def _nvml_link(bus_ids: list[str]) -> str:
    """NVLink when every pair of the group's GPUs reports NVLink P2P, else PCIe; "unknown" without NVML."""
    try:
        import pynvml  # noqa: PLC0415 - optional: the cuda extras install nvidia-ml-py
    except ImportError:
        return "unknown (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        try:
            handles = [pynvml.nvmlDeviceGetHandleByPciBusId(f"{b}.0") for b in bus_ids]
            ok = pynvml.NVML_P2P_STATUS_OK
            for i, a in enumerate(handles):
                for b in handles[i + 1:]:
                    if pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) != ok:
                        return "pcie"
            return "nvlink"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - NVML is a report here, never a reason to fail init
        return f"unknown (NVML: {type(e).__name__}: {e})"


def from_facts(facts: list[RankFacts]) -> Topology:
    """The topology of ranks whose facts are ``facts`` (pure; every rank computes the same answer)."""
    hosts = {f.host for f in facts}
    if all(f.device_index < 0 for f in facts):
        return Topology(len(hosts) == 1, 0, "CPU", len(hosts))
    gpus = {(f.host, f.pci_bus_id) for f in facts}
    if len(hosts) > 1:
        return Topology(False, len(gpus), "multi-host", len(hosts))
    if len(gpus) == 1:
        return Topology(True, 1, "same GPU")
    return Topology(True, len(gpus), "")


def discover(group: dist.ProcessGroup, device: torch.device) -> Topology:
    """The topology of a group whose ranks keep their tensors on ``device``'s type. Collective (one
    all_gather_object)."""
    mine: Any = _local_facts(device)
    facts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(facts, mine, group=group)
    topo = from_facts(facts)
    if topo.link == "":
        # Every rank asks NVML about the same GPUs, so every rank reaches the same answer.
        topo = Topology(True, topo.gpus, _nvml_link(sorted({f.pci_bus_id for f in facts})))
    return topo
