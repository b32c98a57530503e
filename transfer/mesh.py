"""TransferMesh: the driver's view of weight synchronisation.

    mesh = TransferMesh(sender=trainer, receivers={"engine0": e0, "engine1": e1}, cfg=cfg)
    mesh.discover(); print(mesh.topology_table())
    mesh.plan()                     # {"engine0": Route("shm", "same node ..."), ...}
    metrics = mesh.publish(step)    # after every optimizer step

The driver holds no weights. It learns the topology once, plans one route per receiver, and for
each version has the sender prepare (snapshot + layout), then send while every receiver receives,
each wait bounded by cfg.timeout_s. A receiver that missed a version (failed, restarted) catches up."""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from .endpoints import SENDER_KEY
from .errors import TransferError
from .routes import Route, plan_route
from .topology import Party, format_table


@dataclass
class Publishing:
    """A publish in progress (TransferMesh.publish_begin). sender_free: the sender's tensors may
    change as soon as its send call has run (no receiver reads them after it)."""
    version: int
    t0: float
    due: list[str]
    layout: object = None
    send_ref: object = None
    recv_refs: dict = dataclasses.field(default_factory=dict)
    sender_free: bool = True


class TransferMesh:
    def __init__(self, sender, receivers: Mapping[str, object], cfg):   # cfg: stages/transfer_config.TransferConfig
        self.sender, self.receivers, self.cfg = sender, dict(receivers), cfg
        self.mesh_id = uuid.uuid4().hex[:12]
        self.sender_party: Party | None = None
        self.parties: dict[str, Party] = {}
        self.specs: dict[str, dict] = {}
        self.versions: dict[str, int] = {}      # the last version each receiver was sent
        self.served: dict[str, int] = {}        # what each said it serves after loading it
        self.routes: dict[str, Route] = {}
        self.dead: set[str] = set()             # excluded until add_receiver brings it back
        self._reset: set[str] = set()           # transports whose links must be rebuilt

    # ---- topology and planning -------------------------------------------------------

    def discover(self) -> list[Party]:
        """One topology round over the sender and every receiver."""
        self._describe(list(self.receivers), sender=True)
        return [self.sender_party, *self.parties.values()]

    def _describe(self, names: list[str], sender: bool) -> None:
        refs = {n: self.receivers[n].mesh.remote("describe_receiver") for n in names}
        if sender:
            refs["*sender*"] = self.sender.mesh.remote("describe_sender")
        answers = self._gather(refs, self.cfg.discover_timeout_s)
        for who, answer in answers.items():
            if isinstance(answer, Exception):
                raise TransferError(f"did not answer topology discovery: {answer}", receiver=who, transport="-",
                                    version=None)
        if sender:
            self.sender_party = dataclasses.replace(answers.pop("*sender*"), name="sender")
        for n, (party, specs, version) in answers.items():
            self.parties[n], self.specs[n] = dataclasses.replace(party, name=n), specs
            self.versions[n] = self.served[n] = version
            self.dead.discard(n)

    def plan(self) -> dict[str, Route]:
        """The route per receiver, with the reason it was chosen (discovering any party not yet described)."""
        missing = [n for n in self.receivers if n not in self.parties]
        if missing or self.sender_party is None:
            self._describe(missing, sender=self.sender_party is None)
        self.routes = {n: plan_route(self.sender_party, self.parties[n], self.cfg.transport) for n in self.receivers}
        return dict(self.routes)

    def topology_table(self) -> str:
        if self.sender_party is None:
            self.plan()
        return format_table([self.sender_party, *self.parties.values()], self.routes)

    def add_receiver(self, name: str, handle) -> Route:
        """Add a receiver, or replace one whose actor restarted; it catches up on the next publish."""
        self.receivers[name] = handle
        self._describe([name], sender=self.sender_party is None)
        if name in self.routes:
            self._reset.add(self.routes[name].transport)
        self.routes[name] = plan_route(self.sender_party, self.parties[name], self.cfg.transport)
        return self.routes[name]

    # ---- publishing ------------------------------------------------------------------

    def publish(self, version: int) -> dict[str, float | str]:
        """Send `version` to every live receiver that serves an older one. Returns the step's
        metrics; raises TransferError (with .failures and .metrics) if any receiver failed, after
        the others have applied the version."""
        return self.publish_end(self.publish_begin(version))

    def publish_begin(self, version: int) -> Publishing:
        """The first half of publish: the sender prepares `version`, then its send and every
        receive are started; publish_end collects the outcome."""
        routes = self.routes if self.routes.keys() == self.receivers.keys() else self.plan()
        due = sorted(n for n in routes if n not in self.dead and self.versions[n] < version)
        t0 = time.perf_counter()
        if not due:
            return Publishing(version, t0, due)
        plan: dict[str, list[str]] = defaultdict(list)
        for n in due:
            plan[routes[n].transport].append(n)
        ref = self.sender.mesh.remote("prepare", self.mesh_id, version, dict(plan), self.cfg, tuple(self._reset))
        answer = self._gather({"sender": ref}, self.cfg.timeout_s)["sender"]
        if isinstance(answer, Exception):
            raise TransferError(f"the sender could not prepare: {_cause(answer)}", receiver=",".join(due),
                                transport=",".join(plan), version=version)
        self._reset.clear()
        layout, addresses = answer
        for n in due:
            if lines := layout.mismatches(self.specs[n]):    # a wrong model is a setup error: send nothing
                raise TransferError(f"model mismatch: {'; '.join(lines[:5])}", receiver=n,
                                    transport=routes[n].transport, version=version)
        sender = addresses.pop(SENDER_KEY)
        send_ref = self.sender.mesh.remote("send", self.mesh_id, version)
        recv_refs = {n: self.receivers[n].mesh.remote("receive", self.mesh_id, n, version, layout, routes[n].transport,
                                                      addresses[routes[n].transport], self.cfg) for n in due}
        return Publishing(version, t0, due, layout, send_ref, recv_refs, not sender["reads_after_send"])

    def publish_end(self, p: Publishing) -> dict[str, float | str]:
        """Wait for a publish_begin to finish; see publish."""
        version, due = p.version, p.due
        if not due:
            return {"transfer/version": version, "transfer/receivers": 0.0}
        # Every wait inside the parties is bounded by timeout_s; this backstop only catches a
        # party wedged outside them (e.g. a deadlocked load_weights).
        answers = self._gather({"*sender*": p.send_ref, **p.recv_refs}, self.cfg.timeout_s * (p.layout.num_buckets + 2))
        sent = answers.pop("*sender*")
        failures = {n: self._failure(n, answers[n], sent, version) for n in due if isinstance(answers[n], Exception)}
        if isinstance(sent, Exception) and not failures:   # the sender failed on its own
            failures["sender"] = self._failure("sender", sent, sent, version)
        ok = {n: a for n, a in answers.items() if n not in failures}
        for n, a in ok.items():
            self.versions[n], self.served[n] = version, int(a["serves"])
        metrics = _metrics(version, p.layout, time.perf_counter() - p.t0, ok, self.routes,
                           sent if isinstance(sent, dict) else {})
        if failures:
            first = failures[min(failures)]
            reason = first.reason if len(failures) == 1 else \
                f"{len(failures)} receivers failed: " + " | ".join(str(e) for e in failures.values())
            raise TransferError(reason, receiver=first.receiver, transport=first.transport, version=version,
                                bucket=first.bucket, failures=failures, metrics=metrics)
        return metrics

    def _failure(self, name: str, error: Exception, sent, version: int) -> TransferError:
        transport = self.routes[name].transport if name in self.routes else "-"
        self._reset.add(transport)
        error = _cause(error)
        if isinstance(error, TransferError):
            return error
        bucket = _cause(sent).bucket if isinstance(_cause(sent), TransferError) else None
        if isinstance(error, (RayActorError, ActorDiedError, ActorUnavailableError)):
            self.dead.add(name)
            reason = "receiver process died" + (f" (sender: {_cause(sent)})" if isinstance(sent, Exception) else "")
        elif isinstance(error, TimeoutError):
            # Wedged outside every bounded wait: it may still be mid-receive, so it gets nothing more
            # until add_receiver brings it back (e.g. after a restart).
            self.dead.add(name)
            reason = f"{error}; excluded until add_receiver"
        else:
            reason = repr(error)
        return TransferError(reason, receiver=name, transport=transport, version=version, bucket=bucket)

    @staticmethod
    def _gather(refs: dict[str, object], timeout: float) -> dict[str, object]:
        """ray.get every ref, waiting at most `timeout` in all; failures come back as exceptions,
        never raised, so one bad party cannot hide the others."""
        _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        out = {}
        for who, ref in refs.items():
            try:
                out[who] = TimeoutError(f"no answer within {timeout:.0f}s") if ref in pending else ray.get(ref)
            except Exception as e:      # noqa: BLE001 - sorted out by the caller
                out[who] = e
        return out

    def close(self) -> None:
        """Release links and the shared segment on every live party (best effort)."""
        refs = [self.sender.mesh.remote("close_sender", self.mesh_id)]
        refs += [h.mesh.remote("close_receiver", self.mesh_id) for n, h in self.receivers.items() if n not in self.dead]
        ray.wait(refs, num_returns=len(refs), timeout=self.cfg.timeout_s)


