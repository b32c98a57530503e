"""The byte layout of one version (tensors flattened into fixed-size buckets) and the bucket checksum.

A version is one flat byte range, every tensor at a 64-byte-aligned offset, cut into buckets of
`bucket_bytes` (a tensor may straddle buckets): buckets travel and get checksummed. The Layout
(names, shapes, dtypes, offsets) is the small metadata sent once per version."""
from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from .config import BLOCK_BYTES

ALIGN = 64


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    slots: tuple[Slot, ...]
    total_bytes: int
    bucket_bytes: int
    aliases: tuple[tuple[str, str], ...] = ()   # (name, the slot it shares storage with): tied weights travel once

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor], bucket_bytes: int) -> Layout:
        slots, aliases, offset, seen = [], [], 0, {}
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            key = (t.device, t.data_ptr(), nbytes, t.dtype, tuple(t.shape), t.is_contiguous())
            if nbytes and key in seen:      # the same tensor under a second name
                aliases.append((name, seen[key]))
                continue
            seen[key] = name
            slots.append(Slot(name, tuple(t.shape), t.dtype, offset, nbytes))
            offset = -(-(offset + nbytes) // ALIGN) * ALIGN
        if not slots:
            raise ValueError("the sender's state is empty: nothing to transfer")
        return cls(tuple(slots), offset, bucket_bytes, tuple(aliases))

    def names_of(self, slot: Slot) -> tuple[str, ...]:
        """Every name a slot's bytes are published under (tied weights have several)."""
        return (slot.name, *(n for n, of in self.aliases if of == slot.name))

    @property
    def payload_bytes(self) -> int:
        """The tensors' own bytes (total_bytes adds the alignment padding between them)."""
        return sum(s.nbytes for s in self.slots)

    @property
    def num_buckets(self) -> int:
        return -(-self.total_bytes // self.bucket_bytes)

    def span(self, i: int) -> tuple[int, int]:
        """Byte range [start, end) of bucket i in the flat version."""
        start = i * self.bucket_bytes
        return start, min(start + self.bucket_bytes, self.total_bytes)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (s.shape, s.dtype) for s in self.slots for n in self.names_of(s)}

    def mismatches(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
        """What a receiver expects that this version does not carry, one line each."""
        have, out = self.specs(), []
        for name, (shape, dtype) in specs.items():
            if name not in have:
                out.append(f"{name}: not sent")
            elif (tuple(shape), dtype) != have[name]:
                out.append(f"{name}: expects {tuple(shape)} {dtype}, sent {have[name][0]} {have[name][1]}")
        return out

    def pieces(self, i: int) -> Iterator[tuple[Slot, int, int, int]]:
        """The parts of tensors inside bucket i: (slot, lo, hi, at): bytes [lo, hi) of the tensor are
        bytes [at, at + hi - lo) of the bucket."""
        start, end = self.span(i)
        k = bisect.bisect_right(self.slots, start, key=lambda s: s.offset + s.nbytes)
        while k < len(self.slots) and self.slots[k].offset < end:
            s = self.slots[k]
            lo, hi = max(start, s.offset) - s.offset, min(end, s.offset + s.nbytes) - s.offset
            if hi > lo:
                yield s, lo, hi, s.offset + lo - start
            k += 1

    def unpack(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views into a flat uint8 buffer holding a whole version (no copies)."""
        return {n: flat[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
                for s in self.slots for n in self.names_of(s)}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's storage as flat uint8 (a view when it is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def byte_views(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: as_bytes(t) for name, t in state.items()}


def pack_bucket(views: Mapping[str, torch.Tensor], layout: Layout, i: int, out: torch.Tensor) -> int:
    """Copy bucket i of a version (`views`: byte_views of its tensors) into `out` (uint8,
    bucket-sized, any device) and return the bucket's checksum."""
    for slot, lo, hi, at in layout.pieces(i):
        out[at:at + hi - lo].copy_(views[slot.name][lo:hi])
    return checksum(out)


def unpack_bucket(bucket: torch.Tensor, layout: Layout, i: int, views: Mapping[str, torch.Tensor]) -> int:
    """The reverse of pack_bucket: copy the landed bytes of bucket i into the tensors (`views`:
    byte_views of the receiver's own; names it lacks are skipped, tied weights it holds apart each
    get theirs) and return the bucket's checksum."""
    for slot, lo, hi, at in layout.pieces(i):
        targets = {views[n].data_ptr(): views[n] for n in layout.names_of(slot) if n in views}
        for view in targets.values():
            view[lo:hi].copy_(bucket[at:at + hi - lo])
    return checksum(bucket)


def checksum(buf: torch.Tensor) -> int:
    """Checksum of a uint8 buffer, on CPU or GPU: each 4 KiB block summed as int64 words (wrapping,
    so the sums do not depend on order or device), then crc32 of the block sums and the tail. A
    flipped bit changes its block's sum; blocks out of order or of another version change the crc.
    A crc32 of the bytes themselves would run at a fraction of memory bandwidth."""
    whole = buf.numel() - buf.numel() % BLOCK_BYTES
    sums = buf[:whole].view(torch.int64).view(-1, BLOCK_BYTES // 8).sum(dim=1)
    return zlib.crc32(buf[whole:].cpu().numpy().tobytes(), zlib.crc32(sums.cpu().numpy().tobytes()))


def landing_buffer(buf: torch.Tensor | None, nbytes: int, device="cpu") -> torch.Tensor:
    """A receiver's landing buffer, kept across versions of the same size."""
    if buf is not None and buf.numel() == nbytes and buf.device == torch.device(device):
        return buf
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def stream_buckets(flat: torch.Tensor, version: int, layout: Layout, recv_into: Callable[[torch.Tensor], None],
                   recv_header: Callable[[], tuple] | None = None):
    """The receiving loop of the streaming transports (gloo, zmq, nccl): per bucket a header
    (version, index, checksum), checked against the bucket awaited, then its bytes into `flat`.
    recv_header None: the header is 3 int64 words that recv_into lands (a broadcast's)."""
    if recv_header is None:
        header = torch.empty(3, dtype=torch.int64, device=flat.device)

        def recv_header():
            recv_into(header)
            return header.tolist()
    for i in range(layout.num_buckets):
        v, j, crc = (int(x) for x in recv_header())
        if (v, j) != (version, i):
            raise RuntimeError(f"expected bucket {i} of version {version}, got bucket {j} of {v}")
        start, end = layout.span(i)
        recv_into(flat[start:end])
        yield i, flat[start:end], crc
