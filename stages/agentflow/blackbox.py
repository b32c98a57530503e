"""Black-box agents: programs that only speak a model API (OpenAI or Anthropic), run per trajectory.

Subprocess (`rollout.agent: "cmd:python examples/agents/addition.py"`): the command runs
once per trajectory with

    OPENAI_BASE_URL, OPENAI_API_KEY        this trajectory's proxy endpoint (.../v1) and key
    ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY  the same endpoint for the anthropic SDK: the base URL
                                           without the trailing /v1 (the SDK appends /v1/messages),
                                           the same key (sent as x-api-key)
    LOONGSAGE_SAMPLE                       the row as JSON (prompt, answer, data_source, ids)
    LOONGSAGE_SEED                         the trajectory's seed (from run.seed, its group and sample): an
                                           agent that draws random numbers seeds them with it to repeat a run

and ends by exiting. An agent written with either official SDK finds the proxy with no
configuration (`openai.OpenAI()`, `anthropic.Anthropic()`), and so does a harness that reads
only one of the two pairs (Codex, Claude Code). ANTHROPIC_AUTH_TOKEN is removed from the
agent's environment (the SDK would send it as a bearer token next to the run's key).

If its last stdout line is a JSON object with a numeric `reward` (and optionally `info`),
that reward is the trajectory's, used instead of reward.fn; a reward that is not a finite
number (NaN, Infinity) fails the row.
A non-zero exit, a crash or a hang past rollout.timeout_s fails the row with the stderr
tail; the agent runs in its own process group, which is killed when the trajectory ends,
so no agent process outlives its trajectory.

A leading `python`/`python3` in the command means this interpreter (sys.executable). A
relative script path that does not exist in the working directory is looked up in the
project root, so the shipped examples run from anywhere.

Jail (`rollout.agent_sandbox`, auto by default): where bubblewrap runs, each agent process runs
in a jail of its own (stages/agentflow/jail.py, `agent_argv`): its own PID namespace and /proc, so
no other trajectory's process -- nor its environment, with its key -- is there to see; the host's
file system read-only with /tmp, /run and the user's home behind private tmpfs; a fresh HOME
(`rollout.agent_home` copied into it: a harness's config); no capabilities, no_new_privs, seccomp.
It shares the host's network namespace: it reaches its endpoint on loopback, and the proxy
honours its key on that endpoint only. strict refuses to start without bwrap; none, or auto
without bwrap (with a warning), runs agents as the rollout worker's user, unjailed.

`rollout.agent_preload: [anthropic]` (a `python SCRIPT.py ...` command only): the worker starts
one zygote process that imports those modules once and forks each trajectory's process from
it (stages/agentflow/zygote.py), so an agent does not pay its SDK import per trajectory
(`import anthropic` is ~2.5 s of CPU here). Everything above holds for a forked agent too, but
the jail: the zygote runs in one jail, and the agents it forks share it (its PID namespace, /tmp
and HOME); each forked agent makes itself non-dumpable, so that its siblings (no capabilities,
ptrace denied) cannot read its environment or memory. `agent_sandbox: strict` refuses a preload.

In-process: decorate `fn(base_url, api_key, sample) -> dict | None` with `@openai_agent`
and set `rollout.agent: mypkg.mod:fn`. An `async def` fn shares the rollout's event loop
(use openai.AsyncOpenAI); a plain def runs in a thread. Returning {"reward": ...} works
like the subprocess's last line. `base_url` is the OpenAI form (.../v1); an in-process agent
on the anthropic SDK passes `anthropic_base_url(base_url)`:
`anthropic.AsyncAnthropic(base_url=anthropic_base_url(base_url), api_key=api_key)`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from stages.agentflow import jail

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TAIL_BYTES = 4096
# the anthropic SDK would send a token found here as `Authorization: Bearer` next to the run's
# x-api-key: a real credential of the user's must not reach the agent (or the proxy)
# (and the tool service's key, which runs code: an agent must not get it from the worker's environment)
SHADOWED = ("ANTHROPIC_AUTH_TOKEN", "LOONGSAGE_TOOL_SERVICE_KEY")
log = logging.getLogger(__name__)
_warned = False


class AgentExit(RuntimeError):
    """A black-box agent process exited non-zero (or was killed by a signal)."""


def resolve_command(cmd: str) -> list[str]:
    argv = shlex.split(cmd)
    if not argv:
        raise ValueError("rollout.agent 'cmd:' needs a command line after the colon")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    for i, a in enumerate(argv[1:], 1):
        if a.endswith(".py") and not os.path.isabs(a) and not os.path.exists(a) and (PROJECT_ROOT / a).exists():
            argv[i] = str(PROJECT_ROOT / a)
    exe = argv[0] if os.path.sep in argv[0] else _which(argv[0])
    if exe is None or not os.access(exe, os.X_OK):
        raise ValueError(f"agent command {cmd!r}: {argv[0]!r} is not an executable")
    scripts = [a for a in argv[1:] if a.endswith(".py")]
    if scripts and not os.path.exists(scripts[0]):
        raise ValueError(f"agent command {cmd!r}: script {scripts[0]} not found")
    return argv


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def anthropic_base_url(base_url: str) -> str:
    """The proxy endpoint as the anthropic SDK wants it: without the trailing /v1 it appends itself."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def agent_env(base_url: str, api_key: str, sample: dict) -> dict[str, str]:
    """The environment variables a subprocess agent gets (on top of the rollout worker's own)."""
    return {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
            "ANTHROPIC_BASE_URL": anthropic_base_url(base_url), "ANTHROPIC_API_KEY": api_key,
            "LOONGSAGE_SAMPLE": sample_json(sample)}


