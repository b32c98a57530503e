"""The window: how far rollout runs ahead of training, and which groups each step trains.

Capacity C = int(B * (1 + stale_steps)) prompt groups, B groups per step (`stale_steps = 0`: C = B, the
synchronous on-policy baseline). R = dispatched but not collected, Q = collected but not consumed. A
strategy decides whether one more group may be dispatched and whether a finished group may be collected.

The `Gate` is a small async Ray actor: rollout workers await `acquire` before they generate a group and
get back the weight version they generate under. The `Window` is the driver's side, the one place that
knows a step's groups: it keeps streamed rows until their group is whole, drops groups older than the
bound (or, with dynamic sampling, of equal rewards), hands the step loop B groups a step and, told they
were trained (`consumed`), settles them and moves the gate on. `settled` (trained or dropped) is what a
checkpoint saves: a resumed run never streams those again.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stages.batcher_config import BatcherConfig
from stages.keys import import_object
from stages.schema import conform, mask_old_versions, mask_stale, oldest_trained_version


@dataclass
class WindowState:
    groups_per_step: int                        # B
    capacity: int                               # C
    version: int = 0
    dispatched: dict = field(default_factory=dict)   # seq -> version at dispatch (R: not yet collected)
    collected: set = field(default_factory=set)      # Q: collected, not consumed
    closed: bool = False
    out_of_order: int = 0                       # groups dispatched ahead of the stream's order (turn timeout)

    @property
    def in_flight(self) -> int:      # R
        return len(self.dispatched)

    @property
    def buffered(self) -> int:       # Q
        return len(self.collected)

    def min_uncompleted(self, default: int) -> int:
        return min(self.dispatched, default=default)


class NoWindow:
    """Dispatch while R + Q < C. A strategy is a class with these two methods."""
    name = "no-window"

    def can_dispatch(self, s: WindowState, seq: int) -> bool:
        return s.in_flight + s.buffered < s.capacity

    def can_collect(self, s: WindowState, seq: int) -> bool:
        return True


class WindowGated(NoWindow):
    """Also seq - oldest_uncollected_seq < C: a slow group holds the window."""
    name = "window-gated"

    def can_dispatch(self, s: WindowState, seq: int) -> bool:
        return super().can_dispatch(s, seq) and seq - s.min_uncompleted(seq) < s.capacity


class WindowedFifo(NoWindow):
    """Collect only groups with seq - min_uncompleted_seq < B."""
    name = "windowed-fifo"

    def can_collect(self, s: WindowState, seq: int) -> bool:
        return seq - s.min_uncompleted(seq) < s.groups_per_step


STRATEGIES = {c.name: c for c in (NoWindow, WindowGated, WindowedFifo)}


def make_strategy(name: str) -> Any:
    """A built-in name, or `package.module:Class` / `package.module.Class` for a user strategy."""
    if name in STRATEGIES:
        return STRATEGIES[name]()
    if "." in name or ":" in name:
        try:
            return import_object(name)()
        except Exception as e:      # the user's module may raise anything while it imports
            raise ValueError(f"window strategy {name!r} does not import: {type(e).__name__}: {e}") from e
    raise ValueError(f"unknown window strategy {name!r}; built-in: {', '.join(STRATEGIES)} (or a dotted path)")


def capacity(groups_per_step: int, stale_steps: float) -> int:
    return int(groups_per_step * (1 + stale_steps))


TURN_TIMEOUT_S = 30.0


class Gate:
    """Ray actor (async): who may generate now, and under which weight version."""

    def __init__(self, groups_per_step: int, stale_steps: float = 0, strategy: str = "no-window", version: int = 0,
                 held: bool = False):
        self.s = WindowState(groups_per_step, capacity(groups_per_step, stale_steps), version=version)
        self.strategy = make_strategy(strategy)
        self._cond = asyncio.Condition()
        self._order: dict[int, None] = {}   # the stream's seqs not yet dispatched, in stream order
        self._held = held                   # nothing is dispatched until open(): a stream opens before its run

    async def open(self) -> None:
        async with self._cond:
            self._held = False
            self._cond.notify_all()

    async def expect(self, seqs: list[int]) -> None:
        """The stream will ask for these seqs: dispatch them in this order, whichever worker asks first
        (workers pick up blocks concurrently; unordered, a step would train other groups each run)."""
        async with self._cond:
            self._order = dict.fromkeys(q for q in seqs if q not in self.s.dispatched)
            self._cond.notify_all()

    async def _wait_turn(self, seq: int) -> bool:
        """Wait until `seq` may go (False: the gate closed), in stream order unless the head group was
        not asked for within TURN_TIMEOUT_S (stuck upstream): then `seq` goes out of order, counted."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TURN_TIMEOUT_S
        while not self.s.closed:
            if not self.strategy.can_dispatch(self.s, seq):
                await self._cond.wait()
                deadline = loop.time() + TURN_TIMEOUT_S   # the window was full: the turn clock starts now
            elif seq not in self._order or next(iter(self._order)) == seq:
                return True
            elif loop.time() >= deadline:
                self.s.out_of_order += 1
                return True
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._cond.wait(), deadline - loop.time())
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
                if seq in self._order:
                    del self._order[seq]        # the head, unless the turn wait timed out
                    self._cond.notify_all()
            return self.s.version

    async def collected(self, seqs: list[int]) -> None:
        async with self._cond:
            for q in seqs:
                self.s.dispatched.pop(q, None)
                self.s.collected.add(q)
            self._cond.notify_all()

    async def consumed(self, seqs: list[int], new_version: int | None = None) -> None:
        """Collected groups left the window: trained (the weights are now `new_version`), or dropped."""
        async with self._cond:
            self.s.collected.difference_update(seqs)
            if new_version is not None:
                self.s.version = new_version
            self._cond.notify_all()

    async def close(self) -> None:
        async with self._cond:
            self.s.closed = True
            self._cond.notify_all()

    async def snapshot(self) -> WindowState:
        return dataclasses.replace(self.s, dispatched=dict(self.s.dispatched), collected=set(self.s.collected))


