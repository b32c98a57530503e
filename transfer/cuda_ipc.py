"""cuda_ipc: sender and receiver on the same physical GPU (an engine colocated with
the trainer). Nothing leaves the device.

The sender packs each version into one device buffer and shares it once as a CUDA IPC
handle (torch's own reduce_tensor, the form SGLang's update_weights_from_tensor takes);
receivers map it and verify each bucket on the device as the sender announces it on a
small host board (a shared-memory segment holding only the per-bucket words). The
receiver's load_weights copies device-to-device from the mapped buffer.

Assumes both actors see the GPU under the same index (Ray gives actors that share a GPU
the same CUDA_VISIBLE_DEVICES). Tested only where CUDA is present."""
from __future__ import annotations

import itertools
import os
import time

import torch

from .layout import byte_views, pack_bucket
from .staging import Board, Segment

_names = itertools.count()


class CudaIpcSend:
    needs_staging = False

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.mesh_id, self.shm_dir = mesh_id, cfg.shm_dir
        self.device = torch.device(party.device)
        self.buf = None

    def prepare(self, snapshot) -> dict:
        layout = snapshot.layout
        if self.buf is None or self.buf.numel() != layout.total_bytes or \
                self.board.words.shape[0] != layout.num_buckets:
            from torch.multiprocessing.reductions import reduce_tensor
            self.buf = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
            self.handle = reduce_tensor(self.buf)       # (rebuild function, its arguments)
            path = os.path.join(self.shm_dir, f"loongsage-{self.mesh_id}-ipc-{os.getpid()}-{next(_names)}")
            self.segment = Segment(path, Board.nbytes(layout.num_buckets), create=True)
            self.board = Board(self.segment, layout.num_buckets)
        self.board.clear()
        return {"handle": self.handle, "board": self.segment.path, "board_size": self.segment.size}

    def send(self, snapshot) -> None:
        layout = snapshot.layout
        views = byte_views(snapshot.state)
        with torch.cuda.device(self.device):
            for i in range(layout.num_buckets):
                start, end = layout.span(i)
                # The checksum is read back to the host, so the bucket is complete on
                # the device before it is announced.
                crc = pack_bucket(views, layout, i, self.buf[start:end])
                self.board.announce(i, snapshot.version, crc)

    def close(self) -> None:
        self.buf = None
        if getattr(self, "segment", None) is not None:
            self.segment.unlink()


class CudaIpcRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        rebuild, args = address["handle"]
        self.buf = rebuild(*args)
        self.segment = Segment(address["board"], address["board_size"], create=False)
        self.timeout = cfg.timeout_s

    def receive(self, version, layout, verify):
        board = Board(self.segment, layout.num_buckets)
        for i in range(layout.num_buckets):
            crc = board.wait(i, version, time.monotonic() + self.timeout)
            start, end = layout.span(i)
            verify(i, self.buf[start:end], crc)
        return layout.unpack(self.buf)

    def close(self) -> None:
        self.buf = None
