"""Black-box agents: programs that only speak a model API (OpenAI or Anthropic), run per trajectory.

Subprocess (`agent.name: "cmd:python examples/agents/addition.py"`): the command runs once per trajectory with an
allowlisted environment (`agent_env`), nothing else of the worker's (no user tokens or credentials): the
trajectory's endpoint and key as OPENAI_BASE_URL/OPENAI_API_KEY and as ANTHROPIC_BASE_URL/ANTHROPIC_API_KEY (less
the /v1 the anthropic SDK appends itself), so an agent on either official SDK, or a harness that reads one of the
pairs (Codex, Claude Code), finds the proxy with no configuration; LOONGSAGE_SAMPLE, the row as JSON, never its
answer; LOONGSAGE_SEED, the trajectory's seed, for an agent that draws random numbers to repeat a run.
The agent grades nothing: if its last stdout line is a JSON object, that is its report (`agent_info`), for
reward.fn, which holds the answer, to grade (examples/agents/rewards.py); a `reward` in it is not the trajectory's
(a policy could make a harness print one). A non-zero exit, a crash or a hang past agent.timeout_s fails the row
with the stderr tail; when the trajectory ends every process it started is killed. A leading `python`/`python3`
means this interpreter; a relative script path is looked up in the working directory, then in the project root,
so the shipped examples run from anywhere.

Each agent runs in a bubblewrap jail of its own (`agent.jail`), forked, where `agent.preload` names modules, from a
zygote that imported them once per worker: what the jail allows and bounds is in docs/sandbox.md.

In-process: decorate `fn(base_url, api_key, sample) -> dict | None` with `@openai_agent` and set
`agent.name: mypkg.mod:fn`. An `async def` fn shares the rollout's event loop (use openai.AsyncOpenAI); a plain def
runs in a thread. It is the user's own code in the worker, not jailed, and gets the whole row; returning
{"reward": ...} sets the reward. `base_url` is the OpenAI form (.../v1); on the anthropic SDK, pass
`anthropic_base_url(base_url)`.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

from stages.agentflow.config import AgentConfig
from stages.agentflow.protocol import loads
from stages.agentflow.sandbox import jail
from stages.agentflow.sandbox.agent_jail import Jail, Zygote, end, make_jail

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TAIL_BYTES = 4096
PASSED_ENV = ("PATH", "LANG", "LANGUAGE", "TERM", "TZ")     # and LC_*: nothing that could be a secret
HIDDEN_FIELDS = ("answer",)                                # a row's fields an agent never gets


class AgentExit(RuntimeError):
    """A black-box agent process exited non-zero (or was killed by a signal)."""


def resolve_command(cmd: str) -> list[str]:
    argv = shlex.split(cmd)
    if not argv:
        raise ValueError("agent.name 'cmd:' needs a command line after the colon")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    for i, a in enumerate(argv[1:], 1):
        if a.endswith(".py") and not os.path.isabs(a):
            argv[i] = os.path.abspath(a) if os.path.exists(a) else str(PROJECT_ROOT / a)
    exe = argv[0] if os.path.sep in argv[0] else shutil.which(argv[0])
    if exe is None or not os.access(exe, os.X_OK):
        raise ValueError(f"agent command {cmd!r}: {argv[0]!r} is not an executable")
    scripts = [a for a in argv[1:] if a.endswith(".py")]
    if scripts and not os.path.exists(scripts[0]):
        raise ValueError(f"agent command {cmd!r}: script {scripts[0]} not found")
    return argv


def anthropic_base_url(base_url: str) -> str:
    """The proxy endpoint as the anthropic SDK wants it: without the trailing /v1 it appends itself."""
    return base_url.rstrip("/").removesuffix("/v1")


def base_env(names: tuple[str, ...] = ()) -> dict[str, str]:
    """An allowlist of the worker's environment, and agent.env's NAME or NAME=VALUE."""
    env = {k: v for k, v in os.environ.items() if k in PASSED_ENV or k.startswith("LC_")}
    for item in names:
        name, eq, value = item.partition("=")
        if eq:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
    return env


def agent_env(base_url: str, api_key: str, sample: dict, names: tuple[str, ...] = ()) -> dict[str, str]:
    """A subprocess agent's whole environment: an allowlist, never the worker's environment."""
    shown = {k: v for k, v in sample.items()
             if k not in HIDDEN_FIELDS and (v is None or isinstance(v, (str, int, float, bool)))}
    return base_env(names) | {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
                  "ANTHROPIC_BASE_URL": anthropic_base_url(base_url), "ANTHROPIC_API_KEY": api_key,
                  "LOONGSAGE_SAMPLE": json.dumps(shown)}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


async def _drain(stream: asyncio.StreamReader, tail: bytearray) -> None:
    """Keep the last TAIL_BYTES of a stream in `tail` (an agent may print without bound)."""
    while chunk := await stream.read(65536):
        tail[:] = (tail + chunk)[-TAIL_BYTES:]


class SubprocessAgent:
    def __init__(self, cmd: str, preload: tuple[str, ...] = ()):
        self.cmd = cmd
        self.argv = resolve_command(cmd)
        self.zygote = None
        self.jail: Jail | None = None
        self.env_names: tuple[str, ...] = ()
        self._running: asyncio.Semaphore | None = None
        self.limit: int | None = None       # agents alive at once: set by configure
        if preload:
            if self.argv[0] != sys.executable or len(self.argv) < 2 or not self.argv[1].endswith(".py"):
                raise ValueError(f"agent.preload needs a 'cmd:python SCRIPT.py ...' agent, got {cmd!r}")
            bad = [m for m in preload if not isinstance(m, str) or not all(p.isidentifier() for p in m.split("."))]
            if bad:
                raise ValueError(f"agent.preload: {bad[0]!r} is not a module name")
            missing = next((m for m in preload if not _installed(m)), None)
            if missing is not None:
                raise ValueError(f"agent.preload: module {missing!r} is not installed")
            self.zygote = Zygote(tuple(preload))

    def configure(self, agent=None, *_) -> None:
        """The agent section (None: its defaults): the jail each agent process runs in, its environment."""
        cfg = agent or AgentConfig()
        if self.jail is not None:
            self.jail.close()
        self.jail = make_jail(cfg)
        self.env_names = tuple(cfg.env)
        self.limit = cfg.max_agents or AGENTS_AT_ONCE
        if self.zygote is not None:
            if self.jail is None:
                raise ValueError("agent.preload needs the agent jail (agent.jail=bwrap): its "
                                 "zygote builds each agent's namespaces")
            self.zygote.jail, self.zygote.agent_argv = self.jail, tuple(self.argv)
            self.zygote.env = base_env(self.env_names)

    async def aclose(self) -> None:
        if self.zygote is not None:
            await self.zygote.aclose()
        if self.jail is not None:
            self.jail.close()

    async def _start(self, ep, env: dict[str, str], home: str | None):
        port = urlsplit(ep.base_url).port
        if self.zygote is not None:
            return await self.zygote.spawn(self.argv, env | {"HOME": jail.HOME_IN_JAIL, "TMPDIR": "/tmp"}, port,
                                           ep.connect)
        if self.jail is not None:
            return await self.jail.spawn(self.argv, env, port, ep.connect, home)
        return await asyncio.create_subprocess_exec(
            *self.argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)   # own group: killable as one

    async def run(self, ctx, sample: dict) -> None:
        if self.limit is None:
            self.configure(None)
        self._running = self._running or asyncio.Semaphore(self.limit)
        async with self._running:
            home = self.jail.home() if self.jail is not None and self.zygote is None else None
            try:
                await self._run(ctx, sample, home)
            finally:
                if home:
                    shutil.rmtree(home, ignore_errors=True)

    async def _run(self, ctx, sample: dict, home: str | None) -> None:
        async with ctx.openai_endpoint() as ep:
            env = agent_env(ep.base_url, ep.api_key, sample, self.env_names)
            if "seed" in ctx.sampling:
                env["LOONGSAGE_SEED"] = str(ctx.sampling["seed"])
            proc = await self._start(ep, env, home)
            out, err = bytearray(), bytearray()
            readers = [asyncio.ensure_future(_drain(proc.stdout, out)), asyncio.ensure_future(_drain(proc.stderr, err))]
            try:
                rc = await proc.wait()
                oom = proc.cgroup.oom_kills() if getattr(proc, "cgroup", None) is not None else 0
                end(proc)      # what it left behind would hold the pipes open
                await asyncio.wait(readers, timeout=5)
            finally:
                ctx.detail = err.decode(errors="replace")
                end(proc)
                for r in readers:
                    r.cancel()
                if isinstance(proc, asyncio.subprocess.Process) and proc.returncode is None:
                    await proc.wait()
            if self.jail is not None and rc > 128:    # a jail reports a killed agent as a shell does
                rc = 128 - rc
            if rc != 0:  # raised inside the endpoint: the exit, not "no model calls", is the error
                how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                why = " at its memory limit (agent.memory_mb)" if oom else ""
                raise AgentExit(f"agent {self.cmd!r} {how}{why}")
        stdout = out.decode(errors="replace").strip()
        last = loads(stdout.splitlines()[-1], None) if stdout else None
        ctx.info.update(last if isinstance(last, dict) else {})


AGENTS_AT_ONCE = 16     # cmd: agents alive at once per worker when agent.max_agents is 0


class OpenAIFunctionAgent:
    """An in-process black-box agent, `@openai_agent def solve(base_url, api_key, sample)` (the module's docstring)."""

    def __init__(self, fn):
        self.fn = fn

    async def run(self, ctx, sample: dict) -> None:
        async with ctx.openai_endpoint() as ep:
            args = (ep.base_url, ep.api_key, sample)
            res = await (self.fn(*args) if asyncio.iscoroutinefunction(self.fn) else asyncio.to_thread(self.fn, *args))
        if not isinstance(res, dict) or "reward" not in res:    # trusted code: its reward is the trajectory's
            return
        if isinstance(res["reward"], bool) or not isinstance(res["reward"], (int, float)):
            raise ValueError(f"the agent reported a non-numeric reward: {res['reward']!r}")
        if not math.isfinite(res["reward"]):   # NaN / Infinity (json reads 1e999 as inf); training must not
            raise ValueError(f"the agent reported a non-finite reward: {res['reward']!r}")
        ctx.reward = float(res["reward"])
        if isinstance(res.get("info"), dict):
            ctx.info.update(res["info"])


openai_agent = OpenAIFunctionAgent
