"""nccl: GPU to GPU across devices or hosts, a broadcast on a standalone NCCL group.

Like gloo.py, each link owns its own torch ProcessGroupNCCL over its own TCPStore
(never the trainer's default group). The sender packs bucket i into one of two device
staging buffers while bucket i-1 is on the wire; each receiver lands the version in a
device buffer, verifies every bucket on the device, and loads only the complete version.
Tested only where two GPUs are present."""
from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import TransferError
from .layout import byte_views, pack_bucket
from .links import reuse_buffer

_generation = itertools.count()


def nccl_group(store, prefix: str, rank: int, world: int, device: torch.device,
               timeout: timedelta):
    """Join a standalone NCCL group on `device`; all `world` ranks must call this."""
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, world, opts)


class NcclSend:
    needs_staging = False

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.receivers, self.ip = list(receivers), party.ip
        self.device = torch.device(party.device)
        self.td = timedelta(seconds=cfg.timeout_s)
        self.store = dist.TCPStore(party.ip, 0, None, True, self.td, wait_for_workers=False)
        self.prefix = f"{mesh_id}/nccl/{next(_generation)}"
        self.ranks = {name: rank for rank, name in enumerate(self.receivers, start=1)}
        self.pg = None

    def prepare(self, snapshot) -> dict:
        return {"host": self.ip, "port": self.store.port, "prefix": self.prefix,
                "ranks": self.ranks}

    def send(self, snapshot) -> None:
        layout, who = snapshot.layout, ",".join(self.receivers)
        if self.pg is None:
            self.pg = nccl_group(self.store, self.prefix, 0, len(self.ranks) + 1,
                                 self.device, self.td)
        staging = [torch.empty(layout.bucket_bytes, dtype=torch.uint8, device=self.device)
                   for _ in range(2)]
        in_flight, views = [None, None], byte_views(snapshot.state)
        for i in range(layout.num_buckets):
            try:
                start, end = layout.span(i)
                buf = staging[i % 2][:end - start]
                if in_flight[i % 2] is not None:     # the broadcast still reading this buffer
                    in_flight[i % 2].wait(self.td)
                crc = pack_bucket(views, layout, i, buf)
                header = torch.tensor([snapshot.version, i, crc], dtype=torch.int64,
                                      device=self.device)
                self.pg.broadcast(header, 0, self.td).wait(self.td)
                in_flight[i % 2] = self.pg.broadcast(buf, 0, self.td)
            except Exception as e:
                raise TransferError(f"broadcast failed: {e}", receiver=who, transport="nccl",
                                    version=snapshot.version, bucket=i) from e
        for work in in_flight:
            if work is not None:
                work.wait(self.td)
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.pg = None


class NcclRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        self.td = timedelta(seconds=cfg.timeout_s)
        self.address, self.device = address, torch.device(party.device)
        self.rank = address["ranks"][name]
        self.store = dist.TCPStore(address["host"], address["port"], None, False, self.td)
        self.pg = None
        self.flat = None

    def receive(self, version, layout, verify):
        if self.pg is None:
            self.pg = nccl_group(self.store, self.address["prefix"], self.rank,
                                 len(self.address["ranks"]) + 1, self.device, self.td)
        self.flat = reuse_buffer(self.flat, layout.total_bytes, self.device)
        header = torch.empty(3, dtype=torch.int64, device=self.device)
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
