"""inproc: sender and receiver in one process (a colocated trainer + engine actor).

Nothing is copied or checksummed: the receiver gets the sender's own tensors through a
per-process slot, and its load_weights (or the in-place landing) copies them into its model."""
from __future__ import annotations

import os
import threading

_SLOTS: dict[str, "_Slot"] = {}      # mesh id -> the latest version handed over in this process (dict calls are atomic)


class _Slot:
    def __init__(self):
        self.cond = threading.Condition()
        self.version, self.state = -1, {}


class InprocSend:
    staged = False
    reads_after_send = True     # the receiver copies the sender's own tensors

    def __init__(self, mesh_id, receivers, cfg, party, staging):
        self.mesh_id, self.slot = mesh_id, _SLOTS.setdefault(mesh_id, _Slot())

    def prepare(self, snapshot) -> dict:
        return {"pid": os.getpid()}     # route planning put the receiver in this process

    def send(self, snapshot) -> None:
        with self.slot.cond:
            self.slot.version, self.slot.state = snapshot.version, snapshot.state
            self.slot.cond.notify_all()

    def close(self) -> None:
        _SLOTS.pop(self.mesh_id, None)


class InprocRecv:
    def __init__(self, mesh_id, name, address, cfg, party):
        self.slot, self.timeout = _SLOTS.setdefault(mesh_id, _Slot()), cfg.timeout_s

    def receive(self, version, layout):
        with self.slot.cond:
            if not self.slot.cond.wait_for(lambda: self.slot.version >= version, self.timeout):
                raise TimeoutError(f"sender did not hand over version {version} within {self.timeout}s")
            if self.slot.version != version:
                raise RuntimeError(f"version {version} was superseded by {self.slot.version}")
            return dict(self.slot.state), iter(())

    def close(self) -> None:
        pass
