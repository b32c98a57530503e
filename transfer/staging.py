"""The sender's host copy of a version, packed once and shared.

Every CPU transport reads the same packed bytes: the sender packs a version once, bucket
by bucket, into a shared-memory segment (a file in /dev/shm, mapped). Local receivers
map the same pages (that is the shm transport); gloo and zmq stream each bucket from it
as soon as it is packed. So the next bucket packs while the previous one travels, and
no transport makes a per-receiver copy on the sender."""
from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Mapping

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
                # Allocate the pages now: faulting them in one by one on the first pack
                # costs ~6x more (1 GB: 3.7 s vs 0.6 s measured on tmpfs).
                if hasattr(os, "posix_fallocate") and size:
                    os.posix_fallocate(fd, 0, size)
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
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_orphans(shm_dir: str) -> None:
    """Remove segments left by senders that were killed (a SIGKILL runs no cleanup).
    Segment names carry the creator's pid: loongsage-<mesh>-<pid>-<n>."""
    for name in os.listdir(shm_dir):
        parts = name.split("-")
        if parts[0] != "loongsage" or len(parts) < 4 or not parts[-2].isdigit():
            continue
        try:
            os.kill(int(parts[-2]), 0)
        except ProcessLookupError:
            _unlink_quietly(os.path.join(shm_dir, name))
        except PermissionError:
            pass    # alive, someone else's


READER_SLOTS = 32          # local readers that can report their progress on one board
TRAIL_WAIT_S = 0.25        # how long the sender waits for the readers at one bucket before it stops trailing them


class Board:
    """Per-bucket (version, checksum) words at the head of a segment, then one progress
    word per local reader.

    The sender writes the checksum, then the version; a reader that sees the version
    also sees the checksum and the bucket's bytes (x86 keeps stores in order, and a torn
    read could not pass the checksum anyway: it would fail loudly, never silently).
    A reader's progress word is version << 24 | buckets it has read of that version."""

    def __init__(self, segment: Segment, num_buckets: int):
        words = np.frombuffer(segment.mm, dtype=np.int64, count=2 * num_buckets + READER_SLOTS)
        self.words = words[:2 * num_buckets].reshape(num_buckets, 2)
        self.read = words[2 * num_buckets:]

    @staticmethod
    def nbytes(num_buckets: int) -> int:
        return -(-(16 * num_buckets + 8 * READER_SLOTS) // BLOCK_BYTES) * BLOCK_BYTES

    def report(self, slot: int, version: int, count: int) -> None:
        """Reader `slot` has read the first `count` buckets of `version`."""
        self.read[slot] = version << 24 | count

    def readers_at(self, slots: list[int], version: int, count: int, deadline: float) -> bool:
        """Wait until every reader in `slots` has read `count` buckets of `version`;
        False if the deadline came first."""
        target, pause = version << 24 | count, 1e-5
        while (self.read[slots] < target).any():
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 2e-4)
        return True

    def clear(self) -> None:
        self.words[:, 0] = -1

    def announce(self, i: int, version: int, crc: int) -> None:
        self.words[i, 1] = crc
        self.words[i, 0] = version

    def wait(self, i: int, version: int, deadline: float) -> int:
        """Block until bucket i of `version` is announced; return its checksum."""
        pause = 1e-5
        while self.words[i, 0] != version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"bucket {i} of version {version} never announced")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)    # sub-ms latency early, cheap polling later
        return int(self.words[i, 1])


_names = itertools.count()