GateCall = Callable[..., Any]     # gate(method, *args): a Gate method's result


def on_actor(handle) -> GateCall:
    """The gate actor, called from the driver."""
    import ray

    return lambda method, *args: ray.get(getattr(handle, method).remote(*args))


def in_loop(gate: Gate, loop: asyncio.AbstractEventLoop) -> GateCall:
    """A Gate in this process, run on `loop` (the planner's simulation, tests)."""
    return lambda method, *args: loop.run_until_complete(getattr(gate, method)(*args))


class Window:
    """The driver's side of the window (module docstring). Rows come from `read(parts)`; without a
    gate (replay) nothing is dispatched and every whole group may be collected."""

    def __init__(self, cfg: BatcherConfig, n_samples: int, stale_steps: float = 0, strategy: str = "no-window",
                 gate: GateCall | None = None, settled=(), mask_old: bool = False):
        self.cfg, self.n, self.max_staleness, self.mask_old = cfg, n_samples, int(stale_steps), mask_old
        self.strategy = make_strategy(strategy) if gate is not None else None
        self.gate = gate or (lambda method, *args: None)
        self.settled = set(settled)                 # trained or dropped: never streamed again
        self.fairness = Fairness()                  # also the counts of groups completed, trained, dropped
        self._partial: dict[int, tuple[list, set]] = {}   # a group's rows and samples until all its samples arrived
        self._ready: dict[int, tuple[pa.Table, float]] = {}   # whole groups: (rows, oldest trained version)
        self._parts: Iterator[pa.Table] = (part for part in ())
        self._lock = threading.Lock()               # settled: the stream's thread drops, the loop settles
        self.closed = False

    def feed(self, part: pa.Table) -> list[int]:
        """Add streamed rows (a sample may be several rows: one per agent segment); the groups they
        complete are collected. Returns those."""
        gids = part.column("group_id").to_numpy(zero_copy_only=False)
        order = np.argsort(gids, kind="stable")     # each group's rows once: a slice per group, in stream order
        part, gids = part.take(order), gids[order]
        starts = np.flatnonzero(np.r_[True, gids[1:] != gids[:-1]]) if len(gids) else []
        done = []
        for lo, hi in zip(starts, np.r_[starts[1:], len(gids)]):
            g, rows = int(gids[lo]), part.slice(lo, hi - lo)
            pieces, seen = self._partial.setdefault(g, ([], set()))
            pieces.append(rows)
            seen.update(rows.column("sample_idx").to_pylist())
            if len(seen) >= self.n:
                table = pa.concat_tables(self._partial.pop(g)[0])
                self._ready[g] = table, oldest_trained_version(table)
                done.append(g)
        if done:
            self.fairness.add("completed", pa.concat_tables([self._ready[g][0] for g in done]))
            self.gate("collected", done)
        return done

    def take(self, version: int) -> tuple[pa.Table | None, list[int]]:
        """B eligible whole groups as one table for a step trained at `version`, or None; and the
        groups dropped now (settled: a resumed run never streams them again)."""
        dropped, bound = [], version - self.max_staleness
        for g in sorted(self._ready):
            table, oldest = self._ready[g]
            if oldest < bound and self.cfg.stale_policy == "mask":
                table = mask_stale(table, bound)
                oldest = oldest_trained_version(table)      # newer now, unless no token is left in the loss
                self._ready[g] = table, oldest
            stale = oldest < bound and self.cfg.stale_policy != "wait"
            if stale or self.cfg.filter_equal_rewards and len(set(table.column("reward").to_pylist())) <= 1:
                dropped.append(g)
                del self._ready[g]
                self.fairness.groups["dropped_stale" if stale else "dropped_filter"] += 1
        if dropped:
            self.consumed(dropped)
        state = self.gate("snapshot") if self.strategy is not None else None
        eligible = [g for g in sorted(self._ready) if self._ready[g][1] >= bound
                    and (state is None or self.strategy.can_collect(state, g))]
        if len(eligible) < self.cfg.groups_per_step:
            return None, dropped
        table = pa.concat_tables([self._ready.pop(g)[0] for g in eligible[:self.cfg.groups_per_step]])
        self.fairness.add("trained", table)
        return table, dropped

    def read(self, parts: Generator[pa.Table, None, None]) -> None:
        self._parts = parts

    def chunks(self, open_stream: Callable[[int, int, frozenset], Iterator[pa.Table]], groups: int):
        """The run's stream: from the first unsettled group on, `groups` groups to stream at a time, each
        chunk a stream of its own (`open_stream(start, count, skip)`) whose order the gate keeps."""
        with self._lock:
            settled = set(self.settled)
        start = min(set(range(max(settled, default=-1) + 2)) - settled)
        while True:
            skip = frozenset(q for q in settled if q >= start)    # settled before a resume
            count = groups + len(skip)
            self.gate("expect", [q for q in range(start, start + count) if q not in skip])
            with contextlib.closing(open_stream(start, count, skip)) as stream:
                yield from stream
            start += count

    def next_step(self, version: int) -> pa.Table | None:
        """The next step's table, trained at `version`, read off the stream as far as it takes; None when
        the stream ended or the window closed."""
        while not self.closed:
            table, _ = self.take(version)
            if table is not None:
                if self.mask_old:
                    table = mask_old_versions(table)
                # one chunk per column: a step's table is sliced from many blocks, and serialising
                # slices ships their parent buffers
                return conform(table).combine_chunks()
            part = next(self._parts, None)
            if part is None:
                break
            self.feed(part)
        return None

    def consumed(self, groups: list[int], version: int | None = None) -> None:
        """The groups were trained (the weights are now `version`) or dropped: settled, and the window moves on."""
        with self._lock:
            self.settled.update(groups)
        self.gate("consumed", groups, version)

    def saved(self) -> list[int]:
        """The settled groups, as a checkpoint saves them."""
        with self._lock:
            return sorted(self.settled)

    def stop_reading(self) -> None:
        """Close the stream (from the thread that reads it)."""
        self._parts.close()

    def close(self) -> None:
        """Dispatch nothing more: rollouts waiting at the gate return, and next_step soon returns None."""
        self.closed = True
        self.gate("close")

    def metrics(self) -> dict:
        """The window's figures now: groups out and waiting, dropped, dispatched out of order, fairness."""
        s = self.gate("snapshot") if self.strategy is not None else None
        g = self.fairness.groups
        return {"filter_drop": g["dropped_filter"], "stale_drop": g["dropped_stale"]} | self.fairness.summary() | (
            {"pipeline_buf_size": s.in_flight + s.buffered, "dispatch_out_of_order": s.out_of_order} if s else {})


