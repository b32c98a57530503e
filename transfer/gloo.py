"""gloo: CPU broadcast across processes and hosts with torch.distributed.

Each link is its own standalone ProcessGroupGloo (sender rank 0, its receivers 1..n)
over its own TCPStore, so the mesh never touches the default process group a trainer
may use for its own collectives. Per bucket: a 3-word header (version, index, checksum)
then the bytes, broadcast from the packed host copy while the next bucket packs."""
from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import TransferError
from .links import reuse_buffer

_generation = itertools.count()


def process_group(store, prefix: str, rank: int, world: int, ip: str,
                  timeout: timedelta) -> dist.ProcessGroupGloo:
    """Join a standalone gloo group; blocks until all `world` ranks join (or timeout)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, opts)


class GlooSend:
    needs_staging = True

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.receivers, self.ip = list(receivers), party.ip
        self.td = timedelta(seconds=cfg.timeout_s)
        self.store = dist.TCPStore(party.ip, 0, None, True, self.td, wait_for_workers=False)
        # A fresh prefix per link: a rebuilt group never meets keys of a failed one.
        self.prefix = f"{mesh_id}/{next(_generation)}"
        self.ranks = {name: rank for rank, name in enumerate(self.receivers, start=1)}
        self.pg = None

    def prepare(self, snapshot) -> dict:
        return {"host": self.ip, "port": self.store.port, "prefix": self.prefix,
                "ranks": self.ranks}

    def send(self, snapshot) -> None:
        who = ",".join(self.receivers)
        if self.pg is None:
            try:
                self.pg = process_group(self.store, self.prefix, 0, len(self.ranks) + 1,
                                        self.ip, self.td)
            except Exception as e:
                raise TransferError(f"gloo group did not form: {e}", receiver=who,
                                    transport="gloo", version=snapshot.version) from e
        timeout = self.td.total_seconds()
        for i in range(snapshot.layout.num_buckets):
            try:
                view, crc = snapshot.staging.bucket(i, timeout)
                header = torch.tensor([snapshot.version, i, crc], dtype=torch.int64)
                self.pg.broadcast(header, 0, self.td).wait(self.td)
                self.pg.broadcast(view, 0, self.td).wait(self.td)
            except Exception as e:
                raise TransferError(f"broadcast failed: {e}", receiver=who, transport="gloo",
                                    version=snapshot.version, bucket=i) from e

    def close(self) -> None:
        self.pg = None


class GlooRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        self.td = timedelta(seconds=cfg.timeout_s)
        self.address, self.ip = address, party.ip
        self.rank = address["ranks"][name]
        self.store = dist.TCPStore(address["host"], address["port"], None, False, self.td)
        self.pg = None
        self.flat = None

    def receive(self, version, layout, verify):
        if self.pg is None:   # joined here, not in __init__: the sender joins during its send
            self.pg = process_group(self.store, self.address["prefix"], self.rank,
                                    len(self.address["ranks"]) + 1, self.ip, self.td)
        self.flat = reuse_buffer(self.flat, layout.total_bytes)
        header = torch.empty(3, dtype=torch.int64)
        for i in range(layout.num_buckets):
            self.pg.broadcast(header, 0, self.td).wait(self.td)
            v, j, crc = header.tolist()
            if (v, j) != (version, i):
                raise RuntimeError(f"expected bucket {i} of version {version}, got bucket {j} of {v}")
            start, end = layout.span(i)
            self.pg.broadcast(self.flat[start:end], 0, self.td).wait(self.td)
            verify(i, self.flat[start:end], crc)
        return layout.unpack(self.flat)

    def close(self) -> None:
        self.pg = None
