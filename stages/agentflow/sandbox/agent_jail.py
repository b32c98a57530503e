"""The rollout worker's side of an agent jail (jail.py): `Jail.spawn` starts an agent in one (bwrap + jail_init.py,
in a cgroup of its own), `Zygote.spawn` forks it from the zygote (zygote.py) in the same namespaces; `end(proc)`
kills all that a trajectory's agent started."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile

from stages.agentflow.sandbox import jail

log = logging.getLogger(__name__)
MAX_REPLY = 1 << 16


class Link:
    """The worker's end of one jail's control socket (stages/agentflow/sandbox/jail_init.py, zygote.py): for each
    connection the agent opens, a socket that `connect()` made (the proxy's `Endpoint.connect`, bound to the
    trajectory's route); from a forked agent's supervisor, its pid (the kernel's credentials on its first
    message, in this process's PID namespace) and its exit status."""

    def __init__(self, connect):
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.ours.setblocking(False)
        self._fd = self.ours.fileno()
        self.connect = connect
        loop = asyncio.get_running_loop()
        self.pid, self.result = loop.create_future(), loop.create_future()
        self._task = asyncio.ensure_future(self._serve())

    async def _recv(self) -> tuple[bytes, int]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                msg, anc, _flags, _addr = self.ours.recvmsg(MAX_REPLY, socket.CMSG_SPACE(12))
                creds = [d for lvl, typ, d in anc if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS]
                return msg, int.from_bytes(creds[0][:4], sys.byteorder) if creds else 0
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_reader(self._fd, _set, ready)
                try:
                    await ready
                finally:
                    loop.remove_reader(self._fd)

    async def _serve(self) -> None:
        try:
            while msg_pid := await self._recv():
                msg, pid = msg_pid
                if not msg:
                    break
                if msg == b"c":
                    conn = await self.connect()
                    try:
                        socket.send_fds(self.ours, [b"c"], [conn.fileno()])
                    finally:
                        conn.close()
                elif msg == b"ready" and not self.pid.done():
                    self.pid.set_result(pid)
                elif not self.result.done():
                    self.result.set_result(json.loads(msg))
                    if not self.pid.done():     # it ended before it started: the error is in the result
                        self.pid.set_result(0)
        except (OSError, ValueError) as e:
            log.warning("agent jail link: %s", e)
        finally:
            for f in (self.pid, self.result):
                if not f.done():
                    f.set_result({"rc": 128 + signal.SIGKILL} if f is self.result else 0)

    def close(self) -> None:
        self._task.cancel()
        if self.ours.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self._fd)
        self.ours.close()
        self.theirs.close()


def _set(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Jail:
    """How each trajectory's agent is jailed (stages/agentflow/sandbox/jail.py): limits, HOME, binds, cgroups."""

    def __init__(self, cfg):
        self.home_template, self.binds = cfg.home, tuple(cfg.binds)
        self.tmp_bytes, self.procs, self.memory_bytes = cfg.tmp_mb << 20, cfg.procs, cfg.memory_mb << 20
        self.cgroups = not jail.Cgroup.available()
        self._root = tempfile.mkdtemp(prefix="loongsage-agent-homes-")    # 0700: only this user reads it

    def home(self) -> str | None:
        """A fresh HOME for one trajectory (a copy of the template), or None for an empty one in the jail."""
        if not self.home_template:
            return None
        d = tempfile.mkdtemp(dir=self._root)
        shutil.copytree(self.home_template, d, dirs_exist_ok=True, symlinks=True)
        return d

    def cgroup(self) -> jail.Cgroup | None:
        return jail.Cgroup(self.procs, self.memory_bytes) if self.cgroups else None

    async def spawn(self, argv: list[str], env: dict[str, str], port: int, connect, home: str | None):
        """The agent in a jail of its own: an asyncio Process (its `cgroup` and `link` attached)."""
        link, cg, fd = Link(connect), self.cgroup(), jail.seccomp_fd()
        cmd = jail.agent_argv(argv, port, link.theirs.fileno(), home, self.binds, self.tmp_bytes, fd)
        if cg is not None:   # join the cgroup before bwrap forks anything: all the jail's processes are in it
            cmd = ["/bin/sh", "-c", 'while [ "$1" != -- ]; do echo $$ >"$1" || exit 126; shift; done; shift; '
                   'exec "$@"', "sh", *cg.procs_files(), "--", *cmd]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True,
                pass_fds=(link.theirs.fileno(), *(() if fd is None else (fd,))))
        except BaseException:
            link.close()
            if cg is not None:
                cg.close()
            raise
        finally:
            if fd is not None:
                os.close(fd)
        link.theirs.close()
        proc.link, proc.cgroup = link, cg
        return proc

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)