LONG_QUANTILE = 0.75     # a trajectory is long when its wall time is above this quantile of all completed ones

# wall-time bins of the fairness tally: log-spaced, 1.2% wide, 0.1 ms to ~28 h (beyond: the end bins)
_WALL_EDGES = np.geomspace(1e-4, 1e5, 1741)


def trajectories(t: pa.Table) -> list[tuple[float, int, int]]:
    """(wall seconds: first dispatch to last done, model turns, response tokens) per trajectory
    (group, sample) of a table; turns are 1 for rows without agent stats (single-turn)."""
    n = t.num_rows
    col = {c: t.column(c).to_pylist() if c in t.column_names else [None] * n
           for c in ("group_id", "sample_idx", "t_dispatch", "t_done", "agent_stats")}
    col["tokens"] = (pc.fill_null(pc.list_value_length(t.column("response_ids")), 0).to_pylist()
                     if "response_ids" in t.column_names else [0] * n)
    out: dict[tuple, list] = {}
    for g, k, lo, hi, st, n_tok in zip(*col.values()):
        cur = out.setdefault((g, k), [lo or 0.0, hi or 0.0, (st or {}).get("turns") or 1, 0])
        cur[0], cur[1], cur[3] = min(cur[0], lo or cur[0]), max(cur[1], hi or cur[1]), cur[3] + n_tok
    return [(hi - lo, turns, tokens) for lo, hi, turns, tokens in out.values()]


