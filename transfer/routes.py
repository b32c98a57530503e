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


def _network(s: Party, r: Party) -> str:
    if s.node_id == r.node_id:
        return "same node, over loopback"
    return f"across nodes ({s.node_id[:12]} -> {r.node_id[:12]}), over TCP"


REACH: dict[str, Callable[[Party, Party], str | None]] = {
    "inproc": lambda s, r: f"same process (pid {s.pid})" if (s.node_id, s.pid) == (r.node_id, r.pid) else None,
    "cuda_ipc": lambda s, r: (f"same GPU ({s.device_uuid[:18]})"
                              if s.on_gpu and s.device_uuid and s.device_uuid == r.device_uuid else None),
    "nccl": lambda s, r: (f"GPU to another GPU, {'same node' if s.node_id == r.node_id else 'across nodes'}"
                          if s.on_gpu and r.on_gpu else None),
    "shm": lambda s, r: f"same node ({s.node_id[:12]}), through host memory" if s.node_id == r.node_id else None,
    "gloo": _network,
    "zmq": _network,
}
assert tuple(REACH) == TRANSPORTS

# what a process needs to run a transport it does not offer (topology.py decides what it offers)
NEEDS = {"cuda_ipc": "a CUDA device", "nccl": "a CUDA device and CuPy with NCCL (pip install 'loongsage[cupy]')"}


def _lacking(transport: str, sender: Party, receiver: Party) -> str:
    """'sender', 'receiver', 'sender and receiver': which process does not run `transport`."""
    return " and ".join(who for who, p in (("sender", sender), ("receiver", receiver)) if transport not in p.transports)


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
            if transport == "auto" and slower and REACH["nccl"](sender, receiver) and \
                    (lacking := _lacking("nccl", sender, receiver)):
                why += f"; not nccl: the {lacking} lacks {NEEDS['nccl']}"
            return Route(name, why)
    lacking = _lacking(transport, sender, receiver) if transport in NEEDS else ""
    missing = f" ({lacking} cannot run {transport}: it needs {NEEDS[transport]})" if lacking else ""
    raise TransferError(
        f"no transport in {list(candidates)} reaches it{missing}: sender {sender.device} pid {sender.pid} on node "
        f"{sender.node_id[:12]} runs {list(sender.transports)}, receiver {receiver.device} pid {receiver.pid} on node "
        f"{receiver.node_id[:12]} runs {list(receiver.transports)}",
        receiver=receiver.name, transport=transport, version=None)
