"""Code sandbox tool: model-written Python snippets, each trajectory's in a sandbox of its own.

An agent that computes by writing code needs somewhere to run it that a bad snippet cannot take
down, and, in RL, that another trajectory's code cannot reach: a snippet that poisons a builtin or
plants a file for the next caller would change other samples' rewards. So `pool.session()` is one
trajectory's sandbox: an interpreter process of its own (taken from `sandbox.workers` spares started
ahead, which have run nothing) in a bubblewrap jail of its own (jail.py `code_argv`: an empty root,
its own namespaces and size-capped /tmp, seccomp, no capabilities), killed when the trajectory ends.
`pool.run(code)` and `pool.tool()` are one-call sessions. With `sandbox.isolation: none` snippets run
with the SandboxConfig limits alone.

A breach (BREACHES) ends the call with an "error: ..." result and the session's worker is killed; its
next call gets a fresh one. An ordinary exception in the snippet leaves it in service. Every call starts
in fresh globals in an emptied directory.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from stages.agentflow.sandbox import jail
from stages.agentflow.tools import Tool
from stages.keys import NONNEG, POSITIVE, between, key, one_of, section

log = logging.getLogger(__name__)
WORKER = Path(__file__).with_name("worker.py")
MARKER = b"\x00\x1esandbox-end:"
BREACHES = ("timeout", "cpu", "memory", "output", "fork", "filesystem", "died")
# stdlib a snippet may want; imported before the worker drops its uid, which may leave it unable to
# read the interpreter's own files (socket is here so that the network namespace is what stops it)
PRELOAD = ("math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools", "collections",
           "re", "json", "string", "random", "datetime", "heapq", "bisect", "operator", "socket", "encodings.idna")
# worker uids: UID_BASE + (pid % 4096) * UID_SLOTS + (sandbox number % UID_SLOTS), unused by anything else here;
# live sandboxes of one pool (at most UID_SLOTS) never share a uid, so RLIMIT_NPROC counts each alone
UID_BASE = 610_000
UID_SLOTS = 256


@section("sandbox")
class SandboxConfig:
    workers: int = key(2, "sandboxes started ahead of need (each serves one trajectory, then ends)", POSITIVE)
    cpu_s: float = key(2.0, "CPU seconds per snippet", POSITIVE)
    timeout_s: float = key(5.0, "wall seconds per snippet (the worker is killed past it)", POSITIVE)
    memory_mb: int = key(512, "address space of a worker, MiB", POSITIVE)
    output_bytes: int = key(4096, "stdout + stderr per snippet", POSITIVE)
    nproc: int = key(8, "processes + threads of the worker's uid (binds only when it has its own uid; 0 = no limit)",
                        NONNEG)
    file_mb: int = key(16, "largest file a snippet may write, MiB", POSITIVE)
    tmp_mb: int = key(32, "size of each private tmpfs, MiB", POSITIVE)
    calls_per_worker: int = key(1000, "a worker is replaced after this many calls (its lifetime CPU budget)", POSITIVE)
    max_sandboxes: int = key(64, "live sandboxes per pool (trajectories at once); more wait for one to end",
                             between(1, UID_SLOTS))
    isolation: str = key("bwrap", "bwrap: each sandbox in a bubblewrap jail (a run is refused where bwrap cannot "
                                  "jail) | none: limits only", one_of("bwrap", "none"))
    python: str = key("", 'interpreter for the workers; "" = this one')
    preload: tuple = key(PRELOAD, "modules imported before the uid drop (see sandbox/worker.py setup)")
    remote: bool = key(False, "True: snippets run in a remote sandbox service (tool_service: a local service "
                              'process per rollout worker when its url is ""), with its latency')

    def __post_init__(self):
        object.__setattr__(self, "preload", (self.preload,) if isinstance(self.preload, str) else tuple(self.preload))


@dataclass(frozen=True)
class Isolation:
    network: bool = False         # own network namespace: no route anywhere
    pid: bool = False             # own PID namespace: killing the worker kills all it started
    private_tmp: bool = False     # /tmp (its cwd) is its own tmpfs
    uid: bool = False             # a uid of its own
    unix_sockets: bool = False    # no Unix socket of the host reachable (no host socket file in its file system)
    seccomp: bool = False         # the jail's seccomp filter
    no_new_privs: bool = False
    tool: str = "none"            # bwrap | none
    notes: tuple = ()

    def describe(self) -> str:
        held = ", ".join(f.name for f in fields(self) if getattr(self, f.name) is True) or "nothing but rlimits"
        return f"isolated ({self.tool}): {held}" + (f"; {'; '.join(self.notes)}" if self.notes else "")


@lru_cache(maxsize=1)
def probe_isolation() -> Isolation:
    """What a sandbox has here: the bubblewrap jail where it runs (nothing where it does not)."""
    root, why = os.geteuid() == 0, jail.probe()
    if why:
        return Isolation(notes=(f"bubblewrap: {why}",))
    notes = () if jail.seccomp_bpf() else ("no seccomp filter: no libseccomp binding (pip install pyseccomp)",)
    return Isolation(network=True, pid=True, private_tmp=True, uid=root, unix_sockets=True,
                     seccomp=bool(jail.seccomp_bpf()), no_new_privs=True, tool="bwrap",
                     notes=notes + (() if root else ("not root: the worker keeps this user's uid",)))


@dataclass
class SandboxResult:
    kind: str                 # ok | error | one of BREACHES
    output: str
    error: str = ""
    wall_s: float = 0.0
    replaced: bool = False    # the worker was killed (the session's next call gets a fresh one)

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    def text(self) -> str:
        """What a tool call returns: the output, or "error: KIND: detail" (with any output before it)."""
        if self.ok:
            return self.output
        head = f"error: {self.error}" if self.kind == "error" else f"error: sandbox {self.kind} limit: {self.error}"
        return f"{head}\n{self.output}" if self.output else head


@dataclass
class _Worker:
    proc: asyncio.subprocess.Process
    slot: int
    workdir: str
    calls: int = 0
    pid: int = 0              # the worker itself (PID 1 of its namespace, when there is one)
    buf: bytearray = field(default_factory=bytearray)


class SandboxSession:
    """One trajectory's sandbox: its own worker process, used by no one else, killed by close()."""

    def __init__(self, pool: "SandboxPool"):
        self.pool = pool
        self.worker: _Worker | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self._early: asyncio.Task | None = None

    def prestart(self) -> None:
        """Start this trajectory's sandbox now, in the background: its start overlaps the model's first turn."""
        if self._early is None and self.worker is None:
            self._early = asyncio.get_running_loop().create_task(self._acquire())

    async def _acquire(self) -> None:
        async with self._lock:
            if self.worker is None and not self._closed:
                self.worker = await self.pool._take()

    async def run(self, code: str) -> SandboxResult:
        if not isinstance(code, str):
            return SandboxResult("error", "", f"code must be a string, got {type(code).__name__}")
        async with self._lock:      # one snippet at a time: the worker reads one request after another
            if self._closed:
                raise RuntimeError("sandbox session is closed")
            if self.worker is None:
                self.worker = await self.pool._take()
            res, keep = await self.pool._call(self.worker, code)
            if not keep:
                self.worker = None
            return res

    async def close(self) -> None:
        self._closed = True
        if self._early is not None:
            with contextlib.suppress(Exception):  # a start that failed has nothing to release; run() said why
                await self._early
        w, self.worker = self.worker, None
        if w is not None:
            await self.pool._release(w)

    async def __aenter__(self) -> "SandboxSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def tool(self, name: str = "python") -> Tool:
        return self.pool._tool(name, self.run)


