"""TransferMesh: topology-aware, versioned, bucketed weight sync from the trainer to
the engines (see mesh.py for the driver side, endpoints.py for the actor side, and one
module per transport: inproc, shm, gloo, zmq_stream, cuda_ipc, nccl)."""
from .config import TRANSPORTS, TransferConfig
from .endpoints import Receiver, Sender, WeightTarget
from .errors import TransferError
from .layout import Layout, checksum
from .mesh import TransferMesh
from .routes import Route, plan_route
from .topology import Party, format_table

__all__ = ["TRANSPORTS", "TransferConfig", "TransferMesh", "TransferError", "Sender",
           "Receiver", "WeightTarget", "Route", "plan_route", "Party", "format_table",
           "Layout", "checksum"]
