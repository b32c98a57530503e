"""The step loop, one for a run and for a replay:

    for each step:
        batch   = window.next_step(version)       (taken on a thread during the previous update)
        metrics = train(batch)                    (the previous step's bookkeeping runs meanwhile)
        version += 1; publish(version)            (weights to every engine)
        window.consumed(batch, version)           (rollout may run ahead again)
        checkpoint, when due
        record(step, batch, metrics)              (deferred: runs during the next update)

With `queue_next` (async mode) the next update is submitted as soon as the sender is free and its
batch is there, while the engines still land the weights (not on a checkpoint's step or the last,
whose weights must stay put).
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import pyarrow as pa


@dataclass
class Batch:
    """One step's table, as the step loop holds it."""
    table: pa.Table
    wait_s: float          # how long the loop waited for it
    version: int = 0       # the weight version it is trained at (set by the loop)


class StepLoop:
    """`train(table)` returns an update's metrics or a Ray ref to them; `publish` is Faults.publish (None:
    nothing to publish to, as in replay). `lock` is held from the update to the checkpoint (a restarted
    engine is re-sent weights between steps, not mid-update)."""

    def __init__(self, window, train: Callable[[pa.Table], Any], record: Callable[[int, Batch, dict], None],
                 steps: int, *, step: int = 0, version: int = 0, publish: Callable | None = None,
                 checkpoint: Callable[[], Any] = lambda: None, lock: ContextManager | None = None,
                 span: Callable = lambda *a, **kw: None, queue_next: bool = False, checkpoint_every: int = 0):
        self.window, self.train, self.record, self.publish = window, train, record, publish
        self.steps, self.step, self.version = steps, step, version
        self.checkpoint, self.lock, self.span = checkpoint, lock or contextlib.nullcontext(), span
        self.queue_next, self.checkpoint_every = queue_next, checkpoint_every
        self.stop = threading.Event()         # set (e.g. on SIGINT): the loop ends after the step in hand
        self._ahead: Ahead | None = None      # the next table, being taken
        self._queued: tuple[Batch, Any] | None = None    # the next update, submitted behind the weight send
        self._in_hand = False                 # a batch is being trained (its step not yet counted)
        self._start, self._taken = (step, version), 0     # tables taken off the window since the start

    def start(self) -> None:
        """Begin taking the first table (run() does, if this did not)."""
        if self._ahead is None and not self._taken:
            self._take()

    def run(self) -> int:
        """Train until `steps`, the stream's end or `stop`; returns the steps done."""
        self.start()
        deferred = None
        try:
            while self.step < self.steps and (self._queued or not self.stop.is_set()):    # a queued update ends
                batch = self._next_batch()
                if batch is None:
                    break
                self._in_hand = True
                with self.lock:
                    batch.version, step = self.version, self.step + 1
                    t0 = time.time()
                    self.span("batcher", t0 - batch.wait_s, t0, step=step, rows_out=batch.table.num_rows)
                    queued, self._queued = self._queued, None
                    ref = queued[1] if queued else self.train(batch.table)
                    if deferred:
                        self.record(*deferred)
                    metrics = dict(ref if isinstance(ref, dict) else _get(ref))
                    t1 = time.time()
                    self.span("update", t0, t1, actor="trainer", step=step, rows_in=batch.table.num_rows,
                              tokens=int(metrics.get("train/tokens", 0)))
                    self.version += 1
                    self.step += 1
                    self._in_hand = False
                    metrics |= {"time/rollout_wait_s": 0.0 if queued else batch.wait_s, "time/update_s": t1 - t0}
                    if self.publish is not None:
                        metrics |= self.publish(self.version, self._queue_next) | {
                            "time/sync_s": time.time() - t1, "time/next_update_queued": float(bool(self._queued))}
                        self.span("sync", t1, time.time(), actor="trainer", step=step)
                    self.window.consumed(sorted(set(batch.table.column("group_id").to_pylist())), self.version)
                    if self._checkpoint_due():
                        self.checkpoint()             # before the next step touches the weights
                deferred = (self.step, batch, metrics)
            if deferred:
                self.record(*deferred)
        finally:
            self.close()
        return self.step

    def last_step(self) -> int:
        """The last step trained if `stop` is set now: the step in hand and a queued update finish; a batch
        still being rolled out is not waited for."""
        return self.step + int(self._in_hand) + int(bool(self._queued))

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the stream: its producers are released first (the window closes), so a take in hand ends;
        then the stream is closed (not while a take still holds it after `timeout_s`)."""
        self.window.close()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.join(timeout_s)
        if ahead is None or not ahead.is_alive():
            self.window.stop_reading()

    def _checkpoint_due(self) -> bool:
        return bool(self.checkpoint_every and self.step % self.checkpoint_every == 0)

    def _take(self) -> None:
        """Start taking the next table (at the version it will be trained at), if the run needs one more."""
        step, version = self._start
        more = step + self._taken < self.steps
        self._ahead = Ahead(self.window, version + self._taken) if more else None

    def _next_batch(self) -> Batch | None:
        """The queued update's batch, else the table being taken (None: the stream ended or the run stops)."""
        if self._queued:
            return self._queued[0]
        t = time.time()
        while self._ahead is not None and self._ahead.is_alive() and not self.stop.is_set():
            self._ahead.join(0.2)
        return self._took(time.time() - t)

    def _took(self, wait_s: float) -> Batch | None:
        ahead = self._ahead
        if ahead is None or ahead.is_alive():
            return None
        if ahead.error is not None:
            raise ahead.error
        if ahead.table is None:
            self._ahead = None
            return None
        self._taken += 1
        self._take()
        return Batch(ahead.table, wait_s)

    def _queue_next(self) -> None:
        """The sender is free: submit the next update now if it may go and its batch is there."""
        due = self._checkpoint_due() or self.step >= self.steps or self.stop.is_set()
        if self.queue_next and not due:
            batch = self._took(0.0)
            if batch is not None:
                self._queued = (batch, self.train(batch.table))


def _get(ref) -> dict:
    import ray

    return ray.get(ref)


class Ahead(threading.Thread):
    """The next step's table, taken off the window on a thread while the trainer works; one table ahead
    at most, taken at the version it will be trained at, so the staleness bound holds."""

    def __init__(self, window, version: int):
        super().__init__(name="prefetch", daemon=True)
        self.window, self.version = window, version
        self.table: pa.Table | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.table = self.window.next_step(self.version)
        except BaseException as e:     # noqa: BLE001 - re-raised in the step loop
            self.error = e
