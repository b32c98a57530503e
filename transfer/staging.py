"""The sender's host copy of a version, packed once and shared by every CPU transport.

The sender packs a version bucket by bucket into a shared-memory segment (a mapped file in shm_dir)
and announces each bucket on the segment's board. Local receivers map the same pages (the shm
transport); gloo and zmq send each bucket as soon as it is packed, while the next one packs."""
from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
import torch

from .config import BLOCK_BYTES
from .layout import Layout, byte_views, checksum, pack_bucket


class Segment:
    """A file in a tmpfs, mapped shared: all processes that map it see the same pages."""

    def __init__(self, path: str, size: int, create: bool):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = path, size
        # The creator removes the file when it is collected; mappings keep the pages alive.
        self._unlink = weakref.finalize(self, _unlink_quietly, path) if create else None

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)

    def unlink(self) -> None:
        if self._unlink is not None:
            self._unlink()


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


_names = itertools.count()


def new_segment(shm_dir: str, mesh_id: str, size: int) -> Segment:
    """A fresh segment named loongsage-<mesh>-<pid>-<n>, after removing those of senders that were
    killed (a SIGKILL runs no cleanup): the pid in a name tells whether its creator still runs."""
    for name in os.listdir(shm_dir):
        parts = name.split("-")
        if parts[0] == "loongsage" and len(parts) >= 4 and parts[-2].isdigit():
            try:
                os.kill(int(parts[-2]), 0)
            except ProcessLookupError:
                _unlink_quietly(os.path.join(shm_dir, name))
            except PermissionError:
                pass    # alive, someone else's
    path = os.path.join(shm_dir, f"loongsage-{mesh_id}-{os.getpid()}-{next(_names)}")
    return Segment(path, size, create=True)


class Board:
    """Per-bucket (version, checksum) words at the head of a segment. The sender writes the checksum,
    then the version: a reader that sees the version sees the checksum and the bytes (x86 keeps stores
    in order; a torn read would fail its checksum, loudly)."""

    def __init__(self, segment: Segment, num_buckets: int):
        self.words = np.frombuffer(segment.mm, dtype=np.int64, count=2 * num_buckets).reshape(num_buckets, 2)

    @staticmethod
    def nbytes(num_buckets: int) -> int:
        return -(-(16 * num_buckets + 1) // BLOCK_BYTES) * BLOCK_BYTES    # never empty: a 0-byte file cannot be mapped

    def clear(self) -> None:
        self.words[:, 0] = -1

    def announce(self, i: int, version: int, crc: int) -> None:
        self.words[i, 1] = crc
        self.words[i, 0] = version

    def landed(self, version: int, layout: Layout, data: torch.Tensor, timeout: float):
        """(index, bytes in `data`, checksum) of each bucket of `version` as the sender announces it."""
        for i in range(layout.num_buckets):
            deadline, pause = time.monotonic() + timeout, 1e-5
            while self.words[i, 0] != version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bucket {i} of version {version} never announced")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)    # sub-ms latency early, cheap polling later
            start, end = layout.span(i)
            yield i, data[start:end], int(self.words[i, 1])


class HostStaging:
    """One packed version in a shared segment, announced bucket by bucket."""

    def __init__(self, mesh_id: str, shm_dir: str):
        self.mesh_id, self.shm_dir = mesh_id, shm_dir
        self.segment: Segment | None = None
        self.layout: Layout | None = None       # and the version, its board and checksums: set by prepare
        self._cond = threading.Condition()
        self.zero_copy = False    # the owner's tensors live in the segment: nothing to pack

    def prepare(self, version: int, layout: Layout) -> None:
        """Make room for `version` and invalidate every bucket of the previous one."""
        if self.layout is None or (layout.total_bytes, layout.num_buckets) != (
                self.layout.total_bytes, self.layout.num_buckets):
            self.close()
            board = Board.nbytes(layout.num_buckets)
            self.segment = new_segment(self.shm_dir, self.mesh_id, board + layout.total_bytes)
            self.board = Board(self.segment, layout.num_buckets)
            self.data = self.segment.tensor(board, layout.total_bytes)
        self.layout, self.version = layout, version
        self.board.clear()
        self.checksums = [0] * layout.num_buckets
        with self._cond:
            self._ready, self._error = -1, None     # the highest bucket packed and announced; a failed pack

    def holds(self, state: Mapping[str, torch.Tensor]) -> bool:
        """True when every tensor of `state` already sits in the segment where the layout puts
        it (the owner adopted the segment): a version then needs no packing."""
        base = self.data.data_ptr()
        return all(t.device.type == "cpu" and t.is_contiguous() and t.data_ptr() == base + s.offset
                   for s in self.layout.slots for t in [state[s.name]] if s.nbytes)

    def adopt(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Copy `state` into the segment and return views of it, one per name, for the owner to
        keep its weights in from now on; None when they cannot live there."""
        if not all(t.device.type == "cpu" for t in state.values()):
            return None
        views = byte_views(state)
        for i in range(self.layout.num_buckets):
            pack_bucket(views, self.layout, i, self.view(i))
        return self.layout.unpack(self.data)

    def view(self, i: int) -> torch.Tensor:
        start, end = self.layout.span(i)
        return self.data[start:end]

    def pack(self, state: Mapping[str, torch.Tensor]) -> None:
        """Pack (or with zero copy, checksum) and announce every bucket in order; runs on its own
        thread during a send, so transports move bucket i while bucket i+1 packs."""
        try:
            views = byte_views(state)
            for i in range(self.layout.num_buckets):
                crc = checksum(self.view(i)) if self.zero_copy else pack_bucket(views, self.layout, i, self.view(i))
                self.checksums[i] = crc
                self.board.announce(i, self.version, crc)
                with self._cond:
                    self._ready = i
                    self._cond.notify_all()
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise

    def buckets(self, timeout: float) -> Iterator[tuple[int, torch.Tensor, int]]:
        """(index, bytes, checksum) of each bucket as soon as it is packed (in-process waits)."""
        for i in range(self.layout.num_buckets):
            with self._cond:
                if not self._cond.wait_for(lambda: self._ready >= i or self._error, timeout):  # noqa: B023
                    raise TimeoutError(f"bucket {i} not packed within {timeout}s")
                if self._ready < i:
                    raise RuntimeError(f"packing failed: {self._error!r}")
            yield i, self.view(i), self.checksums[i]

    def close(self) -> None:
        if self.segment is not None:
            self.segment.unlink()


@dataclass
class Snapshot:
    """What a send works from: the sender's tensors for one version, their layout, and (for CPU
    transports) the host staging they are being packed into."""
    version: int
    state: dict[str, torch.Tensor]
    layout: Layout
    staging: HostStaging | None