class Zygote:
    """The worker's side of stages/agentflow/sandbox/zygote.py: start it once, fork agent processes from it."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = tuple(modules)
        self.proc = None
        self.ctl: socket.socket | None = None
        self._lock = asyncio.Lock()
        self.jail: Jail | None = None           # set by SubprocessAgent.configure: the zygote runs in it
        self.env: dict[str, str] = {}           # its environment (agent.env's names: what it imports may read)
        self.agent_argv: tuple[str, ...] = ()   # the command it forks (its script is bound into the jail)

    async def _start(self) -> None:
        async with self._lock:
            if self.proc is not None and self.proc.returncode is None:
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            fd = jail.seccomp_fd()
            j = self.jail
            argv = jail.zygote_argv(list(self.agent_argv), theirs.fileno(), fd, j.home_template or None, j.binds,
                                    j.tmp_bytes, self.modules)
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv, env=self.env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    pass_fds=(theirs.fileno(), *(() if fd is None else (fd,))))
            finally:
                theirs.close()
                if fd is not None:
                    os.close(fd)
            line = await self.proc.stdout.readline()
            if line.strip() != b"ready":
                err = (await self.proc.stderr.read()).decode(errors="replace").strip()
                await self.proc.wait()
                self.proc = None
                ours.close()
                raise ValueError(err or f"the agent zygote exited ({self.modules}) before it was ready")
            ours.setblocking(False)
            self.ctl = ours

    async def spawn(self, argv: list[str], env: dict[str, str], port: int, connect) -> "ForkedProcess":
        await self._start()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        link, cg = Link(connect), self.jail.cgroup()
        try:
            req = json.dumps({"argv": argv, "env": env, "port": port}).encode()
            socket.send_fds(self.ctl, [req], [null, out_w, err_w, link.theirs.fileno()])
            pid = await asyncio.wait_for(link.pid, timeout=60)
            if not pid:
                raise RuntimeError(f"the agent zygote did not start the agent: {link.result.result()}")
            if cg is not None:
                cg.add(pid)
            await asyncio.get_running_loop().sock_sendall(link.ours, b"go")
        except BaseException:
            link.close()
            if cg is not None:
                cg.close()
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
            link.theirs.close()
        return ForkedProcess(pid, link, cg, await _reader(out_r), await _reader(err_r))

    async def aclose(self) -> None:
        """Stop the zygote; the agents it forked die with its jail."""
        proc, self.proc = self.proc, None
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if proc is not None:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()


async def _reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader


class ForkedProcess:
    """An agent forked by the zygote (pid: its supervisor's), with asyncio.subprocess.Process's
    pid/stdout/stderr/wait; the exit status comes from its supervisor over its link."""

    def __init__(self, pid: int, link: Link, cgroup, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader):
        self.pid, self.link, self.cgroup, self.stdout, self.stderr = pid, link, cgroup, stdout, stderr
        self.returncode: int | None = None

    async def wait(self) -> int:
        if self.returncode is None:
            res = await self.link.result
            if "error" in res:
                raise RuntimeError(f"the agent zygote could not start the agent: {res['error']}")
            self.returncode = int(res["rc"])
        return self.returncode


def make_jail(cfg) -> Jail | None:
    """The jail agent.jail asks for (None for none); a ValueError where bwrap cannot jail here."""
    if cfg.jail == "none":
        return None
    jail.require(cfg)
    if jail.Cgroup.available():
        log.warning("agent jails have no cgroup here (%s): an agent's processes and memory are not bounded "
                    "(agent.procs, agent.memory_mb); its /tmp is", jail.Cgroup.available())
    return Jail(cfg)


def end(proc) -> None:
    """Kill every process of a trajectory's agent: its cgroup where it has one, its process group (spawned)
    or its supervisor (forked: its PID namespace dies with it)."""
    cg, link = getattr(proc, "cgroup", None), getattr(proc, "link", None)
    if cg is not None:
        cg.close()
        proc.cgroup = None
    if proc.pid > 0:       # killpg(0) would be our own group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            (os.kill if isinstance(proc, ForkedProcess) else os.killpg)(proc.pid, signal.SIGKILL)
    if link is not None:
        link.close()