def _cause(error):
    """The exception raised inside the actor, not Ray's wrapper around it."""
    return error.cause if isinstance(error, RayTaskError) and error.cause is not None else error


def _metrics(version, layout, seconds, ok: dict[str, dict], routes, sent: dict) -> dict:
    state_bytes = layout.total_bytes       # what one receiver is sent (tensors + alignment padding)
    m: dict[str, float | str] = {
        "transfer/version": version, "transfer/receivers": float(len(ok)),
        "transfer/state_bytes": float(state_bytes),
        "transfer/payload_bytes": float(layout.payload_bytes),    # the tensors' bytes alone
        "transfer/bytes": float(state_bytes * len(ok)), "transfer/seconds": seconds,
        "transfer/gb_per_s": state_bytes / seconds / 1e9}
    if "pack" in sent:
        m["transfer/pack_s"], m["transfer/zero_copy"] = sent["pack"], sent.get("zero_copy", 0.0)
    per_receiver = {n: a["receive_s"] + a["load_s"] for n, a in ok.items()}
    for n, s in per_receiver.items():
        key = f"transfer/{routes[n].transport}/seconds"
        m[key] = max(m.get(key, 0.0), s)
    if ok:      # how long the slowest engine spent applying (its lock held), and the slowest receiver
        m["transfer/load_s"] = max(a["load_s"] for a in ok.values())
        slowest = max(per_receiver, key=per_receiver.get)
        m["transfer/slowest_receiver"], m["transfer/slowest_receiver_s"] = slowest, per_receiver[slowest]
    return m
