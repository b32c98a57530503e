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

`rollout.agent_preload: [anthropic]` (a `python SCRIPT.py ...` command only): the worker starts
one zygote process that imports those modules once and forks each trajectory's process from
it (stages/agentflow/zygote.py), so an agent does not pay its SDK import per trajectory
(`import anthropic` is ~2.5 s of CPU here). Everything above holds for a forked agent too.

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
import math
import os
import shlex
import signal
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TAIL_BYTES = 4096
# the anthropic SDK would send a token found here as `Authorization: Bearer` next to the run's
# x-api-key: a real credential of the user's must not reach the agent (or the proxy)
SHADOWED = ("ANTHROPIC_AUTH_TOKEN",)


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

    async def _start(self) -> str:
        import tempfile

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.proc is not None and self.proc.returncode is None:
                return os.path.join(self.dir, "z.sock")
            self.dir = tempfile.mkdtemp(prefix="loongsage-zygote-")
            path = os.path.join(self.dir, "z.sock")
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, str(Path(__file__).with_name("zygote.py")), path, *self.modules,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
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
            req = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
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
        return ForkedProcess(reply["pid"], sock, await _reader(out_r), await _reader(err_r))

    async def aclose(self) -> None:
        """Stop the zygote (agents it forked are their own sessions: their trajectories end them)."""
        import shutil

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


class SubprocessAgent:
    def __init__(self, cmd: str, preload: tuple[str, ...] = ()):
        self.cmd = cmd
        self.argv = resolve_command(cmd)
        self.zygote = None
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

    async def aclose(self) -> None:
        if self.zygote is not None:
            await self.zygote.aclose()

    async def run(self, ctx, sample: dict) -> None:
        async with ctx.openai_endpoint() as ep:
            env = {k: v for k, v in os.environ.items() if k not in SHADOWED}
            env |= agent_env(ep.base_url, ep.api_key, sample)
            if "seed" in ctx.sampling:
                env["LOONGSAGE_SEED"] = str(ctx.sampling["seed"])
            if self.zygote is not None:
                proc = await self.zygote.spawn(self.argv, env)
            else:
                proc = await asyncio.create_subprocess_exec(
                    *self.argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, start_new_session=True)   # own process group: killable as one
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