def sample_json(sample: dict) -> str:
    return json.dumps({k: v for k, v in sample.items() if isinstance(v, (str, int, float, bool)) or v is None})


def reported_reward(ctx, stdout: str) -> None:
    """Adopt {"reward": x, "info": {...}} from the agent's last stdout line, if it is one."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    try:
        last = json.loads(lines[-1]) if lines else None
    except ValueError:
        return
    if not isinstance(last, dict) or "reward" not in last:
        return
    if isinstance(last["reward"], bool) or not isinstance(last["reward"], (int, float)):
        raise ValueError(f"the agent reported a non-numeric reward: {last['reward']!r}")
    if not math.isfinite(last["reward"]):   # json reads NaN / Infinity (and 1e999 as inf); training must not
        raise ValueError(f"the agent reported a non-finite reward: {last['reward']!r}")
    ctx.reward = float(last["reward"])
    if isinstance(last.get("info"), dict):
        ctx.info.update(last["info"])


class _Tail:
    """Keeps the last TAIL_BYTES of a stream (an agent may print without bound)."""

    def __init__(self):
        self.data = b""

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.data = (self.data + chunk)[-TAIL_BYTES:]

    def text(self) -> str:
        return self.data.decode(errors="replace")


class Zygote:
    """The worker's side of stages/agentflow/zygote.py: start it once, fork agent processes from it."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = tuple(modules)
        self.proc = None
        self.dir = None
        self._lock = None
        self.jail: AgentJail | None = None     # set by SubprocessAgent.configure: the zygote runs in it
        self.agent_argv: tuple[str, ...] = ()  # the command it forks (its script is bound into the jail)

    async def _start(self) -> str:
        import tempfile

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.proc is not None and self.proc.returncode is None:
                return os.path.join(self.dir, "z.sock")
            self.dir = tempfile.mkdtemp(prefix="loongsage-zygote-")
            path = os.path.join(self.dir, "z.sock")
            argv = [sys.executable, str(Path(__file__).with_name("zygote.py")), path, *self.modules]
            fds: tuple[int, ...] = ()
            if self.jail is not None:   # its socket's directory is bound in: the worker connects from outside
                argv, fds = self.jail.wrap(argv, home=None, rw=(self.dir,), also=self.agent_argv)
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, pass_fds=fds)
            finally:
                for fd in fds:
                    os.close(fd)
            line = await self.proc.stdout.readline()
            if line.strip() != b"ready":
                err = (await self.proc.stderr.read()).decode(errors="replace").strip()
                await self.proc.wait()
                self.proc = None
                raise ValueError(err or f"the agent zygote exited ({self.modules}) before it was ready")
            return path

    async def spawn(self, argv: list[str], env: dict[str, str]) -> "ForkedProcess":
        import socket

        path = await self._start()
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, path)
            req = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "private": self.jail is not None}).encode()
            socket.send_fds(sock, [req], [null, out_w, err_w])
            reply = json.loads(await loop.sock_recv(sock, 65536) or b"{}")
        except BaseException:
            sock.close()
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        if "pid" not in reply:
            sock.close()
            for fd in (out_r, err_r):
                os.close(fd)
            raise RuntimeError(f"the agent zygote refused to fork: {reply.get('error', reply)}")
        pid = reply["pid"]
        if self.jail is not None:   # a pid in the jail's PID namespace: the worker kills its group by the host's
            pid = _host_pid(pid, self.proc.pid)
        return ForkedProcess(pid, sock, await _reader(out_r), await _reader(err_r))

    async def aclose(self) -> None:
        """Stop the zygote (agents it forked are their own sessions: their trajectories end them)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.returncode is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
            await proc.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _host_pid(inner: int, bwrap_pid: int) -> int:
    """The host pid of the process that is `inner` in the PID namespace of bwrap_pid's jail (NSpid in
    /proc/N/status lists a process's pid in each namespace, the host's first), or 0 if it is gone."""
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            ns = os.readlink(f"/proc/{int(f.read().split()[0])}/ns/pid")
    except (OSError, IndexError, ValueError) as e:
        raise RuntimeError(f"the agent zygote's jail is gone ({e})") from e
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{d}/ns/pid") != ns:
                continue
            with open(f"/proc/{d}/status") as f:
                nspid = next((ln.split()[1:] for ln in f if ln.startswith("NSpid:")), [])
        except OSError:
            continue
        if len(nspid) >= 2 and int(nspid[-1]) == inner:
            return int(d)
    return 0        # it has exited already (and been reaped): there is no group left to kill by its pid


async def _reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader


class ForkedProcess:
    """An agent process forked by the zygote, with asyncio.subprocess.Process's pid/stdout/stderr/wait."""

    def __init__(self, pid: int, sock, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None
        self._sock = sock

    async def wait(self) -> int:
        if self.returncode is None:
            try:
                reply = await asyncio.get_running_loop().sock_recv(self._sock, 65536)
                self.returncode = int(json.loads(reply)["rc"]) if reply else -signal.SIGKILL
            except (OSError, ValueError, KeyError):
                self.returncode = -signal.SIGKILL   # the zygote went away with it
            finally:
                self._sock.close()
        return self.returncode


class AgentJail:
    """How one trajectory's agent process is jailed (stages/agentflow/jail.py): `wrap(argv)` -> (argv, fds)."""

    def __init__(self, home_template: str = "", binds: tuple[str, ...] = ()):
        self.home_template, self.binds = home_template, tuple(binds)
        self._root = tempfile.mkdtemp(prefix="loongsage-agent-homes-")    # 0700: only this user reads it

    def home(self) -> str | None:
        """A fresh HOME for one trajectory (a copy of the template), or None for an empty one in the jail."""
        if not self.home_template:
            return None
        d = tempfile.mkdtemp(dir=self._root)
        shutil.copytree(self.home_template, d, dirs_exist_ok=True, symlinks=True)
        return d

    def wrap(self, argv: list[str], home: str | None, rw: tuple[str, ...] = (),
             also: tuple[str, ...] = ()) -> tuple[list[str], tuple[int, ...]]:
        fd = jail.seccomp_fd()
        cmd = jail.agent_argv(argv, os.getcwd(), home, self.binds, fd, rw=rw, also=also)
        return cmd, (() if fd is None else (fd,))

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)


