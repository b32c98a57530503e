"""The two in-actor endpoints, Sender (in the trainer) and Receiver (in each engine), and the
one interface every transport implements.

An actor that holds weights creates one endpoint and forwards one remote method to it,
`mesh(method, *args, **kwargs)`; the driver's TransferMesh calls only the public methods below
(their names never overlap: one threaded colocated actor can host both endpoints).

A transport is one module, transfer/<name>.py (zmq: zmq_stream.py), with one class per side of the
wire, found by name (cuda_ipc: CudaIpcSend, CudaIpcRecv):

  Send(mesh_id, receivers, cfg, party, staging)      in the sender
      prepare(snapshot) -> dict    ready for snapshot.version; what receivers connect with
      send(snapshot)               every bucket of the version to every receiver
  Recv(mesh_id, name, address, cfg, party)           in one receiver
      receive(version, layout) -> (named, buckets)
                                   named: the version's tensors (views of the landing buffer, filled
                                   as `buckets` is iterated); buckets: (index, bytes, the sender's
                                   checksum) of each bucket as it lands
  and both close().

The endpoints own what transports share: packing (staging.py), each bucket's checksum as it
lands, copying it into the model, timings, and errors naming receiver, transport, version and
bucket. Every wait in a transport is bounded by cfg.timeout_s."""
from __future__ import annotations

import contextlib
import importlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .errors import TransferError
from .layout import Layout, byte_views, checksum, unpack_bucket
from .staging import HostStaging, Snapshot
from .topology import Party, describe_process, local_device


def link_class(transport: str, side: str) -> type:
    """The transport's class for `side` ("Send", "Recv"), imported on first use: a CPU process never touches CUDA."""
    module = importlib.import_module(f"{__package__}.{'zmq_stream' if transport == 'zmq' else transport}")
    return getattr(module, "".join(w.capitalize() for w in transport.split("_")) + side)


SENDER_KEY = "_sender"     # prepare's answer: facts about the sender, beside the link addresses


@dataclass
class _SenderMesh:
    """What the Sender keeps per mesh: its links (and their receivers), its staging, the current snapshot."""
    lock: threading.Lock = field(default_factory=threading.Lock)     # one prepare/send at a time per mesh
    links: dict = field(default_factory=dict)
    members: dict = field(default_factory=dict)
    staging: HostStaging | None = None
    snapshot: Snapshot | None = None
    plan: list = field(default_factory=list)       # transports of the prepared version


