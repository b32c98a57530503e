"""zmq: TCP streaming, the fallback that reaches anything with a socket.

The sender binds one ROUTER; each receiver connects a DEALER named after itself, says "ready"
for a version, then takes the buckets in order straight into its landing buffer (recv_into).
The sender sends zero-copy views of the packed host copy and waits, bounded, until ZeroMQ
has let go of every one."""
from __future__ import annotations

import struct
import time

import zmq

from .errors import TransferError
from .layout import landing_buffer, stream_buckets

_HEADER = struct.Struct("<qqq")     # version, bucket index, checksum


class ZmqSend:
    staged, reads_after_send = True, False

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.receivers, self.timeout, self.staging = list(receivers), cfg.timeout_s, staging
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # an absent peer is an error, not a drop
        self.sock.setsockopt(zmq.SNDHWM, 0)             # frames are views: queueing costs no memory
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{party.ip}:{self.sock.bind_to_random_port(f'tcp://{party.ip}')}"

    def prepare(self, snapshot) -> dict:
        return {"endpoint": self.endpoint}

    def send(self, snapshot) -> None:
        version, waiting, deadline = snapshot.version, set(self.receivers), time.monotonic() + self.timeout
        while waiting:
            left_ms = int(1000 * (deadline - time.monotonic()))
            if left_ms <= 0 or not self.sock.poll(left_ms, zmq.POLLIN):
                raise TransferError(f"never said ready within {self.timeout}s", receiver=",".join(sorted(waiting)),
                                    transport="zmq", version=version)
            name, _, v = self.sock.recv_multipart()
            if int(v) == version:
                waiting.discard(name.decode())
        sent = []
        for i, view, crc in self.staging.buckets(self.timeout):
            frames = [_HEADER.pack(version, i, crc), memoryview(view.numpy())]
            sent += [(name, i, self.sock.send_multipart([name.encode(), *frames], copy=False, track=True))
                     for name in self.receivers]
        deadline = time.monotonic() + self.timeout
        for name, i, tracker in sent:
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                raise TransferError(f"bytes not taken within {self.timeout}s", receiver=name,
                                    transport="zmq", version=version, bucket=i) from None

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class ZmqRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        self.timeout, self.flat = cfg.timeout_s, None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address["endpoint"])

    def receive(self, version, layout):
        self.flat = landing_buffer(self.flat, layout.total_bytes)
        self.sock.send_multipart([b"ready", str(version).encode()])

        def recv_header():
            if not self.sock.poll(int(1000 * self.timeout), zmq.POLLIN):
                raise TimeoutError(f"a bucket did not arrive within {self.timeout}s")
            return _HEADER.unpack(self.sock.recv())

        def recv_into(bucket):
            if self.sock.recv_into(memoryview(bucket.numpy())) != bucket.numel() or self.sock.getsockopt(zmq.RCVMORE):
                raise RuntimeError("a bucket arrived with the wrong size")

        return layout.unpack(self.flat), stream_buckets(self.flat, version, layout, recv_into, recv_header)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