def make_jail(mode: str, home_template: str = "", binds: tuple[str, ...] = ()) -> AgentJail | None:
    """The jail rollout.agent_sandbox asks for, or None (none; auto where bwrap does not run: with a warning)."""
    global _warned
    if mode == "none":
        return None
    why = jail.probe()
    if why and mode == "strict":
        raise ValueError(f"rollout.agent_sandbox=strict, but agents cannot be jailed here: {why}")
    if why:
        if not _warned:
            _warned = True
            log.warning("black-box agents run unjailed (%s): every agent process runs as this user and can read "
                        "other trajectories' keys from /proc/*/environ, the host's /tmp and sockets", why)
        return None
    return AgentJail(home_template, binds)


class SubprocessAgent:
    def __init__(self, cmd: str, preload: tuple[str, ...] = ()):
        self.cmd = cmd
        self.argv = resolve_command(cmd)
        self.zygote = None
        self.jail: AgentJail | None = None
        if preload:
            if self.argv[0] != sys.executable or len(self.argv) < 2 or not self.argv[1].endswith(".py"):
                raise ValueError(f"rollout.agent_preload needs a 'cmd:python SCRIPT.py ...' agent, got {cmd!r}")
            bad = [m for m in preload if not isinstance(m, str) or not all(p.isidentifier() for p in m.split("."))]
            if bad:
                raise ValueError(f"rollout.agent_preload: {bad[0]!r} is not a module name")
            import importlib.util

            for m in preload:
                try:
                    found = importlib.util.find_spec(m) is not None
                except (ImportError, ValueError):
                    found = False
                if not found:
                    raise ValueError(f"rollout.agent_preload: module {m!r} is not installed")
            self.zygote = Zygote(tuple(preload))

    def configure(self, rollout_cfg) -> None:
        """rollout.agent_sandbox / agent_home / agent_binds: the jail each agent process runs in."""
        mode = getattr(rollout_cfg, "agent_sandbox", "auto")
        if mode == "strict" and self.zygote is not None:
            raise ValueError("rollout.agent_sandbox=strict: agents forked by rollout.agent_preload's zygote share "
                             "its jail; leave agent_preload empty for a jail per trajectory")
        self.jail = make_jail(mode, getattr(rollout_cfg, "agent_home", ""), getattr(rollout_cfg, "agent_binds", ()))
        if self.zygote is not None:
            self.zygote.jail, self.zygote.agent_argv = self.jail, tuple(self.argv)

    async def aclose(self) -> None:
        if self.zygote is not None:
            await self.zygote.aclose()
        if self.jail is not None:
            self.jail.close()

    async def _start(self, env: dict[str, str], home: str | None):
        if self.zygote is not None:
            if self.jail is not None:
                env = env | {"HOME": jail.HOME_IN_JAIL, "TMPDIR": "/tmp"}
            return await self.zygote.spawn(self.argv, env)
        argv, fds = (self.argv, ()) if self.jail is None else self.jail.wrap(self.argv, home)
        try:
            return await asyncio.create_subprocess_exec(
                *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True, pass_fds=fds)   # own group: killable as one
        finally:
            for fd in fds:
                os.close(fd)

    async def run(self, ctx, sample: dict) -> None:
        home = self.jail.home() if self.jail is not None and self.zygote is None else None
        try:
            await self._run(ctx, sample, home)
        finally:
            if home:
                shutil.rmtree(home, ignore_errors=True)

    async def _run(self, ctx, sample: dict, home: str | None) -> None:
        async with ctx.openai_endpoint() as ep:
            env = {k: v for k, v in os.environ.items() if k not in SHADOWED}
            env |= agent_env(ep.base_url, ep.api_key, sample)
            if "seed" in ctx.sampling:
                env["LOONGSAGE_SEED"] = str(ctx.sampling["seed"])
            proc = await self._start(env, home)
            out, err = _Tail(), _Tail()
            readers = [asyncio.ensure_future(out.drain(proc.stdout)), asyncio.ensure_future(err.drain(proc.stderr))]
            try:
                rc = await proc.wait()
                _kill_group(proc.pid)  # children it left behind would hold the pipes open
                await asyncio.wait(readers, timeout=5)
            finally:
                ctx.detail = err.text()
                _kill_group(proc.pid)
                for r in readers:
                    r.cancel()
                if proc.returncode is None:
                    await proc.wait()
            if rc != 0:  # raised inside the endpoint: the exit, not "no model calls", is the error
                how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                raise AgentExit(f"agent {self.cmd!r} {how}")
        reported_reward(ctx, out.text())


def _kill_group(pgid: int) -> None:
    if pgid <= 0:       # killpg(0) would be our own group
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class OpenAIFunctionAgent:
    """An in-process black-box agent: a function given a base URL, a key and the sample."""

    def __init__(self, fn):
        self.fn = fn

    async def run(self, ctx, sample: dict) -> None:
        async with ctx.openai_endpoint() as ep:
            if asyncio.iscoroutinefunction(self.fn):
                res = await self.fn(ep.base_url, ep.api_key, sample)
            else:
                res = await asyncio.to_thread(self.fn, ep.base_url, ep.api_key, sample)
        if isinstance(res, dict) and "reward" in res:
            reported_reward(ctx, json.dumps(res))


def openai_agent(fn) -> OpenAIFunctionAgent:
    """Decorator: `@openai_agent def solve(base_url, api_key, sample): ...` is an Agent."""
    return OpenAIFunctionAgent(fn)