class Tally:
    """Running sums of trajectories' SUMMED figures and a wall-time histogram: constant work per
    summary however long the run."""
    SUMMED = ("wall_s", "turns", "tokens")

    def __init__(self):
        self.n, self.sums = 0, np.zeros(len(self.SUMMED))
        self.hist = np.zeros(len(_WALL_EDGES) + 1, dtype=np.int64)

    def add(self, rows: list[tuple[float, int, int]]) -> None:
        if rows:
            a = np.asarray(rows, dtype=np.float64)
            self.n += len(rows)
            self.sums += a.sum(axis=0)
            np.add.at(self.hist, np.searchsorted(_WALL_EDGES, a[:, 0], side="right"), 1)


@dataclass
class Fairness:
    """What the window saw complete (trained, dropped or waiting) against what it handed the trainer,
    per trajectory over the run: the window must not bias training toward fast trajectories. `long`:
    a wall time above LONG_QUANTILE of the completed ones."""
    completed: Tally = field(default_factory=Tally)
    trained: Tally = field(default_factory=Tally)
    groups: dict = field(default_factory=lambda: {"completed": 0, "trained": 0, "dropped_stale": 0,
                                                  "dropped_filter": 0})

    def add(self, kind: str, table: pa.Table) -> None:
        """Whole groups' rows that completed, or were trained (`kind`)."""
        getattr(self, kind).add(trajectories(table))
        self.groups[kind] += pc.count_distinct(table.column("group_id")).as_py()

    def summary(self) -> dict:
        c = self.completed
        if not c.n:
            return {}
        # the bin holding the completed trajectory of rank int(LONG_QUANTILE * n) by wall time
        cut = int(np.searchsorted(np.cumsum(c.hist), min(c.n - 1, int(LONG_QUANTILE * c.n)), side="right"))
        out = {f"fair/groups_{k}": v for k, v in self.groups.items()}
        for name, tally in (("completed", self.completed), ("trained", self.trained)):
            if tally.n:
                out |= {f"fair/{name}_{k}_mean": v for k, v in zip(tally.SUMMED, (tally.sums / tally.n).tolist())}
                out[f"fair/{name}_long_share"] = float(tally.hist[cut + 1:].sum()) / tally.n
        return out
