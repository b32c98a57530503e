"""shm: same node, CPU. The sender's packed segment *is* the message.

The sender packs each version once into its shared segment (see staging.py) and
announces every bucket on the segment's board; each local receiver maps the segment,
verifies each bucket as it is announced (while later ones are still being packed) and
hands the target views into the shared pages. One copy on the sender, one copy into the
receiver's model, however many receivers there are."""
from __future__ import annotations

import time

from .staging import Board, Segment


class ShmSend:
    needs_staging = True

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.staging, self.timeout = staging, cfg.timeout_s

    def prepare(self, snapshot) -> dict:
        return self.staging.address

    def send(self, snapshot) -> None:
        # Packing is the send; wait for it so a stalled pack surfaces here, per bucket.
        for i in range(snapshot.layout.num_buckets):
            self.staging.bucket(i, self.timeout)

    def close(self) -> None:
        pass    # the segment belongs to the sender's staging


class ShmRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        self.segment = Segment(address["path"], address["size"], create=False)
        self.board_bytes = address["board_bytes"]
        self.timeout = cfg.timeout_s

    def receive(self, version, layout, verify):
        board = Board(self.segment, layout.num_buckets)
        data = self.segment.tensor(self.board_bytes, layout.total_bytes)
        for i in range(layout.num_buckets):
            crc = board.wait(i, version, time.monotonic() + self.timeout)
            start, end = layout.span(i)
            verify(i, data[start:end], crc)
        return layout.unpack(data)

    def close(self) -> None:
        pass    # views handed out keep the mapping alive; it unmaps when they go
