"""The transport interface, and the registry that maps a transport name to its module.

Every transport is one module with two classes, one per side of the wire:

  SendLink(mesh_id, receivers, cfg, party, staging)    lives in the sender process
      prepare(snapshot) -> dict  get ready for snapshot.version; return what receivers need
                                 to connect (picklable; the driver passes it on)
      send(snapshot) -> None     move every bucket of snapshot.version to `receivers`
      close() -> None
  RecvLink(mesh_id, name, address, cfg, party)         lives in one receiver process
      receive(version, layout, verify) -> dict[str, Tensor]
          land every bucket, call verify(i, bucket_bytes, checksum) as each arrives, and
          return the version's tensors (views into the link's buffer; valid until the
          next receive). A link whose bytes are there before their checksum (shm, zero
          copy) calls got = verify.land(i, bucket_bytes) and later verify.check(i, got, checksum).
      close() -> None

A link raises on any failure (TransferError where it knows the bucket); every wait in it
is bounded by cfg.timeout_s. The endpoints own checksums, metrics and error naming."""
from __future__ import annotations

import importlib
from typing import Callable, Protocol

import torch

from .layout import Layout
from .staging import Snapshot

Verify = Callable[[int, torch.Tensor, int], None]


class SendLink(Protocol):
    needs_staging: bool       # True: reads the packed host copy (CPU transports)

    def prepare(self, snapshot: Snapshot) -> dict: ...
    def send(self, snapshot: Snapshot) -> None: ...
    def close(self) -> None: ...


class RecvLink(Protocol):
    def receive(self, version: int, layout: Layout, verify: Verify) -> dict[str, torch.Tensor]: ...
    def close(self) -> None: ...


# transport name -> (module, sender class, receiver class). Modules import lazily, so a
# CPU-only process never touches CUDA code.
_REGISTRY = {
    "inproc": ("inproc", "InprocSend", "InprocRecv"),
    "shm": ("shm", "ShmSend", "ShmRecv"),
    "gloo": ("gloo", "GlooSend", "GlooRecv"),
    "zmq": ("zmq_stream", "ZmqSend", "ZmqRecv"),
    "cuda_ipc": ("cuda_ipc", "CudaIpcSend", "CudaIpcRecv"),
    "nccl": ("nccl", "NcclSend", "NcclRecv"),
}


def send_link(transport: str) -> type:
    module, cls, _ = _REGISTRY[transport]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def recv_link(transport: str) -> type:
    module, _, cls = _REGISTRY[transport]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def reuse_buffer(buf: torch.Tensor | None, nbytes: int, device="cpu") -> torch.Tensor:
    """A receiver's landing buffer, kept across versions: a fresh allocation would pay a
    page fault per 4 KiB on every version (copying into new memory runs at ~1/6 of memcpy)."""
    if buf is not None and buf.numel() == nbytes and buf.device == torch.device(device):
        return buf
    return torch.empty(nbytes, dtype=torch.uint8, device=device)
