"""Code sandbox tool: model-written Python snippets run in a pool of persistent worker processes.

Why: an agent that computes by writing code needs somewhere to run it that a bad snippet cannot
take down -- not the rollout worker, not the machine. Each snippet runs in one of
`sandbox.workers` long-lived processes (stages/agentflow/sandbox_worker.py; starting Python per
call would cost more than most snippets), under limits:

    cpu_s        CPU seconds per snippet (RLIMIT_CPU soft limit, moved up per call)
    memory_mb    address space of the worker (RLIMIT_AS): a 10 GB allocation is a MemoryError
    timeout_s    wall clock per snippet, enforced here: the worker is killed
    output_bytes stdout+stderr per snippet, counted here as it arrives: past it the worker is killed
    nproc        processes+threads of the worker's own uid (RLIMIT_NPROC): a fork bomb stops there
    file_mb      largest file it may write (RLIMIT_FSIZE)

and, where this machine allows it (`probe_isolation()` finds out once per process):

    network      `unshare --net`: a fresh network namespace with only a downed loopback
    pid          `unshare --pid --fork --kill-child`: the worker is PID 1 of its own namespace,
                 so killing it kills everything it started; without it the pool kills its
                 process group (a snippet that calls setsid() escapes that)
    private_tmp  `unshare --mount`: tmpfs over /tmp, /var/tmp, /dev/shm, /run/lock, cwd = /tmp;
                 without it cwd is a private directory but /tmp is the host's
    uid          running as root: the worker drops to a uid of its own (no writes to the
                 project's or the system's files; RLIMIT_NPROC means something -- it does not
                 bind root)

`SandboxPool.isolation` says which of these hold; anything else (the file system is readable,
CPU time other processes could use, the kernel itself) is not isolated.

A breach (timeout, cpu, memory, output, fork, filesystem, or the worker dying) ends the call
with an "error: <kind>: ..." result and the worker is killed and replaced, so the next call
gets a fresh one; an ordinary exception in the snippet ("error: error: ZeroDivisionError...")
leaves the worker in service. Every call starts in fresh globals in an emptied directory.
`pool.tool()` is the registry entry (stages/agentflow/tools.py): `python(code=...)`.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from pipeline.keys import NONNEG, POSITIVE, key, one_of
from stages.agentflow.tools import Tool

WORKER = Path(__file__).with_name("sandbox_worker.py")
MARKER = b"\x00\x1esandbox-end:"
BREACHES = ("timeout", "cpu", "memory", "output", "fork", "filesystem", "died")
# stdlib a snippet may want; imported before the worker drops its uid, which may leave it unable to
# read the interpreter's own files (socket is here so that the network namespace is what stops it)
PRELOAD = ("math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools", "collections",
           "re", "json", "string", "random", "datetime", "heapq", "bisect", "operator", "socket", "encodings.idna")
UID_BASE = 610_000          # worker uids: UID_BASE + (pid % 4096) * 16 + slot, unused by anything else here


@dataclass(frozen=True)
class SandboxConfig:
    workers: int = key(2, "persistent sandbox processes per rollout worker", POSITIVE)
    cpu_s: float = key(2.0, "CPU seconds per snippet", POSITIVE)
    timeout_s: float = key(5.0, "wall seconds per snippet (the worker is killed past it)", POSITIVE)
    memory_mb: int = key(512, "address space of a worker, MiB", POSITIVE)
    output_bytes: int = key(4096, "stdout + stderr per snippet", POSITIVE)
    nproc: int = key(8, "processes + threads of the worker's uid (binds only when it has its own uid; 0 = no limit)",
                        NONNEG)
    file_mb: int = key(16, "largest file a snippet may write, MiB", POSITIVE)
    tmp_mb: int = key(32, "size of each private tmpfs, MiB", POSITIVE)
    calls_per_worker: int = key(1000, "a worker is replaced after this many calls (its lifetime CPU budget)", POSITIVE)
    isolation: str = key("auto", "auto: whatever this machine allows | strict: refuse to start without network, pid, "
                                 "private_tmp and uid isolation | none: limits only", one_of("auto", "strict", "none"))
    python: str = key("", 'interpreter for the workers; "" = this one')
    preload: tuple = key(PRELOAD, "modules imported before the uid drop (see sandbox_worker.setup)")
    remote: bool = key(False, "True: snippets run in a remote sandbox service (rollout.tool_service: a local service "
                              'process per rollout worker when its url is ""), with its latency')

    def __post_init__(self):
        for k in ("workers", "memory_mb", "output_bytes", "file_mb", "tmp_mb", "calls_per_worker"):
            if getattr(self, k) <= 0:
                raise ValueError(f"sandbox.{k} must be > 0, got {getattr(self, k)}")
        for k in ("cpu_s", "timeout_s"):
            if not getattr(self, k) > 0:
                raise ValueError(f"sandbox.{k} must be > 0, got {getattr(self, k)}")
        if self.nproc < 0:
            raise ValueError(f"sandbox.nproc must be >= 0 (0 = no limit), got {self.nproc}")
        object.__setattr__(self, "preload", (self.preload,) if isinstance(self.preload, str) else tuple(self.preload))
        if self.isolation not in ("auto", "strict", "none"):
            raise ValueError(f"sandbox.isolation must be auto, strict or none, got {self.isolation!r}")


@dataclass(frozen=True)
class Isolation:
    network: bool = False
    pid: bool = False
    private_tmp: bool = False
    uid: bool = False
    notes: tuple = ()

    def describe(self) -> str:
        held = [k for k in ("network", "pid", "private_tmp", "uid") if getattr(self, k)]
        return f"isolated: {', '.join(held) or 'nothing but rlimits'}" + (f"; {'; '.join(self.notes)}"
                                                                         if self.notes else "")


UNSHARE = ("unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc")


@lru_cache(maxsize=1)
def probe_isolation() -> Isolation:
    """What this machine lets a sandbox have: tries the unshare command once, as the workers run it."""
    notes = []
    root = os.geteuid() == 0
    if not root:
        notes.append("not root: the workers run as this user (RLIMIT_NPROC counts all of its processes; "
                     "files it can write, a snippet can write)")
    ok = False
    if shutil.which("unshare"):
        try:
            r = subprocess.run([*UNSHARE, sys.executable, "-I", "-c",
                                "import socket,os; s=socket.socket(); s.settimeout(0.5)\n"
                                "try: s.connect(('1.1.1.1', 53)); print('net')\n"
                                "except OSError: print(os.getpid())"],
                               capture_output=True, text=True, timeout=20)
            ok = r.returncode == 0 and r.stdout.strip() == "1"
            if not ok:
                notes.append(f"unshare fails here ({(r.stderr or r.stdout).strip()[-200:]})")
        except (OSError, subprocess.TimeoutExpired) as e:
            notes.append(f"unshare fails here ({e})")
    else:
        notes.append("no unshare command")
    if not ok:
        notes.append("no network, PID or mount namespace: snippets reach the network and the host's /tmp")
    # tmpfs mounts in the new mount namespace need CAP_SYS_ADMIN there: root, as unshare runs without -U
    return Isolation(network=ok, pid=ok, private_tmp=ok and root, uid=root, notes=tuple(notes))


@dataclass
class SandboxResult:
    kind: str                 # ok | error | one of BREACHES
    output: str
    error: str = ""
    wall_s: float = 0.0
    replaced: bool = False    # the worker was killed and a fresh one started

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
    pgid: int = 0
    pid: int = 0              # the worker itself (unshare's child, PID 1 of its namespace, when there is one)
    buf: bytearray = field(default_factory=bytearray)


class SandboxPool:
    """`await pool.run(code)` -> SandboxResult. Workers start on first use (on the running loop)."""

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        self.isolation = Isolation(notes=("sandbox.isolation=none",)) if self.cfg.isolation == "none" \
            else probe_isolation()
        if self.cfg.isolation == "strict" and not all(
                (self.isolation.network, self.isolation.pid, self.isolation.private_tmp, self.isolation.uid)):
            raise RuntimeError(f"sandbox.isolation=strict, but this machine gives only: {self.isolation.describe()}")
        self._idle: asyncio.Queue | None = None
        self._all: dict[int, _Worker] = {}
        self._spawning: set[asyncio.Task] = set()
        self._root = tempfile.mkdtemp(prefix="loongsage-sandbox-")
        self.stats = {"calls": 0, "replaced": 0, **{k: 0 for k in BREACHES}}
        self._closed = False

    # ---- workers ------------------------------------------------------------------------
    async def _spawn(self, slot: int) -> _Worker:
        iso = self.isolation
        uid = UID_BASE + (os.getpid() % 4096) * 16 + slot if iso.uid else None
        workdir = tempfile.mkdtemp(dir=self._root, prefix=f"w{slot}-")
        if uid is not None:
            os.chown(workdir, uid, uid)
        # RLIMIT_NPROC binds a worker with a uid of its own, or any non-root user; root it does not
        nproc = self.cfg.nproc if (uid is not None or os.geteuid() != 0) else 0
        setup = {"preload": list(self.cfg.preload), "private_tmp": iso.private_tmp, "tmp_mb": self.cfg.tmp_mb,
                 "workdir": workdir, "uid": uid, "memory_mb": self.cfg.memory_mb, "file_mb": self.cfg.file_mb,
                 "nproc": nproc, "cpu_lifetime_s": self.cfg.cpu_s * self.cfg.calls_per_worker + 10}
        cmd = [self.cfg.python or sys.executable, "-I", str(WORKER), json.dumps(setup)]
        if iso.pid:
            cmd = [*UNSHARE, *cmd]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "HOME": "/tmp"}
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            cwd=workdir, start_new_session=True, limit=2 ** 20)
        w = _Worker(proc, slot, workdir, pgid=proc.pid)
        try:
            await asyncio.wait_for(self._read_until(w, b"ready", cap=1 << 16), timeout=30)
        except Exception as e:
            tail = bytes(w.buf)[-500:].decode(errors="replace")
            await self._kill(w)
            raise RuntimeError(f"sandbox worker did not start ({type(e).__name__}: {e}): {tail}") from e
        w.pid = _child_of(proc.pid) if iso.pid else proc.pid
        self._all[slot] = w
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
        """SIGKILL the worker, then its process group. The worker first: unshare reaps it and exits (had
        unshare died first, the worker would be reaped later by whoever adopts it); with a PID
        namespace, everything the snippet started dies with the namespace's PID 1."""
        self._all.pop(w.slot, None)
        for target, kill in ((w.pid, os.kill), (w.pgid, os.killpg)):
            try:
                if target:
                    kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                await asyncio.wait_for(w.proc.wait(), timeout=5)
            except asyncio.TimeoutError:
                pass
        shutil.rmtree(w.workdir, ignore_errors=True)

    def _replace(self, w: _Worker) -> None:
        """Kill `w` and start its successor in the background; the successor joins the idle queue."""
        self.stats["replaced"] += 1

        async def go():
            await self._kill(w)
            if not self._closed:
                self._idle.put_nowait(await self._spawn(w.slot))

        t = asyncio.get_running_loop().create_task(go())
        self._spawning.add(t)
        t.add_done_callback(self._spawning.discard)

    async def start(self) -> None:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for w in await asyncio.gather(*(self._spawn(i) for i in range(self.cfg.workers))):
                self._idle.put_nowait(w)

    # ---- calls --------------------------------------------------------------------------
    async def run(self, code: str) -> SandboxResult:
        if self._closed:
            raise RuntimeError("sandbox pool is closed")
        await self.start()
        if not isinstance(code, str):
            return SandboxResult("error", "", f"code must be a string, got {type(code).__name__}")
        w = await self._idle.get()
        self.stats["calls"] += 1
        t0, nonce = time.perf_counter(), secrets.token_hex(8)
        res, breach = None, True        # a cancelled call (the caller's own timeout) is a breach too
        try:
            w.proc.stdin.write(json.dumps({"code": code, "cpu_s": self.cfg.cpu_s, "nonce": nonce}).encode() + b"\n")
            await w.proc.stdin.drain()
            out, rest = await asyncio.wait_for(self._read_until(w, nonce.encode(), self.cfg.output_bytes),
                                               timeout=self.cfg.timeout_s)
            info = json.loads(rest)
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
        except (EOFError, ConnectionError, BrokenPipeError):
            code_ = await self._exit_code(w)
            kind = "cpu" if code_ in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU,
                                      128 + signal.SIGKILL) else "died"
            res = SandboxResult(kind, self._partial(w), f"worker exited ({_describe_exit(code_)})")
        finally:
            w.calls += 1
            if breach or w.calls >= self.cfg.calls_per_worker:
                if res is not None and res.kind in BREACHES:
                    self.stats[res.kind] += 1
                self._replace(w)
                if res is not None:
                    res.replaced = True
            else:
                self._idle.put_nowait(w)
        res.wall_s = time.perf_counter() - t0
        return res

    def _partial(self, w: _Worker) -> str:
        out = bytes(w.buf[: self.cfg.output_bytes]).decode(errors="replace")
        w.buf.clear()
        return out

    async def _exit_code(self, w: _Worker) -> int | None:
        try:
            return await asyncio.wait_for(w.proc.wait(), timeout=2)
        except asyncio.TimeoutError:
            return None

    async def close(self) -> None:
        """Kill every worker (and everything they started); remove their directories."""
        self._closed = True
        for t in list(self._spawning):
            try:
                await t
            except Exception:  # noqa: BLE001 - closing: a failed respawn has nothing left to clean
                pass
        await asyncio.gather(*(self._kill(w) for w in list(self._all.values())))
        shutil.rmtree(self._root, ignore_errors=True)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._all.values()]

    def tool(self, name: str = "python") -> Tool:
        async def python(code: str) -> str:
            return (await self.run(code)).text()

        return Tool(name=name, fn=python, description=(
            "Run a Python snippet in a sandbox and return its output (the value of a final expression is "
            "printed). Limits: " f"{self.cfg.cpu_s}s CPU, {self.cfg.timeout_s}s wall, {self.cfg.memory_mb} MB, "
            f"{self.cfg.output_bytes} bytes of output. {self.isolation.describe()}."),
            parameters={"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]})


def _child_of(pid: int) -> int:
    """The one child of `pid` (unshare --fork's), or 0."""
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
