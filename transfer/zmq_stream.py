"""zmq: TCP streaming, the fallback that reaches anything with a socket.

The sender binds one ROUTER; each receiver connects a DEALER named after itself, says
"ready" for a version, then takes the buckets in order straight into its landing buffer
(recv_into, frame by frame). The sender sends zero-copy views of the packed
host copy and waits, bounded, until ZeroMQ has let go of every one."""
from __future__ import annotations

import struct
import time

import zmq

from .errors import TransferError
from .links import reuse_buffer

_HEADER = struct.Struct("<qqq")     # version, bucket index, checksum
# A bucket travels as frames of at most this size: libzmq allocates each incoming frame,
# and allocations over glibc's mmap threshold (32 MiB at most) are fresh pages every
# time, which on receipt cost more than the copy (64 MiB frames ran 3x slower).
FRAME_BYTES = 4 << 20


def _frames(nbytes: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + FRAME_BYTES, nbytes)) for lo in range(0, nbytes, FRAME_BYTES)]


class ZmqSend:
    needs_staging = True

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.receivers, self.timeout = list(receivers), cfg.timeout_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # an absent peer is an error, not a drop
        self.sock.setsockopt(zmq.SNDHWM, 0)             # frames are views: queueing costs no memory
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{party.ip}")
        self.endpoint = f"tcp://{party.ip}:{port}"

    def prepare(self, snapshot) -> dict:
        return {"endpoint": self.endpoint}

    def send(self, snapshot) -> None:
        version = snapshot.version
        self._await_ready(version)
        trackers, name = {}, ",".join(self.receivers)
        for i in range(snapshot.layout.num_buckets):
            try:
                view, crc = snapshot.staging.bucket(i, self.timeout)
                data = memoryview(view.numpy())
                frames = [_HEADER.pack(version, i, crc)] + [data[a:b] for a, b in _frames(len(data))]
                for name in self.receivers:
                    trackers[name, i] = self.sock.send_multipart(
                        [name.encode(), *frames], copy=False, track=True)
            except Exception as e:
                raise TransferError(f"send failed: {e}", receiver=name, transport="zmq",
                                    version=version, bucket=i) from e
        deadline = time.monotonic() + self.timeout
        for (name, i), tracker in trackers.items():
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                raise TransferError(f"bytes not taken within {self.timeout}s", receiver=name,
                                    transport="zmq", version=version, bucket=i) from None

    def _await_ready(self, version: int) -> None:
        waiting, deadline = set(self.receivers), time.monotonic() + self.timeout
        while waiting:
            left_ms = int(1000 * (deadline - time.monotonic()))
            if left_ms <= 0 or not self.sock.poll(left_ms, zmq.POLLIN):
                raise TransferError(f"never said ready within {self.timeout}s",
                                    receiver=",".join(sorted(waiting)), transport="zmq",
                                    version=version)
            name, _, v = self.sock.recv_multipart()
            if int(v) == version:
                waiting.discard(name.decode())

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class ZmqRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        self.timeout = cfg.timeout_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address["endpoint"])
        self.flat = None

    def receive(self, version, layout, verify):
        self.flat = reuse_buffer(self.flat, layout.total_bytes)
        self.sock.send_multipart([b"ready", str(version).encode()])
        for i in range(layout.num_buckets):
            if not self.sock.poll(int(1000 * self.timeout), zmq.POLLIN):
                raise TimeoutError(f"bucket {i} did not arrive within {self.timeout}s")
            v, j, crc = _HEADER.unpack(self.sock.recv())
            if (v, j) != (version, i):
                raise RuntimeError(f"expected bucket {i} of version {version}, got bucket {j} of {v}")
            start, end = layout.span(i)
            bucket = self.flat[start:end]
            data = memoryview(bucket.numpy())
            for a, b in _frames(end - start):
                if self.sock.recv_into(data[a:b]) != b - a or not (
                        self.sock.getsockopt(zmq.RCVMORE) or b == end - start):
                    raise RuntimeError(f"bucket {i} arrived with frames of the wrong size")
            verify(i, bucket, crc)
        return layout.unpack(self.flat)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
