"""cuda_ipc: sender and receiver on the same physical GPU (an engine colocated with the trainer).
Nothing leaves the device.

The sender packs each version into one device buffer, shared once as a CUDA IPC handle (torch's
own reduce_tensor, the form SGLang's update_weights_from_tensor takes); receivers map it and
verify each bucket on the device as the sender announces it on a small host board (a shared-
memory segment holding only the per-bucket words). Assumes both actors see the GPU under the
same index (Ray gives actors that share a GPU the same CUDA_VISIBLE_DEVICES). Tested only where
CUDA is present."""
from __future__ import annotations

import torch

from .layout import byte_views, pack_bucket
from .staging import Board, Segment, new_segment


class CudaIpcSend:
    staged, reads_after_send = False, False

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.mesh_id, self.shm_dir = mesh_id, cfg.shm_dir
        self.device = torch.device(party.device)
        self.buf = self.segment = None

    def prepare(self, snapshot) -> dict:
        layout = snapshot.layout
        if self.buf is None or self.buf.numel() != layout.total_bytes or \
                self.board.words.shape[0] != layout.num_buckets:
            from torch.multiprocessing.reductions import reduce_tensor
            self.close()
            self.buf = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
            self.handle = reduce_tensor(self.buf)       # (rebuild function, its arguments)
            self.segment = new_segment(self.shm_dir, self.mesh_id, Board.nbytes(layout.num_buckets))
            self.board = Board(self.segment, layout.num_buckets)
        self.board.clear()
        return {"handle": self.handle, "board": self.segment.path, "board_size": self.segment.size}

    def send(self, snapshot) -> None:
        layout, views = snapshot.layout, byte_views(snapshot.state)
        with torch.cuda.device(self.device):
            for i in range(layout.num_buckets):
                start, end = layout.span(i)
                # the checksum is read back to the host, so the bucket is complete before it is announced
                self.board.announce(i, snapshot.version, pack_bucket(views, layout, i, self.buf[start:end]))

    def close(self) -> None:
        self.buf = None
        if self.segment is not None:
            self.segment.unlink()


class CudaIpcRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        rebuild, args = address["handle"]
        self.buf = rebuild(*args)
        self.segment = Segment(address["board"], address["board_size"], create=False)
        self.timeout = cfg.timeout_s

    def receive(self, version, layout):
        board = Board(self.segment, layout.num_buckets)
        return layout.unpack(self.buf), board.landed(version, layout, self.buf, self.timeout)

    def close(self) -> None:
        self.buf = None