class HostStaging:
    """One packed version in a shared segment, announced bucket by bucket."""

    def __init__(self, mesh_id: str, shm_dir: str):
        self.mesh_id, self.shm_dir = mesh_id, shm_dir
        self.segment: Segment | None = None
        self.layout: Layout | None = None
        self.version = -1
        self._cond = threading.Condition()
        self._ready = -1          # highest bucket packed and announced
        self._error: BaseException | None = None
        self.zero_copy = False    # the owner's tensors live in the segment: nothing to pack
        self.trail: list[int] = []    # zero copy: board slots of the local readers to checksum behind

    def prepare(self, version: int, layout: Layout) -> None:
        """Make room for `version` and invalidate every bucket of the previous one."""
        if self.layout is None or (layout.total_bytes, layout.num_buckets) != (
                self.layout.total_bytes, self.layout.num_buckets):
            self._map(layout)
        self.layout, self.version = layout, version
        self.board.clear()
        self.trail = []           # the shm link names its readers again if it takes part
        self.checksums = [0] * layout.num_buckets
        with self._cond:
            self._ready, self._error = -1, None

    def _map(self, layout: Layout) -> None:
        if self.segment is not None:
            self.segment.unlink()
        remove_orphans(self.shm_dir)
        board = Board.nbytes(layout.num_buckets)
        path = os.path.join(self.shm_dir, f"loongsage-{self.mesh_id}-{os.getpid()}-{next(_names)}")
        self.segment = Segment(path, board + layout.total_bytes, create=True)
        self.board = Board(self.segment, layout.num_buckets)
        self.data = self.segment.tensor(board, layout.total_bytes)

    def holds(self, state: Mapping[str, torch.Tensor]) -> bool:
        """True when every tensor of `state` already sits in the segment where the layout
        puts it (the owner adopted the segment): a version then needs no packing."""
        base = self.data.data_ptr()
        return all(t.device.type == "cpu" and t.is_contiguous()
                   and t.data_ptr() == base + s.offset
                   for s in self.layout.slots for t in [state[s.name]] if s.nbytes)

    def adopt(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Copy `state` into the segment and return views of it, one per name, for the
        owner to keep its weights in from now on; None when they cannot live there."""
        if not all(t.device.type == "cpu" for t in state.values()):
            return None
        views = byte_views(state)
        for i in range(self.layout.num_buckets):
            pack_bucket(views, self.layout, i, self.view(i))
        return self.layout.unpack(self.data)

    @property
    def address(self) -> dict:
        """What a local receiver needs to map the segment."""
        return {"path": self.segment.path, "size": self.segment.size,
                "board_bytes": Board.nbytes(self.layout.num_buckets)}

    def view(self, i: int) -> torch.Tensor:
        start, end = self.layout.span(i)
        return self.data[start:end]

    def pack(self, state: Mapping[str, torch.Tensor]) -> None:
        """Pack and announce every bucket in order; runs on its own thread during a send,
        so transports move bucket i while bucket i+1 packs."""
        try:
            views = byte_views(state)
            trail = self.trail if self.zero_copy else []
            for i in range(self.layout.num_buckets):
                if self.zero_copy:
                    # Local readers copy the bytes in place without waiting for us; summing
                    # each bucket just behind them reads it from the shared cache instead of
                    # memory (one pass of the state less on the memory bus). A reader that
                    # stalls (waiting for its model's lock, or dead) is not waited for again.
                    if trail and not self.board.readers_at(trail, self.version, i + 1,
                                                           time.monotonic() + TRAIL_WAIT_S):
                        trail = []
                    crc = checksum(self.view(i))
                else:
                    crc = pack_bucket(views, self.layout, i, self.view(i))
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

    def bucket(self, i: int, timeout: float) -> tuple[torch.Tensor, int]:
        """Wait (in-process) until bucket i is packed; return its bytes and checksum."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready >= i or self._error, timeout):
                raise TimeoutError(f"bucket {i} not packed within {timeout}s")
            if self._ready < i:
                raise RuntimeError(f"packing failed: {self._error!r}")
        return self.view(i), self.checksums[i]

    def close(self) -> None:
        if self.segment is not None:
            self.segment.unlink()


@dataclass
class Snapshot:
    """What a send works from: the sender's tensors for one version, their layout, and
    (for CPU transports) the host staging they are being packed into."""
    version: int
    state: dict[str, torch.Tensor]
    layout: Layout
    staging: HostStaging | None
