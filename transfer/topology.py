"""Topology discovery: who holds weights where.

Each endpoint describes its own process (Ray node, host, pid, device) once; the mesh
collects these records into a plain table that route planning reads and people print."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from .config import TRANSPORTS


@dataclass(frozen=True)
class Party:
    name: str
    role: str                 # "sender" or "receiver"
    node_id: str              # Ray node id: the unit of "same host" for planning
    ip: str                   # where this party's sockets listen
    pid: int
    device: str               # "cpu" or "cuda:<index>"
    device_uuid: str          # GPU UUID ("" on CPU): equal UUIDs mean the same physical GPU
    transports: tuple[str, ...]   # the transports this process can run

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


def local_device(device: str | torch.device | None = None) -> str:
    """The device this process keeps its weights on. None: the GPU Ray gave the actor,
    if any, else CPU."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:   # name the GPU: "cuda:N"
            device = torch.device("cuda", torch.cuda.current_device())
        return str(device)
    import ray
    if torch.cuda.is_available() and ray.is_initialized() and ray.get_gpu_ids():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _available_transports(device: str) -> tuple[str, ...]:
    import torch.distributed as dist

    from .nccl import available as nccl_available  # CuPy's NCCL communicator: looked for, not imported
    gpu = device.startswith("cuda")
    have = {"inproc": True, "zmq": True, "shm": os.path.isdir("/dev/shm"), "cuda_ipc": gpu,
            "gloo": dist.is_available() and dist.is_gloo_available(), "nccl": gpu and nccl_available()}
    return tuple(t for t in TRANSPORTS if have[t])


def describe_process(role: str, device: str) -> Party:
    """Describe the calling process. Runs inside the actor that holds the weights."""
    import ray
    uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid) if device.startswith("cuda") else ""
    return Party(name="", role=role, node_id=ray.get_runtime_context().get_node_id(),
                 ip=ray.util.get_node_ip_address(), pid=os.getpid(), device=device, device_uuid=uuid,
                 transports=_available_transports(device))


def format_table(parties: Iterable[Party], routes: Mapping[str, object]) -> str:
    """One line per party; receivers also show the route chosen for them."""
    header = ("name", "role", "node", "ip", "pid", "device", "gpu uuid", "route")
    rows = [header] + [(p.name, p.role, p.node_id[:12], p.ip, str(p.pid), p.device, p.device_uuid[:18] or "-",
                        f"{route.transport}: {route.reason}" if (route := routes.get(p.name)) else "-")
                       for p in parties]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]
                     for r in rows)
