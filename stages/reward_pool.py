"""Worker processes for user reward functions: a call that hangs is killed, not waited on.

A user's `reward.fn` may block for ever (a network call, a deadlock, a sleep). In a thread
it can be neither stopped nor kept from holding the interpreter at exit, so each call runs
in one of a few worker subprocesses instead: all rows of a batch are queued at once, up to
`workers` run at the same time, and a call past its timeout has its worker killed (with
its process group) and replaced. A batch with k hanging rows therefore costs about
ceil(k / workers) timeouts, not k.

The workers are plain `python -m stages.reward_pool` children speaking pickled messages
over a socket pair, not multiprocessing ones: nothing of the parent (its `__main__`, a Ray
worker's state) is re-imported, a user's prints go to the inherited stdout, and each worker
exits by itself when its parent dies (a Ray actor killed with SIGKILL runs no atexit).

This module imports only the standard library, so a worker starts in ~35 ms plus the user
module's own imports.
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait

START_TIMEOUT_S = 120.0     # a worker's start-up (the user module's imports), before any row is timed
PARENT_POLL_S = 0.5         # how often a worker checks that its parent is alive
FLUSH_S = 0.01              # a worker sends what it has scored at least this often
SPLIT_S = 0.01              # a batch is spread over more workers only when it would take longer than this


class BadReward(ValueError):
    """A reward fn returned something that is not a finite reward; the message reads after "returned"."""


def as_reward(res) -> tuple[float, str]:
    """A reward fn's result -> (reward, reward_info JSON). A dict gives its "reward" and the rest as
    info. Raises BadReward saying what is wrong: no reward key, not a number, not finite, info not JSON."""
    info = {}
    if isinstance(res, dict):
        if "reward" not in res:
            raise BadReward(f"a dict with no 'reward' key: {sorted(res)}")
        info = {k: v for k, v in res.items() if k != "reward"}
        res = res["reward"]
    try:
        reward = float(res) if not isinstance(res, (str, bytes)) else None
    except (TypeError, ValueError):
        reward = None
    if reward is None:
        raise BadReward(f"a reward that is not a number: {res!r}")
    if not math.isfinite(reward):     # NaN / inf would reach the advantages and the loss
        raise BadReward(f"a non-finite reward {reward}")
    try:
        return reward, json.dumps(info)
    except (TypeError, ValueError) as e:
        raise BadReward(f"reward info that is not JSON-serialisable: {e}") from e


def error_text(fn_path: str, e: Exception) -> str:
    if isinstance(e, BadReward):
        return f"reward.fn {fn_path} returned {e}"
    return f"reward.fn {fn_path} raised {type(e).__name__}: {e}"


def call_reward(fn, args: tuple) -> tuple[float, str]:
    res = fn(*args)
    if hasattr(res, "__await__"):       # an `async def` reward fn
        import asyncio

        res = asyncio.run(res)
    return as_reward(res)


def import_dotted(path: str):
    import importlib

    mod, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(mod), attr)


class _Worker:
    """One worker process, its connection, and the rows it was sent, in the order it scores them."""

    def __init__(self, fn_path: str):
        mine, theirs = socket.socketpair()
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p or "." for p in sys.path)}   # the parent's imports
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stages.reward_pool", str(theirs.fileno()), fn_path],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)     # its own process group: whatever the user fn spawned dies with it
        self.conn = Connection(mine.detach())
        self.ready = False
        self.jobs: deque[int] = deque()     # sent, not answered; the first is running
        self.deadline = time.monotonic() + START_TIMEOUT_S
        self.mark = 0.0                     # when it was last sent rows or last answered

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.conn.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:   # stuck in the kernel; the OS reaps it later
            pass

    def exit_text(self) -> str:
        try:
            rc = self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        return f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"


def _kill_all(workers: list) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class RewardPool:
    """`map(calls)`: fn(*args) for each call in worker processes -> (True, (reward, info JSON)) or
    (False, error text) per call, in order. Thread-safe (Ray Data may call a stage from several
    threads; batches then take turns). `close()` kills the workers; so do garbage collection and exit.

    An idle worker is sent its share of the queue at once and answers as it goes (_Replies), so
    a row's deadline starts when the row before it was answered: a message or two each way per
    worker instead of a round trip per row (64 quickstart rows, 4 workers, 2 busy cores: 4-9 ms a
    call with a round trip per row, 1.0-1.6 ms with shares; the thread pool this replaced took 2.1-2.5 ms).
    Shares go to as few workers as the measured time per row makes worth it (SPLIT_S): a cheap
    function runs in one worker, a slow one, or one that timed out, is spread over all."""

    def __init__(self, fn_path: str, workers: int, timeout_s: float):
        self.fn_path, self.size, self.timeout_s = fn_path, max(1, workers), timeout_s
        self.workers: list[_Worker] = []
        self.row_s: float | None = None    # measured seconds per row; None = not yet (use every worker)
        self.suspects: set[int] = set()     # this call's rows that were with a worker when it died
        self.start_deaths = 0               # this call's workers that died before they were ready
        self.lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _kill_all, self.workers)   # also runs at interpreter exit

    def close(self) -> None:
        self._finalizer()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def map(self, calls: list[tuple]) -> list[tuple[bool, object]]:
        with self.lock:
            self.suspects, self.start_deaths = set(), 0
            results: list = [None] * len(calls)
            queue = deque(range(len(calls)))
            while queue or any(w.jobs for w in self.workers):
                busy = sum(bool(w.jobs) for w in self.workers)
                while len(self.workers) < min(self.size, busy + len(queue)):   # a killed worker is replaced
                    self.workers.append(_Worker(self.fn_path))
                self._send(calls, queue)
                self._wait(results, queue)
            return results

    def _send(self, calls: list[tuple], queue: deque) -> None:
        """Spread the queue over idle workers, as many as the measured time per row makes worth it."""
        idle = [w for w in self.workers if w.ready and not w.jobs]
        if not idle or not queue:
            return
        free = len(idle) + sum(not w.ready for w in self.workers)     # workers still starting get shares too
        use = free if self.row_s is None else min(free, math.ceil(self.row_s * len(queue) / SPLIT_S))
        share = -(-len(queue) // max(1, use))
        for w in idle[:max(1, use)]:
            if not queue:
                break
            w.jobs.append(queue.popleft())
            while queue and len(w.jobs) < share and not self.suspects & {w.jobs[0], queue[0]}:
                w.jobs.append(queue.popleft())      # a row that may kill its worker goes alone
            try:
                w.conn.send([(i, calls[i]) for i in w.jobs])
            except OSError:     # it died since it said ready: its rows wait for the next worker
                queue.extendleft(reversed(w.jobs))
                w.jobs.clear()
                self._drop(w)
                continue
            w.deadline = w.mark = time.monotonic()
            w.deadline += self.timeout_s

    def _wait(self, results: list, queue: deque) -> None:
        """Wait for the next message or deadline; settle what arrived and what ran out of time."""
        waiting = [w for w in self.workers if w.jobs or not w.ready]
        readable = wait([w.conn for w in waiting], max(0.0, min(w.deadline for w in waiting) - time.monotonic()))
        for w in waiting:
            while w.conn in readable and w in self.workers and w.conn.poll():
                self._receive(w, results, queue)
            if w in self.workers and time.monotonic() >= w.deadline and (w.jobs or not w.ready):
                if w.jobs:
                    self._fail_first(w, results, queue, f" timed out after {self.timeout_s}s "
                                                        "(its worker process was killed)")
                    self.row_s = max(self.row_s or 0.0, self.timeout_s)    # rows may hang: spread them out
                else:
                    self._fail_queue(results, queue, f": its worker process did not start within {START_TIMEOUT_S}s")
                self._drop(w)

    def _receive(self, w: _Worker, results: list, queue: deque) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):     # the worker died: a crash in user code, or killed from outside
            if len(w.jobs) == 1:
                self._fail_first(w, results, queue, f": its worker process {w.exit_text()} while scoring this row")
            elif w.jobs:    # which of its rows killed it is unknown: each is run again alone
                self.suspects.update(w.jobs)
                queue.extendleft(reversed(w.jobs))
                w.jobs.clear()
            else:   # twice in a call: the user module kills its interpreter on import
                self.start_deaths += 1
                if self.start_deaths >= 2:
                    self._fail_queue(results, queue, f": its worker process {w.exit_text()} on start")
            self._drop(w)
            return
        if kind == "ready":
            w.ready = True
        elif kind == "load_error":
            self._fail_queue(results, queue, f" does not load in a worker process: {payload}")
            self._drop(w)
        else:
            for result in payload:      # answers come in the order the rows were sent
                results[w.jobs.popleft()] = result
            now = time.monotonic()
            per_row = (now - w.mark) / len(payload)
            self.row_s = per_row if self.row_s is None else 0.7 * self.row_s + 0.3 * per_row
            w.mark, w.deadline = now, now + self.timeout_s     # the next row started (at most FLUSH_S ago)

    def _fail_first(self, w: _Worker, results: list, queue: deque, why: str) -> None:
        """The running row failed its worker: it fails; the rows sent after it go back to the queue."""
        results[w.jobs.popleft()] = (False, f"reward.fn {self.fn_path}{why}")
        queue.extendleft(reversed(w.jobs))
        w.jobs.clear()

    def _fail_queue(self, results: list, queue: deque, why: str) -> None:
        """A worker that cannot start fails the rows still waiting (not the run: the next batch tries again)."""
        while queue:
            results[queue.popleft()] = (False, f"reward.fn {self.fn_path}{why}")

    def _drop(self, w: _Worker) -> None:
        w.kill()
        self.workers.remove(w)


# ---- the worker process ----------------------------------------------------------------

class _Replies:
    """A worker's answers, sent to the parent together: when its share is done, and every FLUSH_S
    from a thread while it runs, so the parent learns of a finished row even while the next one
    hangs (its deadline then starts at most FLUSH_S late). The same thread exits the worker when
    its parent is gone."""

    def __init__(self, conn: Connection):
        self.conn, self.pending = conn, []
        self.cond = threading.Condition()
        self.parent = os.getppid()
        threading.Thread(target=self._run, daemon=True).start()

    def add(self, result) -> None:
        with self.cond:
            self.pending.append(result)
            if len(self.pending) == 1:      # the thread starts its FLUSH_S wait
                self.cond.notify()

    def flush(self) -> None:
        with self.cond:
            if self.pending:
                self.conn.send(("done", self.pending))
                self.pending = []

    def _run(self) -> None:
        while os.getppid() == self.parent:
            with self.cond:
                self.cond.wait(PARENT_POLL_S)
            if self.pending:
                time.sleep(FLUSH_S)     # gather the rows that follow quickly
                self.flush()
        os._exit(1)


def _serve(fd: int, fn_path: str) -> None:
    conn = Connection(fd)
    replies = _Replies(conn)
    try:
        fn = import_dotted(fn_path)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the rows
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            jobs = conn.recv()
        except (EOFError, OSError):     # the parent closed the pool
            return
        for _, args in jobs:
            try:
                replies.add((True, call_reward(fn, args)))
            except Exception as e:  # noqa: BLE001 - user code: fail the row, keep the worker
                replies.add((False, error_text(fn_path, e)))
        replies.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
