"""A lost Ray node: a message on the terminal, then a decision.

Ray marks a node dead (its raylet stopped answering) within seconds, but the run itself only
sees calls to the actors that lived there hang while Ray retries. This watch reads the node
table once a second (one GCS call: cheap), and when a node that held engines or the trainer
dies it says which node and what ran there, then waits `run.node_wait_s` for the engines to
be restarted elsewhere (the engine watch re-sends them the weights). If they are not back in
time, or the trainer was there (its optimizer state went with it), it asks the run to stop.

The table says a node died when Ray's head declares it: after 5 failed health checks 3 s apart, each
failing at once when the host's processes are gone (~15 s) or after 10 s when nothing answers (a host
cut off: 5 x (3 + 10) = 65 s). These are the head's settings (docs/scale-out.md).
"""
from __future__ import annotations

import time
from typing import Callable


def alive_nodes() -> dict[str, tuple[bool, str]]:
    """node id -> (alive, IP), from Ray's node table."""
    import ray

    return {n["NodeID"]: (bool(n["Alive"]), n.get("NodeManagerAddress", "?")) for n in ray.nodes()}


class NodeWatch:
    def __init__(self, wait_s: float, log: Callable[[str], None], nodes: Callable[[], dict] = alive_nodes):
        self.wait_s, self.log, self._nodes = wait_s, log, nodes
        self.lost: dict[str, tuple[float, set[str]]] = {}     # node id -> (deadline, names not back yet)
        self.reason = ""                                        # set once the run must stop

    def poll(self, placed: dict[str, str]) -> str:
        """`placed`: actor name (engine0, trainer) -> node id. Returns a reason to stop, or ""."""
        table = self._nodes()
        for node, (alive, ip) in table.items():
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
                self.reason = f"node {node[:12]} ({table.get(node, (0, '?'))[1]}) was lost"
                return self.reason
        return ""

    def back(self, name: str) -> None:
        """An engine restarted (and was re-sent the weights): it no longer counts as lost."""
        for node, (_, names) in self.lost.items():
            if name in names:
                names.discard(name)
                if not names:
                    self.log(f"every actor of lost node {node[:12]} is back: the run continues")

    def trainer_lost(self, ping: Callable[[], object], wait_s: float = 90.0) -> bool:
        """A call to the trainer failed: True once this watch has found the trainer's node lost. Until
        Ray declares a host dead (above), calls to an actor there fail with ActorUnavailableError or
        hang; then with ActorDiedError. False when `ping` (a call to the trainer) answers, when the
        trainer died on a node that lives, or after `wait_s` (past Ray's 65 s for a host cut off)."""
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        deadline = time.monotonic() + wait_s
        while "trainer" not in self.reason and time.monotonic() < deadline:
            try:
                ping()
                return False                    # it answers: what failed was not its host
            except (ActorUnavailableError, GetTimeoutError):
                pass                            # its host not declared yet: ask again
            except RayActorError:               # dead: the node table says within a poll whether its host is
                deadline = min(deadline, time.monotonic() + 3.0)
            time.sleep(0.5)
        return "trainer" in self.reason

    def waiting_for(self) -> set[str]:
        return set().union(*(names for _, names in self.lost.values())) if self.lost else set()
