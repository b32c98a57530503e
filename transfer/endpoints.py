"""The two in-actor endpoints: Sender (in the trainer) and Receiver (in each engine).

An actor that holds weights creates one endpoint and exposes one generic remote method
that forwards to it:

    self.mesh_endpoint = transfer.Receiver(target=self)
    def mesh(self, method, *args, **kwargs):
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

The driver's TransferMesh calls only the methods below (the names of the two endpoints
never overlap, so one colocated actor can host both). Receiver actors must be threaded
(max_concurrency >= 2) when they also host the Sender, because a colocated send and
receive run at the same time."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Protocol

import torch

from .errors import TransferError
from .layout import Layout, as_bytes, checksum, unpack_bucket
from .links import recv_link, send_link
from .staging import HostStaging, Snapshot
from .topology import Party, describe_process, local_device


class WeightTarget(Protocol):
    """What a Receiver's target (an engine, a teacher) implements."""

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def load_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Apply one complete, verified version atomically, under the target's own lock.
        The tensors are views of transport buffers (or the sender's own tensors): copy
        them into the model; they change after this returns."""

    def weight_version(self) -> int: ...

    # Optional, and preferred when present:
    #   weights_in_place(version) -> context manager yielding {name: live tensor}
    # Held (the target's lock taken) while a version lands; the Receiver copies each
    # verified bucket straight into the live tensors as it arrives, so loading overlaps
    # the transfer instead of following it. On a clean exit the target serves `version`;
    # if the block raises, the target holds half a version and must serve nothing until a
    # complete one has landed (the mesh re-sends on the next publish).


SENDER_KEY = "_sender"     # prepare's answer: facts about the sender, beside the link addresses


class _SenderMesh:
    """What the Sender keeps per mesh: its links, its staging and the current snapshot."""

    def __init__(self, mesh_id: str):
        self.mesh_id = mesh_id
        self.lock = threading.Lock()      # one prepare/send at a time per mesh
        self.links: dict[str, object] = {}
        self.members: dict[str, list[str]] = {}
        self.staging: HostStaging | None = None
        self.snapshot: Snapshot | None = None
        self.plan: list[str] = []          # transports of the prepared version


class Sender:
    """The trainer's endpoint. `state_fn` returns the weights to publish (HF names),
    e.g. lambda: {n: t.detach() for n, t in model.state_dict().items()}; it is called
    once per version, while the trainer is not stepping.

    `adopt_fn` (optional, CPU weights): called once with views into the shared segment
    that hold a copy of the current weights, one per name; the owner points its tensors
    at them (e.g. `param.data = view`) and from then on keeps its weights in the segment,
    so a version is published with no copy on the sender at all: local receivers read
    the weights in place. The weights must then not change until publish returns (the
    controller publishes between steps); a receiver that read a changing tensor fails its
    checksum, loudly."""

    def __init__(self, state_fn: Callable[[], Mapping[str, torch.Tensor]],
                 device: str | torch.device | None = None,
                 adopt_fn: Callable[[dict[str, torch.Tensor]], None] | None = None):
        self.state_fn = state_fn
        self.adopt_fn = adopt_fn
        self.device = local_device(device)
        self._meshes: dict[str, _SenderMesh] = {}
        self._party: Party | None = None

    def describe_sender(self) -> Party:
        if self._party is None:
            self._party = describe_process("sender", self.device)
        return self._party

    def prepare(self, mesh_id: str, version: int, plan: dict[str, list[str]],
                cfg, reset: tuple[str, ...] = ()) -> tuple[Layout, dict]:
        """Snapshot the weights as `version`, size the staging, open a link per transport
        in `plan` (transport -> receiver names) and return the layout plus each link's
        address. Links named in `reset`, or whose receivers changed, are rebuilt."""
        m = self._meshes.setdefault(mesh_id, _SenderMesh(mesh_id))
        with m.lock:
            state = dict(self.state_fn())
            layout = Layout.of(state, cfg.bucket_bytes)
            party = self.describe_sender()
            for transport, names in plan.items():
                if transport in reset or m.members.get(transport) != names:
                    self._close_link(m, transport)
            needs_staging = any(send_link(t).needs_staging for t in plan)
            if needs_staging:
                m.staging = m.staging or HostStaging(mesh_id, cfg.shm_dir)
                m.staging.prepare(version, layout)
                if (self.adopt_fn is not None and layout.total_bytes >= cfg.adopt_min_bytes
                        and not m.staging.holds(state)):
                    views = m.staging.adopt(state)
                    if views is not None:
                        self.adopt_fn(views)
                        state = dict(self.state_fn())
                m.staging.zero_copy = m.staging.holds(state)
            m.snapshot = Snapshot(version, state, layout, m.staging if needs_staging else None)
            m.plan = list(plan)
            addresses = {}
            for transport, names in plan.items():
                if transport not in m.links:
                    m.links[transport] = send_link(transport)(mesh_id, names, cfg, party, m.staging)
                    m.members[transport] = list(names)
                addresses[transport] = m.links[transport].prepare(m.snapshot)
            # Whether a receiver still reads the sender's own tensors after send returns:
            # if not, the trainer may step again as soon as its send is done.
            addresses[SENDER_KEY] = {"reads_after_send": any(
                getattr(m.links[t], "reads_after_send", False) for t in plan)}
            return layout, addresses

    def send(self, mesh_id: str, version: int) -> dict[str, float]:
        """Send the prepared version over every planned link at once; the host copy packs
        on its own thread meanwhile. Returns seconds per transport (and for packing)."""
        m = self._meshes[mesh_id]
        with m.lock:
            snap = m.snapshot
            if snap is None or snap.version != version:
                raise TransferError(f"send of a version that was not prepared (prepared: "
                                    f"{snap and snap.version})", receiver="*",
                                    transport=",".join(m.plan), version=version)
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
                    errors.append(self._as_error(e, m, t, version))
            if errors:
                raise errors[0]
            seconds["total"] = time.perf_counter() - t0
            if snap.staging is not None:    # 1.0: the weights were read in place, not packed
                seconds["zero_copy"] = float(snap.staging.zero_copy)
            return seconds

    def _as_error(self, e: Exception, m: _SenderMesh, transport: str, version: int) -> TransferError:
        who = ",".join(m.members.get(transport, ["*"]))
        # A failed link is rebuilt on the next prepare: its peers may hold half a version.
        self._close_link(m, transport)
        if isinstance(e, TransferError):
            return e
        return TransferError(f"{transport} failed on the sender: {e!r}", receiver=who,
                             transport=transport, version=version)

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
    """An engine's endpoint: lands each version, verifies every bucket's checksum as it
    arrives, and only then hands the complete version to target.load_weights."""

    def __init__(self, target: WeightTarget, device: str | torch.device | None = None):
        self.target = target
        self.device = local_device(device)
        self._links: dict[tuple[str, str], tuple[dict, object]] = {}
        self._lock = threading.Lock()
        self._party: Party | None = None

    def describe_receiver(self) -> tuple[Party, dict, int]:
        """(this process, the weights it expects, the version it serves)."""
        if self._party is None:
            self._party = describe_process("receiver", self.device)
        return self._party, self.target.weight_specs(), _version(self.target)

    def receive(self, mesh_id: str, name: str, version: int, layout: Layout, transport: str,
                address: dict, cfg) -> dict[str, float]:
        """Land `version` over `transport`, verify it, load it. Returns timings."""
        specs = self.target.weight_specs()
        wrong = layout.mismatches(specs)
        if wrong:
            raise TransferError(f"model mismatch: {'; '.join(wrong[:5])}", receiver=name,
                                transport=transport, version=version)
        in_place = getattr(self.target, "weights_in_place", None)
        if in_place is not None and cfg.apply_in_place:
            return self._receive_in_place(in_place, mesh_id, name, version, layout,
                                          transport, address, cfg)
        verify = _Buckets(lambda i, data: checksum(data), self.verify_bucket, name, transport, version)
        t0 = time.perf_counter()
        named = self._land(mesh_id, name, version, layout, transport, address, cfg, verify)
        t1 = time.perf_counter()
        self.target.load_weights({n: named[n] for n in specs}, version)
        return {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1,
                "bytes": float(layout.total_bytes), "serves": _version(self.target)}

    def _receive_in_place(self, in_place, mesh_id, name, version, layout, transport,
                          address, cfg) -> dict[str, float]:
        """Copy each bucket into the target's live tensors as it is verified."""
        t0 = time.perf_counter()
        with in_place(version) as live:
            t1 = time.perf_counter()
            views = {n: as_bytes(t) for n, t in live.items()}
            if any(v.data_ptr() != t.data_ptr() for v, t in zip(views.values(), live.values())):
                raise TransferError("weights_in_place must yield contiguous tensors",
                                    receiver=name, transport=transport, version=version)

            land = _Buckets(lambda i, data: unpack_bucket(data, layout, i, views),
                            self.verify_bucket, name, transport, version)
            named = self._land(mesh_id, name, version, layout, transport, address, cfg, land)
            if land.last < 0:       # inproc: the sender's own tensors, no buckets
                for n, t in live.items():
                    t.copy_(named[n])
        # receive_s: waiting for the target's lock; load_s: the lock held while landing
        return {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1,
                "bytes": float(layout.total_bytes), "serves": _version(self.target)}

    def _land(self, mesh_id, name, version, layout, transport, address, cfg,
              verify: "_Buckets") -> dict[str, torch.Tensor]:
        try:
            link = self._link(mesh_id, name, transport, address, cfg)
            return link.receive(version, layout, verify)
        except Exception as e:
            self._drop_link(mesh_id, transport)
            if isinstance(e, TransferError):
                raise
            raise TransferError(repr(e), receiver=name, transport=transport, version=version,
                                bucket=verify.last + 1 if layout.num_buckets else None) from e

    @staticmethod
    def verify_bucket(name: str, transport: str, version: int, i: int, got: int,
                      expected: int) -> None:
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
                link = recv_link(transport)(mesh_id, name, address, cfg,
                                            self.describe_receiver()[0])
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


class _Buckets:
    """How a receive link hands over each bucket: `verify(i, data, expected)` lands bucket
    i (`land`: copy it into the model and/or checksum it; returns the checksum) and checks
    it; a link that lands before the sender's checksum is known calls `land` now and
    `check` later. `last`: the last bucket checked (errors name the one after it)."""

    def __init__(self, land, verify_bucket, name: str, transport: str, version: int):
        self.land, self.verify_bucket = land, verify_bucket
        self.name, self.transport, self.version = name, transport, version
        self.last = -1

    def check(self, i: int, got: int, expected: int) -> None:
        self.verify_bucket(self.name, self.transport, self.version, i, got, expected)
        self.last = i

    def __call__(self, i: int, data: torch.Tensor, expected: int) -> None:
        self.check(i, self.land(i, data), expected)


def _version(target) -> int:
    v = target.weight_version
    return int(v() if callable(v) else v)
