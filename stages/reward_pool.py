"""Worker processes for user reward functions: a call that hangs is killed, not waited on.

A user's `reward.fn` may block for ever; in a thread it could be neither stopped nor kept from holding
the interpreter at exit. So each call runs in one of `workers` subprocesses, and a row past its
timeout has its worker killed (with its process group) and replaced: k hanging rows cost about
ceil(k / workers) timeouts, not k.

The workers are plain `python -m stages.reward_pool` children speaking pickled messages over a
socket pair: nothing of the parent is re-imported, and each exits by itself when its parent dies
(a Ray actor killed with SIGKILL runs no atexit). This module imports only the standard library and keys.py.
"""
from __future__ import annotations

import contextlib
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

from stages.keys import import_object

START_TIMEOUT_S = 120.0     # a worker's start-up (the user module's imports), before any row is timed
PARENT_POLL_S = 0.5         # how often a worker checks that its parent is alive


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


def score(fn, fn_path: str, args: tuple) -> tuple[bool, object]:
    """(True, (reward, info JSON)) of fn(*args), or (False, error text): user code fails its row, not the run."""
    try:
        res = fn(*args)
        if hasattr(res, "__await__"):       # an `async def` reward fn
            import asyncio

            res = asyncio.run(res)
        return True, as_reward(res)
    except BadReward as e:
        return False, f"reward.fn {fn_path} returned {e}"
    except Exception as e:  # noqa: BLE001 - user code: fail the row, keep the worker
        return False, f"reward.fn {fn_path} raised {type(e).__name__}: {e}"


class _Worker:
    """One worker process, its connection, and the row it is scoring (None: idle)."""

    def __init__(self, fn_path: str):
        mine, theirs = socket.socketpair()
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p or "." for p in sys.path)}   # the parent's imports
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stages.reward_pool", str(theirs.fileno()), fn_path],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)     # its own process group: whatever the user fn spawned dies with it
        self.conn = Connection(mine.detach())
        self.ready, self.job = False, None
        self.deadline = time.monotonic() + START_TIMEOUT_S

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.conn.close()
        with contextlib.suppress(subprocess.TimeoutExpired):    # stuck in the kernel; the OS reaps it later
            self.proc.wait(timeout=5)

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
    threads; batches then take turns). `close()` kills the workers; so do garbage collection and exit."""

    def __init__(self, fn_path: str, workers: int, timeout_s: float):
        self.fn_path, self.size, self.timeout_s = fn_path, workers, timeout_s
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.close = weakref.finalize(self, _kill_all, self.workers)   # close(); also runs at interpreter exit

    def map(self, calls: list[tuple]) -> list[tuple[bool, object]]:
        with self.lock:
            results: list = [None] * len(calls)
            queue, start_deaths = deque(range(len(calls))), 0
            while queue or any(w.job is not None for w in self.workers):
                busy = sum(w.job is not None for w in self.workers)
                while len(self.workers) < min(self.size, busy + len(queue)):   # a killed worker is replaced
                    self.workers.append(_Worker(self.fn_path))
                for w in self.workers:
                    if w.ready and w.job is None and queue:
                        w.job = queue.popleft()
                        w.deadline = time.monotonic() + self.timeout_s
                        try:
                            w.conn.send(calls[w.job])
                        except OSError:     # it died since it said ready: the row waits for the next worker
                            queue.appendleft(w.job)
                            self._drop(w)
                start_deaths += self._wait(results, queue)
                if start_deaths >= 2:       # twice in a call: the user module kills its interpreter on import
                    self._fail(results, queue, ": its worker process died on start")
            return results

    def _wait(self, results: list, queue: deque) -> int:
        """Wait for the next message or deadline; settle what arrived and what ran out of time.
        Returns how many workers died before they were ready."""
        waiting, died = list(self.workers), 0
        first = min(w.deadline for w in waiting)
        readable = wait([w.conn for w in waiting], None if first == math.inf else max(0.0, first - time.monotonic()))
        for w in waiting:
            if w.conn in readable:
                try:
                    kind, payload = w.conn.recv()
                except (EOFError, OSError):     # it died: a crash in user code, or killed from outside
                    if w.job is not None:
                        results[w.job] = (False, f"reward.fn {self.fn_path}: its worker process {w.exit_text()} "
                                                 "while scoring this row")
                    died += not w.ready
                    self._drop(w)
                    continue
                if kind == "ready":
                    w.ready, w.deadline = True, math.inf
                elif kind == "load_error":
                    self._fail(results, queue, f" does not load in a worker process: {payload}")
                    self._drop(w)
                else:
                    results[w.job], w.job, w.deadline = payload, None, math.inf
            elif time.monotonic() >= w.deadline:
                if w.job is not None:
                    results[w.job] = (False, f"reward.fn {self.fn_path} timed out after {self.timeout_s}s "
                                             "(its worker process was killed)")
                else:
                    self._fail(results, queue, f": its worker process did not start within {START_TIMEOUT_S}s")
                self._drop(w)
        return died

    def _fail(self, results: list, queue: deque, why: str) -> None:
        """A worker that cannot start fails the rows still waiting (not the run: the next batch tries again)."""
        while queue:
            results[queue.popleft()] = (False, f"reward.fn {self.fn_path}{why}")

    def _drop(self, w: _Worker) -> None:
        w.kill()
        self.workers.remove(w)


# ---- the worker process ----------------------------------------------------------------

def _exit_with_parent() -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def _serve(fd: int, fn_path: str) -> None:
    conn = Connection(fd)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    try:
        fn = import_object(fn_path)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the rows
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):     # the parent closed the pool
            return
        conn.send(("done", score(fn, fn_path, args)))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
