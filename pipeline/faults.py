"""What can go wrong while a run trains, and what the run does about it: one object, `Faults`.

An engine whose process died is restarted by Ray: a weight publish leaves it out, and a watch thread
re-sends it the current weights before it serves again. A lost Ray node (declared dead after ~15 s,
65 s for a host cut off: docs/scale-out.md; until then calls to its actors hang) is seen by a second
thread reading the node table once a second: its engines get `run.node_wait_s` to come back elsewhere,
else, or when the trainer was there, the run stops (`on_lost`). Signals: `interrupts`.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from transfer import TransferError


class Faults:
    def __init__(self, actors, version: Callable[[], int], on_lost: Callable[[], None], wait_s: float,
                 log: Callable[[str], None]):
        self.mesh, self.engines, self.trainer = actors.mesh, actors.engines, actors.trainer
        self.version, self.on_lost, self.wait_s, self.log = version, on_lost, wait_s, log
        self.lock = threading.RLock()   # one weight publish at a time; the step loop holds it from update to checkpoint
        self.restarts = 0
        self.lost: dict[str, tuple[float, set[str]]] = {}    # node id -> (deadline, actors not back yet)
        self.reason = ""                                       # set once the run must stop
        self._known = {i: info.get("incarnation") for i, info in enumerate(actors.infos[:-1])}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, name=f.__name__, daemon=True)
                         for f in (self._watch_engines, self._watch_nodes)]

    def __enter__(self) -> "Faults":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t, wait in zip(self._threads, (60, 10)):
            t.join(timeout=wait)

    def publish(self, version: int, sender_free: Callable[[], None] = lambda: None) -> dict:
        """The trainer's weights to every engine, tagged `version`; `sender_free()` runs once the trainer
        may go on. An engine whose process died is left out (the watch re-sends it the weights once Ray
        restarted it); any other transfer failure stops the run."""
        with self.lock:
            publishing = self.mesh.publish_begin(version)
            if publishing.sender_free:
                sender_free()
            try:
                m = self.mesh.publish_end(publishing)
            except TransferError as e:
                if not e.failures or any(n not in self.mesh.dead or n == "sender" for n in e.failures):
                    raise
                self.log(f"weight sync v{version}: {', '.join(e.failures)} died; resent when restarted")
                m = e.metrics
            served = {n: self.mesh.served.get(n) for n in self.mesh.receivers if n not in self.mesh.dead}
            if any(v != version for v in served.values()):
                raise RuntimeError(f"weight sync: engines serve versions {served}, expected {version}")
        return {k: v for k, v in m.items() if isinstance(v, (int, float))} | {"engine_restarts": self.restarts}

    def _watch_engines(self) -> None:
        """A restart is a new engine process: its incarnation id changed (not a cleared serving flag,
        which an ordinary in-place landing clears too), or it awaits weights (restarted during start-up,
        before start() asked its incarnation)."""
        while not self._stop.wait(0.5):
            for i, e in enumerate(self.engines):
                try:
                    info = ray.get(e.info.remote(), timeout=30)
                except (RayActorError, ActorUnavailableError, GetTimeoutError):
                    continue                    # restarting (or gone for good): ask again next round
                if info.get("incarnation") == self._known.get(i) and not info.get("needs_sync"):
                    continue
                with self.lock:
                    version = self.version()
                    self.mesh.add_receiver(f"engine{i}", e)
                    if info["version"] < version:
                        self.mesh.publish(version)
                    else:       # restarted before the first update: the weights it loaded are the current ones
                        ray.get(e.load_weights.remote({}, version), timeout=60)
                self._known[i] = info.get("incarnation")
                self.restarts += 1
                self.log(f"engine{i} restarted: re-sent weights version {version}")
                for node, (_, names) in self.lost.items():      # it no longer counts as lost
                    if f"engine{i}" in names:
                        names.discard(f"engine{i}")
                        if not names:
                            self.log(f"every actor of lost node {node[:12]} is back: the run continues")

    def _watch_nodes(self) -> None:
        """Its own thread: the engine watch can sit 30 s in a call to an engine whose node died."""
        while not self._stop.wait(1.0):
            placed = {n: p.node_id for n, p in self.mesh.parties.items()}
            if self.mesh.sender_party is not None:
                placed["trainer"] = self.mesh.sender_party.node_id
            try:
                nodes = {n["NodeID"]: (bool(n["Alive"]), n.get("NodeManagerAddress", "?")) for n in ray.nodes()}
            except Exception as e:      # noqa: BLE001 - the GCS itself unreachable: the run's own calls will say so
                self.log(f"node watch: cannot read Ray's node table ({e}); not watching nodes any more")
                return
            if self.poll(nodes, placed):
                for name in self.waiting_for():     # given up: rollouts waiting on them fail instead of hanging
                    if name.startswith("engine"):
                        ray.kill(self.engines[int(name.removeprefix("engine"))], no_restart=True)
                self.on_lost()
                return

    def poll(self, nodes: dict[str, tuple[bool, str]], placed: dict[str, str]) -> str:
        """`nodes`: node id -> (alive, IP); `placed`: actor name (engine0, trainer) -> node id. Returns
        a reason to stop, or ""."""
        for node, (alive, ip) in nodes.items():
            names = {n for n, at in placed.items() if at == node}
            if alive or node in self.lost or not names:
                continue
            self.lost[node] = (time.monotonic() + self.wait_s, set(names))
            ran = ", ".join(sorted(names))
            if "trainer" in names:
                self.log(f"node {node[:12]} ({ip}) is lost; it ran {ran}: the trainer's state went with it")
                self.reason = f"node {node[:12]} ({ip}) with the trainer was lost"
                return self.reason
            self.log(f"node {node[:12]} ({ip}) is lost; it ran {ran}: waiting up to {self.wait_s:g} s "
                     f"(run.node_wait_s) for Ray to restart them elsewhere")
        for node, (deadline, names) in list(self.lost.items()):
            if names and time.monotonic() > deadline:
                self.log(f"{', '.join(sorted(names))} not back {self.wait_s:g} s after node {node[:12]} was lost: "
                         f"stopping the run with a checkpoint")
                self.reason = f"node {node[:12]} ({nodes.get(node, (0, '?'))[1]}) was lost"
                return self.reason
        return ""

    def waiting_for(self) -> set[str]:
        return set().union(*(names for _, names in self.lost.values()))

    def trainer_lost(self, wait_s: float = 90.0) -> bool:
        """A call to the trainer failed: True once the node watch has found the trainer's node lost; False
        when the trainer answers, when it died on a node that lives, or after `wait_s` (past Ray's 65 s)."""
        deadline = time.monotonic() + wait_s
        while "trainer" not in self.reason and time.monotonic() < deadline:
            try:
                ray.get(self.trainer.info.remote(), timeout=5)
                return False                    # it answers: what failed was not its host
            except (ActorUnavailableError, GetTimeoutError):
                pass                            # its host not declared yet: ask again
            except RayActorError:               # dead: the node table says within a poll whether its host is
                deadline = min(deadline, time.monotonic() + 3.0)
            time.sleep(0.5)
        return "trainer" in self.reason


@contextlib.contextmanager
def interrupts(stop: threading.Event, announce: Callable[[int], None]):
    """SIGINT / SIGTERM end the run after the step in hand (the caller checkpoints); a second one
    exits at once. Yields the signals received. Outside the main thread signals stay as they are.

    The second is counted off the signal wakeup fd by a thread of its own: the main thread sits in C
    calls (ray.get, Ray's shutdown), where two signals make one call of a Python handler. The count
    goes on after the block (checkpoint, shutdown) unless the caller had a SIGINT handler of its own."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum, _frame):
        got.append(signum)
        stop.set()
        announce(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    r, w = os.pipe()
    os.set_blocking(w, False)
    wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    threading.Thread(target=_exit_on_second, args=(r,), name="second-signal", daemon=True).start()
    try:
        yield got
    finally:
        if not (got and previous[signal.SIGINT] is signal.default_int_handler):
            signal.set_wakeup_fd(wakeup)
            os.close(w)             # the thread reads the end and stops
            for s, h in previous.items():
                signal.signal(s, h)


def _exit_on_second(fd: int) -> None:
    seen = 0
    while data := os.read(fd, 64):
        for signum in data:
            seen += signum in (signal.SIGINT, signal.SIGTERM)
            if seen == 2:
                os._exit(128 + signum)      # the user insists: Ray's raylet reaps this driver's actors
    os.close(fd)
