"""A remote tool with real latency: an HTTP lookup service in its own process, and its client.

Why: real agent tools are remote services (search, retrieval, databases) whose answers take
wall time but cost the caller no CPU, with a long tail. An RL pipeline that waits on them idles;
one that overlaps them with generation does not. This service makes that wait real, on a laptop.

Server (`python -m stages.agentflow.sandbox.tool_service --port 0 --p50-s 0.2 --p99-s 1.5 --seed 0`):
    GET  /health                      -> {"ok": true}
    POST /lookup {"key": "37"}        -> {"key", "value", "latency_s"}   404 for an unknown key
    POST /run {"code": "37*48*29", "session": "S"}  -> {"kind", "output", "error", "text", "latency_s"}
    POST /close {"session": "S"}      -> {"closed": true|false}
/run is a remote code sandbox, as hosted sandboxes (E2B, Modal, Daytona) are to an agent: the
snippet runs in this process's SandboxPool (stages/agentflow/sandbox/pool.py, its limits from
--sandbox-json) after the drawn service time (the service's network, queueing and start-up).
A `session` (any id the client picks, one per trajectory) is a sandbox of that trajectory's own,
kept until /close (or SESSION_IDLE_S without a call); without one, the snippet gets a sandbox
of its own. /run and /close run code, so they take only requests that carry the service's key
(`Authorization: Bearer KEY`; 401 otherwise): the service reads it from the environment
variable LOONGSAGE_TOOL_SERVICE_KEY (never from its command line, which any local process can
read) and will not serve /run without one; `ToolService` makes a fresh key per service process.
The built-in corpus is number facts for the keys "0".."9999", so answers are exact and checkable.
Every request sleeps (wall time, no CPU) for a service time drawn, seeded, in arrival order, from a
lognormal with the configured median (p50_s) and 99th percentile (p99_s). `--error-rate` answers that
fraction of requests 500 (seeded too): a flaky service.

Default distribution: p50 0.2 s, p99 1.5 s (sigma 0.866), illustrative: the example search tool of "Tool
Latency Tail: Why p99 Reshapes Agent Architecture" (tianpan.co, 2026), in line with a 2 s p95 budget for
retrieval/read tools in "Latency Budgets for Agent Tool Calls" (exaclaw). Set your own tool's from its logs.

Client: `ToolServiceClient`; a service that is down, answers 5xx, or is too slow is a ToolServiceError,
which its tools turn into an "error: ..." observation or a ToolFatalError as tool_service.on_error says.
`ToolService(cfg)` starts and stops a local server process (what a recipe with url "" uses).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import time

from stages.agentflow.tools import Tool, ToolFatalError
from stages.keys import NONNEG, POSITIVE, UNIT, key, one_of, section

Z99 = 2.3263478740408408   # the standard normal's 99th percentile
KEY_ENV = "LOONGSAGE_TOOL_SERVICE_KEY"
SESSION_IDLE_S = 600.0     # a /run session not used for this long is closed (its client went away)


@section("tool_service")
class ToolServiceConfig:
    url: str = key("", '"" = start a local service process (ToolService) with the settings below')
    p50_s: float = key(0.2, "median service time (see the module docstring for where it comes from)", POSITIVE)
    p99_s: float = key(1.5, "99th percentile service time (>= p50_s)", POSITIVE)
    seed: int = key(0, "in a run: set from run.seed (pipeline/seeds.py), not a recipe key", NONNEG)
    error_rate: float = key(0.0, "fraction of requests the local service answers 500", UNIT)
    timeout_s: float = key(5.0, "seconds per call, on the client", POSITIVE)
    on_error: str = key("observe", 'observe: an "error: ..." observation | fail: the trajectory fails',
                                   one_of("observe", "fail"))

    def __post_init__(self):
        if not self.p99_s >= self.p50_s:
            raise ValueError(f"tool_service.p99_s must be >= p50_s ({self.p50_s}), got {self.p99_s}")


def lognormal(p50_s: float, p99_s: float, seed: int):
    """Seeded service times by median and 99th percentile: a function that draws the next."""
    rng, mu, sigma = random.Random(seed), math.log(p50_s), math.log(p99_s / p50_s) / Z99
    return lambda: rng.lognormvariate(mu, sigma)


def fact(key: str) -> dict | None:
    """The built-in corpus: facts about the integers 0..9999."""
    if not key.isdigit() or len(key) > 4:
        return None
    n = int(key)
    prime = n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))
    return {"square": n * n, "cube": n ** 3, "digit_sum": sum(map(int, key)), "prime": prime}


# ---- server -------------------------------------------------------------------------------
def make_app(p50_s: float, p99_s: float, seed: int, error_rate: float = 0.0, sandbox=None, key: str = ""):
    """`sandbox`: a SandboxConfig to serve /run with (a pool started on first use), or None; `key`: what /run
    and /close require (a service with a sandbox refuses to start without one)."""
    from aiohttp import web

    if sandbox is not None and not key:
        raise ValueError(f"the tool service's /run needs a key: set {KEY_ENV}")
    latency, errors = lognormal(p50_s, p99_s, seed), random.Random(seed + 1)
    pool = None
    sessions: dict[str, list] = {}     # id -> [SandboxSession, last use (monotonic)]

    def authorized(request) -> bool:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), key.encode())

    def unauthorized():
        return web.json_response({"error": "missing or wrong key: send Authorization: Bearer <key>"}, status=401)

    async def session_of(sid) -> object:
        """The sandbox session `sid` (made on first use), after closing those idle past SESSION_IDLE_S."""
        now = time.monotonic()
        for old in [k for k, (_, t) in sessions.items() if now - t > SESSION_IDLE_S]:
            await sessions.pop(old)[0].close()
        if sid not in sessions:
            sessions[sid] = [pool.session(), now]
        sessions[sid][1] = now
        return sessions[sid][0]

    async def health(_request):
        return web.json_response({"ok": True})

    async def lookup(request):
        wait = latency()
        failing = errors.random() < error_rate
        await asyncio.sleep(wait)           # the service's time: wall clock, no CPU
        if failing:
            return web.json_response({"error": "internal error (injected)"}, status=500)
        try:
            key = str((await request.json())["key"])
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'body must be JSON {"key": ...}'}, status=400)
        value = fact(key)
        if value is None:
            return web.json_response({"error": f"no entry for key {key!r}"}, status=404)
        return web.json_response({"key": key, "value": value, "latency_s": wait})

    async def run(request):
        nonlocal pool
        if not authorized(request):
            return unauthorized()
        wait = latency()
        failing = errors.random() < error_rate
        await asyncio.sleep(wait)
        if failing:
            return web.json_response({"error": "internal error (injected)"}, status=500)
        try:
            body = await request.json()
            code, sid = body["code"], body.get("session")
            if sid is not None and not isinstance(sid, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            return web.json_response({"error": 'body must be JSON {"code": ..., "session": "<id>"}'}, status=400)
        if pool is None:
            from stages.agentflow.sandbox.pool import SandboxPool

            pool = SandboxPool(sandbox)
        res = await (await session_of(sid)).run(code) if sid else await pool.run(code)
        return web.json_response({"kind": res.kind, "output": res.output, "error": res.error, "text": res.text(),
                                  "latency_s": wait})

    async def close(request):
        if not authorized(request):
            return unauthorized()
        try:
            sid = (await request.json())["session"]
            entry = sessions.pop(sid, None)
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'body must be JSON {"session": "<id>"}'}, status=400)
        if entry is not None:
            await entry[0].close()
        return web.json_response({"closed": entry is not None})

    async def close_pool(_app):
        if pool is not None:
            await pool.close()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/lookup", lookup)
    if sandbox is not None:
        app.router.add_post("/run", run)
        app.router.add_post("/close", close)
        app.on_cleanup.append(close_pool)
    return app


async def serve(host: str, port: int, **kw) -> None:
    from aiohttp import web

    runner = web.AppRunner(make_app(**kw), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"listening on http://{host}:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):     # a clean stop kills the sandbox workers too
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m stages.agentflow.sandbox.tool_service",
                                description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--p50-s", type=float, default=ToolServiceConfig.p50_s)
    p.add_argument("--p99-s", type=float, default=ToolServiceConfig.p99_s)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--sandbox-json", default="", help="serve POST /run with a SandboxPool of these settings "
                                                      "(JSON of stages.agentflow.sandbox.SandboxConfig fields)")
    a = p.parse_args(argv)
    ToolServiceConfig(p50_s=a.p50_s, p99_s=a.p99_s, error_rate=a.error_rate)    # same checks as the recipe's
    sandbox = None
    if a.sandbox_json:
        from stages.agentflow.sandbox.pool import SandboxConfig

        sandbox = SandboxConfig(**json.loads(a.sandbox_json))
        if not os.environ.get(KEY_ENV):
            p.error(f"--sandbox-json serves /run, which needs a key: set {KEY_ENV} (any secret string)")
    asyncio.run(serve(a.host, a.port, p50_s=a.p50_s, p99_s=a.p99_s, seed=a.seed, error_rate=a.error_rate,
                      sandbox=sandbox, key=os.environ.get(KEY_ENV, "")))


class ToolService:
    """A local service process: `url` once started; stop() ends it."""

    def __init__(self, cfg: ToolServiceConfig, sandbox=None):
        self.cfg, self.sandbox, self.proc, self.url = cfg, sandbox, None, ""
        self.key = secrets.token_urlsafe(24)    # what /run takes: this run's clients get it from here

    def start(self, timeout_s: float = 30.0) -> str:
        c = self.cfg
        # with a sandbox, it serves /run: a remote code sandbox with these limits
        extra = [] if self.sandbox is None else ["--sandbox-json", json.dumps(dataclasses.asdict(self.sandbox))]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stages.agentflow.sandbox.tool_service", "--p50-s", str(c.p50_s),
             "--p99-s", str(c.p99_s), "--seed", str(c.seed), "--error-rate", str(c.error_rate), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, KEY_ENV: self.key},
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        line = self.proc.stdout.readline()      # the server prints its address first
        if not line.startswith("listening on "):
            rest = line + (self.proc.stdout.read() if self.proc.poll() is not None else "")
            self.stop()
            raise RuntimeError(f"tool service did not start: {rest.strip()[-500:]}")
        self.url = line.split()[-1]
        return self.url

    def stop(self) -> None:
        """SIGTERM first (the service kills its sandbox workers), SIGKILL if it does not end."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None:
            self.proc.stdout.close()


