"""Sliding windows: the gate that bounds how far rollout may run ahead of training.

Capacity C = int(B * (1 + stale_steps)) prompt groups, B groups per step.
R = dispatched but not collected, Q = collected but not consumed. A strategy decides
whether one more group may be dispatched and whether a finished group may be collected:

* `no-window`      dispatch while R + Q < C
* `window-gated`   also seq - oldest_uncollected_seq < C (a slow group holds the window)
* `windowed-fifo`  collect only groups with seq - min_uncompleted_seq < B

The gate is a small async Ray actor: rollout workers await `acquire` before generating
a group and get back the weight version they generate under; the controller reports
`collected` / `consumed` and bumps the version after each update. `stale_steps = 0`
gives C = B: the next step's groups wait until the current step's update is published,
which is the synchronous on-policy baseline.
"""
from __future__ import annotations

import asyncio
import importlib
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class WindowState:
    groups_per_step: int                        # B
    capacity: int                               # C
    version: int = 0
    dispatched: dict = field(default_factory=dict)   # seq -> version at dispatch (R: not yet collected)
    collected: set = field(default_factory=set)      # Q: collected, not consumed
    consumed: int = 0
    closed: bool = False

    @property
    def in_flight(self) -> int:      # R
        return len(self.dispatched)

    @property
    def buffered(self) -> int:       # Q
        return len(self.collected)

    def min_uncompleted(self, default: int) -> int:
        return min(self.dispatched, default=default)


class WindowStrategy(Protocol):
    def can_dispatch(self, s: WindowState, seq: int) -> bool: ...
    def can_collect(self, s: WindowState, seq: int) -> bool: ...


class NoWindow:
    name = "no-window"

    def can_dispatch(self, s: WindowState, seq: int) -> bool:
        return s.in_flight + s.buffered < s.capacity

    def can_collect(self, s: WindowState, seq: int) -> bool:
        return True


class WindowGated(NoWindow):
    name = "window-gated"

    def can_dispatch(self, s: WindowState, seq: int) -> bool:
        return super().can_dispatch(s, seq) and seq - s.min_uncompleted(seq) < s.capacity


class WindowedFifo(NoWindow):
    name = "windowed-fifo"

    def can_collect(self, s: WindowState, seq: int) -> bool:
        return seq - s.min_uncompleted(seq) < s.groups_per_step


STRATEGIES = {c.name: c for c in (NoWindow, WindowGated, WindowedFifo)}


def make_strategy(name: str) -> WindowStrategy:
    """A built-in name, or `package.module:Class` / `package.module.Class` for a user strategy."""
    if name in STRATEGIES:
        return STRATEGIES[name]()
    if "." in name or ":" in name:
        mod, _, attr = name.replace(":", ".").rpartition(".")
        try:
            return getattr(importlib.import_module(mod), attr)()
        except Exception as e:      # the user's module may raise anything while it imports
            raise ValueError(f"window strategy {name!r} does not import: {type(e).__name__}: {e}") from e
    raise ValueError(f"unknown window strategy {name!r}; built-in: {', '.join(STRATEGIES)} (or a dotted path)")


def capacity(groups_per_step: int, stale_steps: float) -> int:
    if stale_steps < 0:
        raise ValueError(f"stale_steps must be >= 0, got {stale_steps}")
    return int(groups_per_step * (1 + stale_steps))


TURN_TIMEOUT_S = 30.0


class Gate:
    """Ray actor (async): the window's single source of truth."""

    def __init__(self, groups_per_step: int, stale_steps: float = 0, strategy: str = "no-window", version: int = 0):
        self.s = WindowState(groups_per_step, capacity(groups_per_step, stale_steps), version=version)
        self.strategy = make_strategy(strategy)
        self._cond = asyncio.Condition()
        self._order: deque = deque()    # the stream's seqs not yet dispatched, in stream order
        self._pending: set = set()
        self.out_of_order = 0
        self._held = False              # hold(): nothing is dispatched until open()

    async def hold(self) -> None:
        """Dispatch nothing until open(): the controller starts the stream (its actor pools spawn)
        while the engines and trainer load, and lets rollout begin when the run's clock does."""
        async with self._cond:
            self._held = True

    async def open(self) -> None:
        async with self._cond:
            self._held = False
            self._cond.notify_all()

    async def expect(self, seqs: list[int]) -> None:
        """The stream will ask for these seqs: dispatch them in this order, whichever worker asks first.

        Rollout workers pick up blocks concurrently; without an order a later block can take
        the window first, and a step would train on different groups from run to run.
        """
        async with self._cond:
            self._order = deque(q for q in seqs if q not in self.s.dispatched)
            self._pending = set(self._order)
            self._cond.notify_all()

    def _turn(self, seq: int) -> bool:
        return seq not in self._pending or self._order[0] == seq

    async def _wait_turn(self, seq: int) -> bool:
        """Wait until `seq` may go (False: the gate closed). The stream order is kept unless the
        head group has not been asked for within TURN_TIMEOUT_S (its block is stuck somewhere
        upstream): then `seq` goes out of order, counted in the snapshot, rather than never."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TURN_TIMEOUT_S
        while not self.s.closed:
            if self.strategy.can_dispatch(self.s, seq):
                if self._turn(seq):
                    return True
                if loop.time() >= deadline:
                    self.out_of_order += 1
                    return True
                try:
                    await asyncio.wait_for(self._cond.wait(), deadline - loop.time())
                except asyncio.TimeoutError:
                    pass
            else:
                await self._cond.wait()
                deadline = loop.time() + TURN_TIMEOUT_S   # the window was full: the turn clock starts now
        return False

    async def acquire(self, seqs: list[int]) -> int:
        """Block until every group in `seqs` may be dispatched; return the current version (-1 if closed)."""
        async with self._cond:
            while self._held and not self.s.closed:
                await self._cond.wait()
            for seq in sorted(seqs):
                if seq in self.s.dispatched:
                    continue  # a group split across two batches is dispatched once
                if not await self._wait_turn(seq):
                    return -1
                self.s.dispatched[seq] = self.s.version
                if seq in self._pending:
                    self._pending.discard(seq)
                    self._order.remove(seq)      # the head, unless the turn wait timed out
                    self._cond.notify_all()
            return self.s.version

    async def may_collect(self, seqs: list[int]) -> list[bool]:
        return [self.strategy.can_collect(self.s, q) for q in seqs]

    async def collected(self, seqs: list[int]) -> None:
        async with self._cond:
            for q in seqs:
                self.s.dispatched.pop(q, None)
                self.s.collected.add(q)
            self._cond.notify_all()

    async def release(self, seqs: list[int]) -> None:
        """Forget groups that were dispatched but will never be collected (e.g. dropped)."""
        async with self._cond:
            for q in seqs:
                self.s.dispatched.pop(q, None)
                self.s.collected.discard(q)
            self._cond.notify_all()

    async def consumed(self, seqs: list[int], new_version: int) -> None:
        async with self._cond:
            for q in seqs:
                self.s.collected.discard(q)
            self.s.consumed += len(seqs)
            self.s.version = new_version
            self._cond.notify_all()

    async def close(self) -> None:
        async with self._cond:
            self.s.closed = True
            self._cond.notify_all()

    async def snapshot(self) -> dict:
        return {"version": self.s.version, "in_flight": self.s.in_flight, "buffered": self.s.buffered,
                "consumed": self.s.consumed, "capacity": self.s.capacity,
                "min_uncompleted": self.s.min_uncompleted(-1), "out_of_order": self.out_of_order}
