"""shm: same node, CPU. The sender's packed segment (staging.py) *is* the message.

Each local receiver maps the segment and takes each bucket as it is announced, while later ones
still pack. One copy on the sender however many receivers there are, none when the trainer keeps
its weights in the segment (the Sender's adopt_fn)."""
from __future__ import annotations

from .staging import Board, Segment


class ShmSend:
    staged = True

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.staging, self.timeout = staging, cfg.timeout_s

    @property
    def reads_after_send(self) -> bool:
        """With zero copy the receivers read the sender's own weights after send returns: they
        must not change until the receivers are done."""
        return self.staging.zero_copy

    def prepare(self, snapshot) -> dict:
        return {"path": self.staging.segment.path, "size": self.staging.segment.size}

    def send(self, snapshot) -> None:
        for _ in self.staging.buckets(self.timeout):    # packing is the send: a stalled pack surfaces here
            pass

    def close(self) -> None:
        pass    # the segment belongs to the sender's staging


class ShmRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        self.segment = Segment(address["path"], address["size"], create=False)
        self.timeout = cfg.timeout_s

    def receive(self, version, layout):
        data = self.segment.tensor(Board.nbytes(layout.num_buckets), layout.total_bytes)
        return layout.unpack(data), Board(self.segment, layout.num_buckets).landed(version, layout, data, self.timeout)

    def close(self) -> None:
        pass    # views handed out keep the mapping alive; it unmaps when they go
