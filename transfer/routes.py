"""Route planning: for each receiver, the fastest transport that can reach it.

Each transport has a reach rule: given the sender and a receiver it returns why it can
carry the weights between them, or None. Auto planning takes the first transport (in
TRANSPORTS order, fastest first) that both processes run and whose rule holds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config import TRANSPORTS
from .errors import TransferError
from .topology import Party


@dataclass(frozen=True)
class Route:
    transport: str
    reason: str


def _same_process(s: Party, r: Party) -> str | None:
    if s.node_id == r.node_id and s.pid == r.pid:
        return f"same process (pid {s.pid})"
    return None


def _same_gpu(s: Party, r: Party) -> str | None:
    if s.on_gpu and r.on_gpu and s.device_uuid and s.device_uuid == r.device_uuid:
        return f"same GPU ({s.device_uuid[:18]})"
    return None


def _gpu_to_gpu(s: Party, r: Party) -> str | None:
    if s.on_gpu and r.on_gpu:
        where = "same node" if s.node_id == r.node_id else "across nodes"
        return f"GPU to another GPU, {where}"
    return None


def _same_node(s: Party, r: Party) -> str | None:
    if s.node_id == r.node_id:
        return f"same node ({s.node_id[:12]}), through host memory"
    return None


def _network(s: Party, r: Party) -> str | None:
    if s.node_id == r.node_id:
        return "same node, over loopback"
    return f"across nodes ({s.node_id[:12]} -> {r.node_id[:12]}), over TCP"


REACH: dict[str, Callable[[Party, Party], str | None]] = {
    "inproc": _same_process,
    "cuda_ipc": _same_gpu,
    "nccl": _gpu_to_gpu,
    "shm": _same_node,
    "gloo": _network,
    "zmq": _network,
}
assert tuple(REACH) == TRANSPORTS


# what a process needs to run a transport it does not offer (topology.py decides what it offers)
NEEDS = {"cuda_ipc": "a CUDA device", "nccl": "a CUDA device and CuPy with NCCL (pip install 'loongsage[cupy]')"}


def _lacking(transport: str, sender: Party, receiver: Party) -> str:
    """'sender', 'receiver', 'sender and receiver': which process does not run `transport`."""
    return " and ".join(who for who, p in (("sender", sender), ("receiver", receiver))
                        if transport not in p.transports)


def _missing(candidates, sender: Party, receiver: Party) -> str:
    """Why a forced transport is not run by one of the two processes (auto planning names none)."""
    if len(candidates) != 1 or candidates[0] not in NEEDS or not _lacking(candidates[0], sender, receiver):
        return ""
    t = candidates[0]
    return f" ({_lacking(t, sender, receiver)} cannot run {t}: it needs {NEEDS[t]})"


def plan_route(sender: Party, receiver: Party, transport: str = "auto") -> Route:
    """The route for one receiver. `transport` forces one (an error if it cannot reach)."""
    candidates = TRANSPORTS if transport == "auto" else (transport,)
    for name in candidates:
        why = REACH[name](sender, receiver)
        if why and name in sender.transports and name in receiver.transports:
            if transport != "auto":
                why = f"forced by transfer.transport; {why}"
            elif name == "zmq":
                why = f"fallback; {why}"
            slower = TRANSPORTS.index(name) > TRANSPORTS.index("nccl")
            if transport == "auto" and slower and _gpu_to_gpu(sender, receiver) and _lacking("nccl", sender, receiver):
                why += f"; not nccl: the {_lacking('nccl', sender, receiver)} lacks {NEEDS['nccl']}"
            return Route(name, why)
    raise TransferError(
        f"no transport in {list(candidates)} reaches it{_missing(candidates, sender, receiver)}: "
        f"sender {sender.device} pid "
        f"{sender.pid} on node {sender.node_id[:12]} runs {list(sender.transports)}, "
        f"receiver {receiver.device} pid {receiver.pid} on node {receiver.node_id[:12]} "
        f"runs {list(receiver.transports)}",
        receiver=receiver.name, transport=transport, version=None)
