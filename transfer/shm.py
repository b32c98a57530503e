"""shm: same node, CPU. The sender's packed segment *is* the message.

The sender packs each version once into its shared segment (see staging.py) and
announces every bucket on the segment's board; each local receiver maps the segment and,
as each bucket is announced (while later ones are still being packed), copies it into
its model and checksums it in the same pass (or verifies it and hands the target views
into the shared pages, for targets that load a whole version at once). One copy on the
sender, one into each receiver's model, however many receivers there are; none on the
sender when the trainer keeps its weights in the segment (Sender's adopt_fn).

With the weights in the segment (zero copy) the bytes are final before the send starts:
a receiver lands each bucket at once and reports it on the board, the sender checksums
the bucket just behind the receivers (from the shared cache), and each receiver checks a
bucket's checksum one bucket later, so neither side waits for the other."""
from __future__ import annotations

import time

from .staging import READER_SLOTS, Board, Segment


class ShmSend:
    needs_staging = True

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.staging, self.timeout = staging, cfg.timeout_s
        self.readers = list(receivers)[:READER_SLOTS]     # board slot = position here

    @property
    def reads_after_send(self) -> bool:
        """Receivers copy from the segment after send returns: that is the sender's own
        weights when it keeps them there (zero copy), so they must not change until the
        receivers are done."""
        return self.staging.zero_copy

    def prepare(self, snapshot) -> dict:
        zero_copy = self.staging.zero_copy
        self.staging.trail = list(range(len(self.readers))) if zero_copy else []
        return self.staging.address | {"zero_copy": zero_copy, "readers": self.readers}

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
        self.zero_copy = address.get("zero_copy", False)
        readers = address.get("readers", [])
        self.slot = readers.index(name) if name in readers else None

    def receive(self, version, layout, verify):
        board = Board(self.segment, layout.num_buckets)
        data = self.segment.tensor(self.board_bytes, layout.total_bytes)
        deadline = time.monotonic() + self.timeout
        if not self.zero_copy:      # the sender packs: land each bucket once it is announced
            for i in range(layout.num_buckets):
                crc = board.wait(i, version, deadline)
                start, end = layout.span(i)
                verify(i, data[start:end], crc)
            return layout.unpack(data)
        landed = None       # (bucket, its checksum here), checked once the sender's is up
        for i in range(layout.num_buckets):
            start, end = layout.span(i)
            got = verify.land(i, data[start:end])
            if self.slot is not None:
                board.report(self.slot, version, i + 1)
            if landed is not None:
                verify.check(*landed, board.wait(landed[0], version, deadline))
            landed = (i, got)
        if landed is not None:
            verify.check(*landed, board.wait(landed[0], version, deadline))
        return layout.unpack(data)

    def close(self) -> None:
        pass    # views handed out keep the mapping alive; it unmaps when they go
