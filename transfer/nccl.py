"""nccl: GPU to GPU across devices or hosts, a broadcast on a communicator of the weight update's own.

The communicator is CuPy's NCCL binding, sender rank 0 and its receivers 1..n: not a
torch.distributed group, so neither the trainer's groups nor an engine's own (vLLM, SGLang) are
disturbed. The handshake is NCCL's unique id, made by the sender link in `prepare()` and carried to
the receivers in the link's address by the driver. Per bucket: a 3-word header (version, index,
checksum), then the bytes. A join or broadcast past cfg.timeout_s aborts the communicator (a
rebuilt link makes a new unique id).

CuPy is imported on first use (`pip install 'loongsage[cupy]'`); a process without CUDA or CuPy
does not offer this transport (topology.py)."""
from __future__ import annotations

import importlib.util
import threading
import time

import torch

from .layout import byte_views, landing_buffer, pack_bucket, stream_buckets

UNIQUE_ID_BYTES = 128       # NCCL_UNIQUE_ID_BYTES
POLL_S = 2e-4               # how often a wait looks at its broadcast


def available() -> bool:
    """Whether this process could run the transport (CUDA and CuPy), without importing CuPy."""
    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def cupy_nccl():
    """CuPy's NCCL module, imported here on first use; RuntimeError saying what is missing."""
    if not torch.cuda.is_available():
        raise RuntimeError("the nccl transport needs a CUDA device; this process sees none "
                           "(torch.cuda.is_available() is False)")
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError(f"the nccl transport needs CuPy with NCCL: pip install 'loongsage[cupy]' "
                           f"(import failed: {e})") from e
    return nccl


def handshake(address: dict, name: str) -> tuple[int, tuple[int, ...], int]:
    """(world size, unique id, rank) of receiver `name` from the sender's address; ValueError if the
    address is not one a sender link made for it."""
    uid, ranks = address.get("unique_id"), address.get("ranks", {})
    # bytes as CuPy gives them: C chars, signed on x86-64, unsigned on ARM
    if not isinstance(uid, (tuple, list)) or len(uid) != UNIQUE_ID_BYTES or \
            not all(isinstance(b, int) and -128 <= b < 256 for b in uid):
        raise ValueError(f"the sender's NCCL unique id is not {UNIQUE_ID_BYTES} bytes")
    if name not in ranks:
        raise ValueError(f"the sender's communicator has no rank for {name!r} (ranks: {sorted(ranks)})")
    world = len(ranks) + 1
    if address.get("world") != world or sorted(ranks.values()) != list(range(1, world)):
        raise ValueError(f"the sender's ranks {ranks} do not make a world of {address.get('world')}")
    return world, tuple(uid), ranks[name]


def join(nccl, world: int, uid: tuple, rank: int, device: torch.device, timeout_s: float):
    """This party's communicator; blocks until all `world` ranks have joined, at most timeout_s
    (NCCL's own init has no timeout: it runs on a thread of its own, left behind on a timeout)."""
    box: dict = {}

    def run():
        try:
            torch.cuda.set_device(device)
            box["comm"] = nccl.NcclCommunicator(world, uid, rank)
        except Exception as e:  # noqa: BLE001 - raised below, in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=f"nccl-join-{rank}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"the NCCL communicator of {world} ranks did not form within {timeout_s:.0f}s "
                           f"(rank {rank} joined; a peer did not)")
    if "error" in box:
        raise box["error"]
    return box["comm"]


class _Wire:
    """One party's side of the communicator: broadcasts from rank 0 on a stream of its own, each
    waited for with a deadline (an NCCL error or a lost peer aborts the communicator)."""

    def __init__(self, nccl, world: int, uid: tuple, rank: int, device: torch.device, timeout_s: float):
        self.comm = join(nccl, world, uid, rank, device, timeout_s)
        self.device, self.timeout_s = device, timeout_s
        self.stream = torch.cuda.Stream(device)
        self.types = {torch.uint8: nccl.NCCL_UINT8, torch.int64: nccl.NCCL_INT64}

    def broadcast(self, t: torch.Tensor) -> torch.cuda.Event:
        """Enqueue a broadcast of `t` (in place) after the work already queued on this device."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.comm.bcast(t.data_ptr(), t.numel(), self.types[t.dtype], 0, self.stream.cuda_stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        t.record_stream(self.stream)
        return done

    def wait(self, done: torch.cuda.Event) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            self.comm.check_async_error()
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"a broadcast did not finish within {self.timeout_s:.0f}s")
            time.sleep(POLL_S)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.abort()       # never waits for peers (destroy would, for one that is gone)
            self.comm = None


class _Link:
    wire: _Wire | None = None

    def close(self) -> None:
        if self.wire is not None:
            self.wire.close()
            self.wire = None


class NcclSend(_Link):
    staged, reads_after_send = False, False

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.nccl, self.timeout_s, self.device = cupy_nccl(), cfg.timeout_s, torch.device(party.device)
        self.ranks = {name: rank for rank, name in enumerate(receivers, start=1)}
        self.unique_id = tuple(self.nccl.get_unique_id())    # a new link, a new communicator

    def prepare(self, snapshot) -> dict:
        return {"unique_id": self.unique_id, "world": len(self.ranks) + 1, "ranks": self.ranks}

    def send(self, snapshot) -> None:
        layout = snapshot.layout
        if self.wire is None:   # the receivers join in their receive
            self.wire = _Wire(self.nccl, len(self.ranks) + 1, self.unique_id, 0, self.device, self.timeout_s)
        staging = [torch.empty(layout.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        header = torch.empty(3, dtype=torch.int64, device=self.device)
        in_flight, views = [None, None], byte_views(snapshot.state)
        for i in range(layout.num_buckets):     # bucket i is broadcast from one buffer while i + 1 packs into the other
            start, end = layout.span(i)
            if in_flight[i % 2] is not None:     # the broadcast still reading this buffer
                self.wire.wait(in_flight[i % 2])
            buf = staging[i % 2][:end - start]
            crc = pack_bucket(views, layout, i, buf)    # read back to the host: the bucket is packed
            header.copy_(torch.tensor([snapshot.version, i, crc], dtype=torch.int64))
            self.wire.wait(self.wire.broadcast(header))
            in_flight[i % 2] = self.wire.broadcast(buf)
        for done in in_flight:
            if done is not None:
                self.wire.wait(done)


class NcclRecv(_Link):
    def __init__(self, mesh_id, name, address, cfg, party):
        self.world, self.unique_id, self.rank = handshake(address, name)
        self.nccl = cupy_nccl()
        self.timeout_s, self.device = cfg.timeout_s, torch.device(party.device)
        self.flat = None

    def receive(self, version, layout):
        if self.wire is None:
            self.wire = _Wire(self.nccl, self.world, self.unique_id, self.rank, self.device, self.timeout_s)
        self.flat = landing_buffer(self.flat, layout.total_bytes, self.device)
        return layout.unpack(self.flat), stream_buckets(self.flat, version, layout,
                                                        lambda t: self.wire.wait(self.wire.broadcast(t)))