# ---- client -------------------------------------------------------------------------------
class ToolServiceError(RuntimeError):
    pass


class ToolServiceClient:
    """`key`: the service's /run key (a local ToolService's .key); None = $LOONGSAGE_TOOL_SERVICE_KEY."""

    def __init__(self, url: str, cfg: ToolServiceConfig | None = None, key: str | None = None):
        self.url, self.cfg = url.rstrip("/"), cfg or ToolServiceConfig()
        self.key = os.environ.get(KEY_ENV, "") if key is None else key
        self._session = None
        self.stats = {"calls": 0, "errors": 0, "wait_s": 0.0}

    async def _http(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        return self._session

    async def lookup(self, key: str) -> dict:
        """The service's answer; ToolServiceError for down / 5xx / 4xx / too slow, naming which."""
        return await self._counted(self._post(key))

    async def run(self, code: str, session: str | None = None) -> dict:
        """A snippet run by the service's sandbox (/run), in `session`'s sandbox or a fresh one;
        ToolServiceError as for lookup."""
        return await self._counted(self._post(code, path="/run", field="code",
                                              extra={"session": session} if session else {}))

    async def _counted(self, call) -> dict:
        """`call`'s answer, counted in stats (calls, errors, wait_s)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.stats["calls"] += 1
        try:
            return await call
        except ToolServiceError:
            self.stats["errors"] += 1
            raise
        finally:
            self.stats["wait_s"] += loop.time() - t0

    async def _post(self, key: str, path: str = "/lookup", field: str = "key", extra: dict | None = None) -> dict:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        try:
            session = await self._http()
            async with session.post(f"{self.url}{path}", json={field: key, **(extra or {})}, headers=headers) as r:
                body = await r.text()
        except asyncio.TimeoutError as e:
            raise ToolServiceError(f"tool service {self.url} timed out after {self.cfg.timeout_s}s") from e
        except aiohttp.ClientError as e:
            raise ToolServiceError(f"tool service {self.url} unreachable: {type(e).__name__}: {e}") from e
        if r.status != 200:
            raise ToolServiceError(f"tool service {self.url} answered {r.status}: {_error_of(body)}")
        return json.loads(body)

    async def _text(self, call, text) -> str:
        """text(`call`'s answer); a ToolServiceError as on_error says: an observation or a ToolFatalError."""
        try:
            return text(await call)
        except ToolServiceError as e:
            if self.cfg.on_error == "fail":
                raise ToolFatalError(str(e)) from e
            return f"error: {e}"

    def tool(self, name: str = "lookup") -> Tool:
        async def lookup(key: str) -> str:
            return await self._text(self.lookup(str(key)), lambda r: json.dumps(r["value"], sort_keys=True))

        return Tool(name=name, fn=lookup, description="Look up facts about an integer 0..9999 (remote service).",
                    parameters={"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]})

    def session(self) -> "RemoteSandboxSession":
        """A sandbox of one trajectory's own on the service: its tool(), then close()."""
        return RemoteSandboxSession(self, secrets.token_urlsafe(12))

    def sandbox_tool(self, name: str = "python", session: str | None = None) -> Tool:
        """The remote sandbox as the `python` tool: the output text as a local pool's tool gives it."""
        async def python(code: str) -> str:
            return await self._text(self.run(str(code), session), lambda r: r["text"])

        return Tool(name=name, fn=python, description="Run a Python snippet in a remote sandbox service and "
                    "return its output.", parameters={"type": "object", "properties": {"code": {"type": "string"}},
                                                      "required": ["code"]})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class RemoteSandboxSession:
    """A trajectory's sandbox on the service (`session` in /run): closing it ends the sandbox there."""

    def __init__(self, client: ToolServiceClient, sid: str):
        self.client, self.id, self.used = client, sid, False

    def prestart(self) -> None:
        """The service starts a session's sandbox at its first /run."""

    def tool(self, name: str = "python") -> Tool:
        self.used = True
        return self.client.sandbox_tool(name, session=self.id)

    async def close(self) -> None:
        if self.used:
            # a service that is gone closed its sandboxes with it; an idle one closes them itself
            with contextlib.suppress(ToolServiceError):
                await self.client._post(self.id, path="/close", field="session")


def _error_of(body: str) -> str:
    try:
        return str(json.loads(body).get("error", body))[:200]
    except (ValueError, AttributeError):
        return body[:200]


if __name__ == "__main__":
    main()
