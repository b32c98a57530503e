"""gloo: CPU broadcast across processes and hosts with torch.distributed.

Each link is its own standalone ProcessGroupGloo (sender rank 0, its receivers 1..n) over its
own TCPStore, so the mesh never touches the default process group a trainer may use for its
own collectives. Per bucket: a 3-word header (version, index, checksum), then the bytes."""
from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from transfer.compat.torch_api import gloo_group

from .layout import landing_buffer, stream_buckets

_generation = itertools.count()


def _join(store, address: dict, rank: int, ip: str, td: timedelta) -> dist.ProcessGroupGloo:
    """Join the link's group, on the interface of `ip`; blocks until all its ranks join (or the timeout)."""
    return gloo_group(dist.PrefixStore(address["prefix"], store), rank, len(address["ranks"]) + 1, ip, td)


class GlooSend:
    staged, reads_after_send = True, False

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.td, self.ip, self.staging, self.pg = timedelta(seconds=cfg.timeout_s), party.ip, staging, None
        self.store = dist.TCPStore(party.ip, 0, None, True, self.td, wait_for_workers=False)
        # a fresh prefix per link: a rebuilt group never meets keys of a failed one
        self.address = {"host": party.ip, "port": self.store.port, "prefix": f"{mesh_id}/{next(_generation)}",
                        "ranks": {name: rank for rank, name in enumerate(receivers, start=1)}}

    def prepare(self, snapshot) -> dict:
        return self.address

    def send(self, snapshot) -> None:
        if self.pg is None:     # the receivers join in their receive
            self.pg = _join(self.store, self.address, 0, self.ip, self.td)
        for i, view, crc in self.staging.buckets(self.td.total_seconds()):
            for t in (torch.tensor([snapshot.version, i, crc], dtype=torch.int64), view):
                self.pg.broadcast(t, 0, self.td).wait(self.td)

    def close(self) -> None:
        self.pg = None


class GlooRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        self.td, self.ip, self.address = timedelta(seconds=cfg.timeout_s), party.ip, address
        self.pg = self.flat = None
        self.rank = address["ranks"][name]
        self.store = dist.TCPStore(address["host"], address["port"], None, False, self.td)

    def receive(self, version, layout):
        if self.pg is None:
            self.pg = _join(self.store, self.address, self.rank, self.ip, self.td)
        self.flat = landing_buffer(self.flat, layout.total_bytes)
        return layout.unpack(self.flat), stream_buckets(
            self.flat, version, layout, lambda t: self.pg.broadcast(t, 0, self.td).wait(self.td))

    def close(self) -> None:
        self.pg = None