class Sender:
    """The trainer's endpoint. `state_fn` returns the weights to publish (HF names), called once per
    version while the trainer is not stepping. `adopt_fn` (optional, CPU weights) is called once with
    views into the shared segment holding a copy of them: the owner keeps its weights there from then
    on (`param.data = view`), so publishing copies nothing and local receivers read them in place. They
    must not change until publish returns (a receiver that read a changing one fails its checksum)."""

    def __init__(self, state_fn: Callable[[], Mapping[str, torch.Tensor]],
                 device: str | torch.device | None = None,
                 adopt_fn: Callable[[dict[str, torch.Tensor]], None] | None = None):
        self.state_fn, self.adopt_fn = state_fn, adopt_fn
        self.device = local_device(device)
        self._meshes: dict[str, _SenderMesh] = {}
        self._party: Party | None = None

    def describe_sender(self) -> Party:
        self._party = self._party or describe_process("sender", self.device)
        return self._party

    def prepare(self, mesh_id: str, version: int, plan: dict[str, list[str]], cfg,
                reset: tuple[str, ...] = ()) -> tuple[Layout, dict]:
        """Snapshot the weights as `version`, open a link per transport in `plan` (transport ->
        receiver names) and return the layout and each link's address. Links named in `reset`, or
        whose receivers changed, are rebuilt."""
        m = self._meshes.setdefault(mesh_id, _SenderMesh())
        with m.lock:
            state = dict(self.state_fn())
            layout = Layout.of(state, cfg.bucket_bytes)
            for transport, names in plan.items():
                if transport in reset or m.members.get(transport) != names:
                    self._close_link(m, transport)
            staged = any(link_class(t, "Send").staged for t in plan)
            if staged:
                m.staging = m.staging or HostStaging(mesh_id, cfg.shm_dir)
                m.staging.prepare(version, layout)
                if self.adopt_fn is not None and layout.total_bytes >= cfg.adopt_min_bytes \
                        and not m.staging.holds(state) and (views := m.staging.adopt(state)) is not None:
                    self.adopt_fn(views)
                    state = dict(self.state_fn())
                m.staging.zero_copy = m.staging.holds(state)
            m.snapshot = Snapshot(version, state, layout, m.staging if staged else None)
            m.plan, addresses = list(plan), {}
            for transport, names in plan.items():
                if transport not in m.links:
                    m.links[transport] = link_class(transport, "Send")(mesh_id, names, cfg, self.describe_sender(),
                                                                  m.staging)
                    m.members[transport] = list(names)
                addresses[transport] = m.links[transport].prepare(m.snapshot)
            # whether a receiver reads the sender's own tensors after send returns (if not, the trainer may step on)
            addresses[SENDER_KEY] = {"reads_after_send": any(m.links[t].reads_after_send for t in plan)}
            return layout, addresses

    def send(self, mesh_id: str, version: int) -> dict[str, float]:
        """Send the prepared version over every planned link at once, the host copy packing on its
        own thread meanwhile. Returns seconds per transport (and for packing)."""
        m = self._meshes[mesh_id]
        with m.lock:
            snap = m.snapshot
            if snap is None or snap.version != version:
                raise TransferError(f"send of a version that was not prepared (prepared: {snap and snap.version})",
                                    receiver="*", transport=",".join(m.plan), version=version)
            jobs, t0 = {}, time.perf_counter()
            with ThreadPoolExecutor(len(m.plan) + 1, thread_name_prefix="send") as pool:
                if snap.staging is not None:
                    jobs["pack"] = pool.submit(_timed, snap.staging.pack, snap.state)
                for t in m.plan:
                    jobs[t] = pool.submit(_timed, m.links[t].send, snap)
            seconds, errors = {}, []
            for t, job in jobs.items():
                try:
                    seconds[t] = job.result()
                except Exception as e:
                    who = ",".join(m.members.get(t, ["*"]))
                    self._close_link(m, t)       # rebuilt on the next prepare: its peers may hold half a version
                    errors.append(e if isinstance(e, TransferError) else TransferError(
                        f"{t} failed on the sender: {e!r}", receiver=who, transport=t, version=version))
            if errors:
                raise errors[0]
            seconds["total"] = time.perf_counter() - t0
            if snap.staging is not None:    # 1.0: the weights were read in place, not packed
                seconds["zero_copy"] = float(snap.staging.zero_copy)
            return seconds

    def _close_link(self, m: _SenderMesh, transport: str) -> None:
        link = m.links.pop(transport, None)
        m.members.pop(transport, None)
        if link is not None:
            link.close()

    def close_sender(self, mesh_id: str) -> None:
        m = self._meshes.pop(mesh_id, None)
        if m is not None:
            for t in list(m.links):
                self._close_link(m, t)
            if m.staging is not None:
                m.staging.close()


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