class SandboxPool:
    """Sandboxes for one rollout worker: `async with pool.session() as s: await s.run(code)` per trajectory;
    `await pool.run(code)` runs one snippet in a sandbox of its own."""

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        if self.cfg.isolation == "none":
            self.isolation = Isolation(notes=("sandbox.isolation=none",))
        else:
            jail.require_bwrap("sandbox.isolation")
            self.isolation = probe_isolation()
        self._spares: list[_Worker] = []
        self._all: dict[int, _Worker] = {}
        self._spawning: set[asyncio.Task] = set()     # background work: spares starting, workers being killed
        self._refills = 0                               # spares starting
        self._slots = asyncio.Semaphore(self.cfg.max_sandboxes)
        self._seq = 0
        self._root = tempfile.mkdtemp(prefix="loongsage-sandbox-")
        self.stats = {"calls": 0, "replaced": 0, "sandboxes": 0, "start_s": 0.0, **{k: 0 for k in BREACHES}}
        self._closed = False

    # ---- workers ------------------------------------------------------------------------
    def _next_slot(self) -> int:
        live = {w.slot % UID_SLOTS for w in self._all.values()}
        while True:
            self._seq += 1
            if self._seq % UID_SLOTS not in live:
                return self._seq

    def _command(self, setup: dict) -> tuple[list[str], tuple[int, ...]]:
        python = self.cfg.python or sys.executable
        if self.isolation.tool == "bwrap":
            fd = jail.seccomp_fd()
            argv = jail.code_argv(str(WORKER), python, self.cfg.tmp_mb << 20, fd, keep_setuid=setup["uid"] is not None)
            return [*argv, json.dumps(setup)], (() if fd is None else (fd,))
        return [python, "-I", str(WORKER), json.dumps(setup)], ()

    async def _spawn(self) -> _Worker:
        iso, slot = self.isolation, self._next_slot()
        uid = UID_BASE + (os.getpid() % 4096) * UID_SLOTS + slot % UID_SLOTS if iso.uid else None
        workdir = tempfile.mkdtemp(dir=self._root, prefix=f"w{slot}-")
        if uid is not None:
            os.chown(workdir, uid, uid)
        # RLIMIT_NPROC binds a worker with a uid of its own, or any non-root user; root it does not
        nproc = self.cfg.nproc if (uid is not None or os.geteuid() != 0) else 0
        jailed = iso.tool == "bwrap"    # bwrap mounts the private /tmp itself and starts the worker in it
        setup = {"preload": list(self.cfg.preload), "workdir": "/tmp" if jailed else workdir, "uid": uid,
                 "memory_mb": self.cfg.memory_mb, "file_mb": self.cfg.file_mb,
                 "nproc": nproc, "cpu_lifetime_s": self.cfg.cpu_s * self.cfg.calls_per_worker + 10}
        cmd, fds = self._command(setup)
        env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "HOME": "/tmp"}
        t0 = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                cwd=workdir, start_new_session=True, limit=2 ** 20, pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        w = _Worker(proc, slot, workdir)
        self._all[slot] = w
        try:
            await asyncio.wait_for(self._read_until(w, b"ready", cap=1 << 16), timeout=30)
        except Exception as e:
            tail = bytes(w.buf)[-500:].decode(errors="replace")
            await self._kill(w)
            raise RuntimeError(f"sandbox worker did not start ({type(e).__name__}: {e}): {tail}") from e
        w.pid = _child_of(proc.pid) if iso.pid else proc.pid
        self.stats["sandboxes"] += 1
        self.stats["start_s"] += time.perf_counter() - t0
        return w

    async def _read_until(self, w: _Worker, tag: bytes, cap: int) -> tuple[bytes, bytes]:
        """Output up to MARKER+tag, and the rest of that line. Raises OverflowError past `cap` bytes,
        EOFError if the worker exits first."""
        needle = MARKER + tag
        while True:
            i = w.buf.find(needle)
            if i >= 0:
                j = w.buf.find(b"\n", i)
                if j >= 0:
                    out, rest = bytes(w.buf[:i]), bytes(w.buf[i + len(needle):j])
                    del w.buf[:j + 1]
                    return out, rest
            if len(w.buf) > cap + len(needle) + 256:
                raise OverflowError(len(w.buf))
            chunk = await w.proc.stdout.read(65536)
            if not chunk:
                raise EOFError
            w.buf += chunk

    async def _kill(self, w: _Worker) -> None:
        """SIGKILL the worker, then its process group. The worker first: bwrap reaps it and exits; with a PID
        namespace, everything the snippet started dies with the namespace's PID 1."""
        self._all.pop(w.slot, None)
        for target, kill in ((w.pid, os.kill), (w.proc.pid, os.killpg)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if target:
                    kill(target, signal.SIGKILL)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(w.proc.wait(), timeout=5)
        shutil.rmtree(w.workdir, ignore_errors=True)

    def _background(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._spawning.add(t)
        t.add_done_callback(self._spawning.discard)
        return t

    async def _refill(self) -> None:
        """Keep `workers` spares started (in the background: a trajectory that takes one does not wait)."""
        try:
            w = await self._spawn()
        except RuntimeError as e:
            log.warning("sandbox spare did not start: %s", e)
            return
        finally:
            self._refills -= 1
        if self._closed:
            await self._kill(w)
        else:
            self._spares.append(w)

    async def _take(self) -> _Worker:
        """A sandbox for one session: a spare (never used) if one is ready, else a fresh start."""
        if self._closed:
            raise RuntimeError("sandbox pool is closed")
        await self._slots.acquire()
        try:
            w = self._spares.pop() if self._spares else await self._spawn_shielded()
        except BaseException:
            self._slots.release()
            raise
        for _ in range(self.cfg.workers - len(self._spares) - self._refills):
            self._refills += 1
            self._background(self._refill())
        return w

    async def _spawn_shielded(self) -> _Worker:
        """_spawn in a task of its own: a caller cancelled meanwhile (a tool timeout) gets its CancelledError
        at once -- Python < 3.12's wait_for can swallow a cancel that lands as the worker says "ready" -- and
        the worker it was starting, untouched by any code, becomes a spare."""
        t = self._background(self._spawn())
        try:
            return await asyncio.shield(t)
        except asyncio.CancelledError:
            t.add_done_callback(self._adopt)
            raise

    def _adopt(self, t: asyncio.Task) -> None:
        if t.cancelled() or t.exception() is not None:
            return
        if self._closed:
            self._background(self._kill(t.result()))
        else:
            self._spares.append(t.result())

    async def _release(self, w: _Worker) -> None:
        """A session is done with `w`: kill it (nothing of it serves anyone else)."""
        await self._kill(w)
        self._slots.release()

    # ---- calls --------------------------------------------------------------------------
    def session(self) -> SandboxSession:
        if self._closed:
            raise RuntimeError("sandbox pool is closed")
        return SandboxSession(self)

    async def run(self, code: str) -> SandboxResult:
        """One snippet in a sandbox of its own (started for it, killed after it)."""
        async with self.session() as s:
            return await s.run(code)

    async def _call(self, w: _Worker, code: str) -> tuple[SandboxResult, bool]:
        """Run `code` in `w`: (result, whether `w` may serve the session's next call). A worker that may not
        is already released (killed)."""
        self.stats["calls"] += 1
        t0, nonce = time.perf_counter(), secrets.token_hex(8)
        res, breach = None, True        # a cancelled call (the caller's own timeout) is a breach too
        try:
            w.proc.stdin.write(json.dumps({"code": code, "cpu_s": self.cfg.cpu_s, "nonce": nonce}).encode() + b"\n")
            await w.proc.stdin.drain()
            out, rest = await asyncio.wait_for(self._read_until(w, nonce.encode(), self.cfg.output_bytes),
                                               timeout=self.cfg.timeout_s)
            info = _result_line(rest)
            kind, output = info["kind"], out[: self.cfg.output_bytes].decode(errors="replace")
            if len(out) > self.cfg.output_bytes:
                kind, info["error"] = "output", f"more than {self.cfg.output_bytes} bytes of output"
            res = SandboxResult(kind, output, info["error"])
            breach = kind in BREACHES
        except asyncio.TimeoutError:
            res = SandboxResult("timeout", self._partial(w), f"still running after {self.cfg.timeout_s}s (killed)")
        except OverflowError:
            res = SandboxResult("output", self._partial(w), f"more than {self.cfg.output_bytes} bytes of output "
                                                            "(killed)")
        except (EOFError, ConnectionError):
            code_ = None
            with contextlib.suppress(asyncio.TimeoutError):
                code_ = await asyncio.wait_for(w.proc.wait(), timeout=2)
            kind = "cpu" if code_ in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU,
                                      128 + signal.SIGKILL) else "died"
            res = SandboxResult(kind, self._partial(w), f"worker exited ({_describe_exit(code_)})")
        finally:
            w.calls += 1
            keep = not breach and w.calls < self.cfg.calls_per_worker
            if not keep:
                if res is not None and res.kind in BREACHES:
                    self.stats[res.kind] += 1
                self.stats["replaced"] += 1
                self._background(self._release(w))     # not awaited: a cancelled caller must not skip it
                if res is not None:
                    res.replaced = True
        res.wall_s = time.perf_counter() - t0
        return res, keep

    def _partial(self, w: _Worker) -> str:
        out = bytes(w.buf[: self.cfg.output_bytes]).decode(errors="replace")
        w.buf.clear()
        return out

    async def close(self) -> None:
        """Kill every worker (and everything they started); remove their directories."""
        self._closed = True
        for t in list(self._spawning):
            with contextlib.suppress(Exception):  # closing: a failed start has nothing left to clean
                await t
        await asyncio.gather(*(self._kill(w) for w in list(self._all.values())))
        self._spares.clear()
        shutil.rmtree(self._root, ignore_errors=True)

    def tool(self, name: str = "python") -> Tool:
        """The `python` tool with a fresh sandbox per call; a trajectory uses `session().tool()` instead."""
        return self._tool(name, self.run)

    def _tool(self, name: str, run) -> Tool:
        """The `python` tool over `run` (a session's, or the pool's one-call run)."""
        async def python(code: str) -> str:
            return (await run(code)).text()

        return Tool(name=name, fn=python, description=(
            "Run a Python snippet in a sandbox and return its output (the value of a final expression is "
            "printed). Limits: " f"{self.cfg.cpu_s}s CPU, {self.cfg.timeout_s}s wall, {self.cfg.memory_mb} MB, "
            f"{self.cfg.output_bytes} bytes of output. {self.isolation.describe()}."),
            parameters={"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]})


def _result_line(rest: bytes) -> dict:
    """The worker's {"kind", "error"} after a snippet; a snippet that broke the worker's own json or print
    makes a line that is not one: that worker is no longer trusted (a breach, "died")."""
    with contextlib.suppress(ValueError):
        info = json.loads(rest)
        if isinstance(info, dict) and isinstance(info.get("kind"), str) and isinstance(info.get("error"), str) \
                and info["kind"] in ("ok", "error", *BREACHES):
            return info
    return {"kind": "died", "error": f"the worker's result line is garbled ({rest[:80]!r}): the snippet broke it"}


def _child_of(pid: int) -> int:
    """The one child of `pid` (bwrap's), or 0."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
    except OSError:
        return 0
    return int(kids[0]) if kids else 0


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    if code > 128 and code - 128 in signal.valid_signals():
        return f"status {code}: signal {signal.Signals(code - 128).name}"
    return f"status {code}"