class Receiver:
    """An engine's endpoint: lands each version, verifies every bucket's checksum as it arrives,
    and only then hands the complete version to the target (or, in place, lets it serve it).

    The target (an engine) has weight_specs() -> {name: (shape, dtype)}, weight_version(), and
    load_weights(named_tensors, version): one complete, verified version applied atomically under its
    own lock, the tensors (views of transport buffers, or the sender's own) copied. Optional, used with
    transfer.apply_in_place: weights_in_place(version), a context manager yielding {name: live tensor},
    held (its lock taken) while each verified bucket is copied straight into them; on a clean exit the
    target serves `version`, and if the block raises it serves nothing until a complete one has landed
    (the mesh re-sends on the next publish)."""

    def __init__(self, target, device: str | torch.device | None = None):
        self.target = target
        self.device = local_device(device)
        self._links: dict[tuple[str, str], tuple[dict, object]] = {}
        self._lock = threading.Lock()
        self._party: Party | None = None

    def describe_receiver(self) -> tuple[Party, dict, int]:
        """(this process, the weights it expects, the version it serves)."""
        self._party = self._party or describe_process("receiver", self.device)
        return self._party, self.target.weight_specs(), self.target.weight_version()

    def receive(self, mesh_id: str, name: str, version: int, layout: Layout, transport: str,
                address: dict, cfg) -> dict[str, float]:
        """Land `version` over `transport`, verify it, load it. Returns timings: with the target's
        weights_in_place, receive_s is the wait for its lock and load_s the landing under it. The mesh
        has checked the layout against the target's weight_specs before any receive starts."""
        in_place = getattr(self.target, "weights_in_place", None) if cfg.apply_in_place else None
        t0 = time.perf_counter()
        with in_place(version) if in_place else contextlib.nullcontext() as live:
            t1 = time.perf_counter()
            named = self._land(mesh_id, name, version, layout, transport, address, cfg, live)
        if live is None:
            t1 = time.perf_counter()
            self.target.load_weights({n: named[n] for n in self.target.weight_specs()}, version)
        return {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1,
                "bytes": float(layout.total_bytes), "serves": self.target.weight_version()}

    def _land(self, mesh_id, name, version, layout, transport, address, cfg, live) -> dict[str, torch.Tensor]:
        """Every bucket, checksummed (and copied into `live`, the target's own tensors, when given)."""
        done = -1       # the last bucket verified: an error names the one after it
        try:
            views = None if live is None else byte_views(live)
            if views is not None and any(v.data_ptr() != live[n].data_ptr() for n, v in views.items()):
                raise TransferError("weights_in_place must yield contiguous tensors",
                                    receiver=name, transport=transport, version=version)
            named, buckets = self._link(mesh_id, name, transport, address, cfg).receive(version, layout)
            for i, data, expected in buckets:
                got = checksum(data) if views is None else unpack_bucket(data, layout, i, views)
                self.verify_bucket(name, transport, version, i, got, expected)
                done = i
            if views is not None and done < 0:     # inproc: the sender's own tensors, no buckets
                for n, t in live.items():
                    t.copy_(named[n])
            return named
        except Exception as e:
            self._drop_link(mesh_id, transport)
            if isinstance(e, TransferError):
                raise
            raise TransferError(repr(e), receiver=name, transport=transport, version=version,
                                bucket=done + 1 if layout.num_buckets else None) from e

    @staticmethod
    def verify_bucket(name: str, transport: str, version: int, i: int, got: int, expected: int) -> None:
        """Check one landed bucket's checksum against the sender's."""
        if got != expected:
            raise TransferError(f"checksum mismatch: expected {expected:#010x}, got {got:#010x}",
                                receiver=name, transport=transport, version=version, bucket=i)

    def _link(self, mesh_id, name, transport, address, cfg):
        key = (mesh_id, transport)
        with self._lock:
            seen, link = self._links.get(key, (None, None))
            if seen != address:     # first use, or the sender rebuilt its side
                if link is not None:
                    link.close()
                link = link_class(transport, "Recv")(mesh_id, name, address, cfg, self.describe_receiver()[0])
                self._links[key] = (address, link)
            return link

    def _drop_link(self, mesh_id: str, transport: str) -> None:
        with self._lock:
            _, link = self._links.pop((mesh_id, transport), (None, None))
        if link is not None:
            link.close()

    def close_receiver(self, mesh_id: str) -> None:
        for key in [k for k in self._links if k[0] == mesh_id]:
            self._drop_link(*key)
