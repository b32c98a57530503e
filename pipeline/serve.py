"""`loongsage serve MODEL_OR_CHECKPOINT`: a model behind the recording proxy, outside training, at one URL and
key (docs/harnesses-running.md). Every call is recorded, owner-only, as a run records: DIR/rollouts, one step per
trajectory (what was served between two rotations: SIGUSR1 or `Server.rotate()`), which `loongsage replay` trains.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import sys
import threading
import time
from pathlib import Path

from pipeline.config import ConfigError, dump_yaml, load_config
from pipeline.rundir import RunDirError, locked, previous_run

ROUTE = "serve"                 # the endpoint's fixed path segment: one URL for a whole serve session
KEY_ENV = "LOONGSAGE_SERVE_KEY"
SERVE_DEFAULTS = ("rollout.n_samples=1", "batcher.groups_per_step=1", "sampling.max_new_tokens=1024",
                  "agent.max_turns=0")


def _logged_proxy(*args, on_request, **kwargs):
    """The proxy with one line per request through `on_request` (its status is what a harness saw)."""
    from aiohttp import web

    from stages.agentflow.proxy import Proxy

    class LoggedProxy(Proxy):
        @web.middleware
        async def _guard(self, request: web.Request, handler):
            t0 = time.perf_counter()
            resp = await super()._guard(request, handler)
            path = request.path.split(f"/t/{request.match_info.get('route', '')}", 1)[-1]
            on_request({"t": time.time(), "method": request.method, "path": path, "status": resp.status,
                        "ms": round((time.perf_counter() - t0) * 1e3, 3),
                        "kind": request.headers.get("x-loongsage-request-kind", ""),
                        "user_agent": request.headers.get("User-Agent", "")})
            return resp

    return LoggedProxy(*args, **kwargs)


class EngineLog:
    """The engine client with every call's rows kept: what the engine returned, to check recordings against."""

    def __init__(self, client):
        self._client, self.calls = client, []

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def generate(self, requests: list[dict]) -> list[dict]:
        out = await self._client.generate(requests)
        self.calls += [{"prompt_ids": list(r["prompt_ids"]), "response_ids": list(o["response_ids"])}
                       for r, o in zip(requests, out)]
        return out


class Server:
    """Engines + proxy on a background event loop; `rotate()` records the trajectory served so far."""

    def __init__(self, cfg, record_dir: str | Path, key: str | None = None, log=print, keep_engine_calls=False):
        self.cfg, self.dir, self.log = cfg, Path(record_dir), log
        self.key = key or "sk-loongsage-" + secrets.token_urlsafe(24)
        self.requests: list[dict] = []
        self.steps = 0
        self.keep_engine_calls = keep_engine_calls
        self._groups = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loongsage-serve", daemon=True)
        self._lock = threading.Lock()
        self.ep = self.engine = None

    def start(self) -> "Server":
        import ray

        from pipeline.builder import start_engines
        from pipeline.cluster import init_ray
        from pipeline.resources import plan_resources
        from stages.agentflow.chat import ensure_chat_template
        from stages.agentflow.client import Affinity
        from stages.agentflow.limits import PromptLimit
        from stages.model import load_tokenizer, resolve_model_path

        c = self.cfg
        self.model_path = resolve_model_path(c.model, log=self.log)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.dir / "config.yaml", "w", opener=_owner_only) as f:
            f.write(dump_yaml(dataclasses.replace(c, model=dataclasses.replace(c.model, path=self.model_path))))
        self._requests = open(self.dir / "requests.jsonl", "a", buffering=1, opener=_owner_only)
        res = plan_resources(c)
        init_ray(c, res.ray_num_cpus)
        self.engines = start_engines(c, self.model_path, res)
        ray.get([e.info.remote() for e in self.engines])      # loaded: a request never waits on a model load
        self.tok = ensure_chat_template(load_tokenizer(self.model_path))
        client = Affinity(self.engines).for_group(0)
        self.engine = EngineLog(client) if self.keep_engine_calls else client
        p, s = c.proxy, c.sampling
        self.proxy = _logged_proxy(self.tok, p.host, p.port, int(p.max_body_mb * 2 ** 20), p.force_sampling,
                                   PromptLimit.for_model(self.model_path, self.tok, s.max_prompt_tokens),
                                   on_request=self._on_request)
        self.sampling = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                         "hold": False}
        self._thread.start()
        self._call(self.proxy.start())
        self.ep = self._call(self._open())
        self.base_url = self.ep.base_url        # every trajectory's: _open keeps the route
        return self

    def rotate(self, record: bool = True) -> Path | None:
        """Record the trajectory served so far (the step file, or None if it made no call; `record=False`:
        drop it); open the next."""
        with self._lock:
            path = self._record(self.ep) if record else self.proxy.close(self.ep)
            self.ep = self._call(self._open())
            return path

    def stop(self) -> Path | None:
        """Record the current trajectory, stop the proxy and the engines."""
        import ray

        with self._lock:
            path = self._record(self.ep) if self.ep is not None else None
            self.ep = None
            self._call(self.proxy.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._requests.close()
            for e in self.engines:
                ray.kill(e)
            return path

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _open(self):
        """A fresh Session under the fixed route and key: the URL a harness was given stays valid."""
        ep = await self.proxy.open(self.engine, dict(self.sampling), max_turns=self.cfg.agent.max_turns)
        entry = self.proxy.sessions.pop(ep.route)
        self.proxy.sessions[ROUTE] = (self.key, entry[1])
        ep.route, ep.api_key = ROUTE, self.key
        ep.base_url = ep.base_url.rsplit("/t/", 1)[0] + f"/t/{ROUTE}/v1"
        return ep

    def _on_request(self, line: dict) -> None:
        self.requests.append(line)
        self._requests.write(json.dumps(line) + "\n")

    def _record(self, ep) -> Path | None:
        from pipeline.recorder import Recorder

        self.proxy.close(ep)
        if ep.session.calls == 0 or ep.session.final is None:
            return None
        self.steps += 1
        table = trajectory_table(ep.session, self.tok, self.steps, self._groups)
        self._groups += table.num_rows
        return Recorder(self.dir, 1).write(self.steps, table)


def trajectory_table(session, tok, trajectory: int, first_group: int):
    """A served Session as trajectory rows: one per segment, each its own group of one sample."""
    from stages.agentflow.agent import AgentContext
    from stages.schema import conform, table_from_columns

    ctx = AgentContext(None, tok, [], {})
    ctx._adopt(session)
    now = time.time()
    stats = {"turns": ctx.turns, "tool_calls": 0, "segments": ctx.segments, "wall_s": 0.0, "gen_s": ctx.gen_s,
             "fail": ""}
    rows = [r | {"prompt_id": f"serve-{trajectory}-{r['segment']['id']}", "group_id": first_group + i, "sample_idx": 0,
                 "data_source": "serve", "prompt": tok.decode(r["prompt_ids"], skip_special_tokens=False),
                 "answer": "", "error": "", "reward": 0.0, "reward_info": "{}", "t_dispatch": now, "t_done": now,
                 "transcript": json.dumps(ctx.transcript), "agent_stats": stats, "segment_stats": ctx.segment_stats}
            for i, r in enumerate(ctx.results())]
    return conform(table_from_columns({k: [r[k] for r in rows] for k in rows[0]}))


def _owner_only(path, flags: int) -> int:
    """open()'s opener for a recording's files: every served prompt is in them, so 0600, never via a symlink."""
    fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def serve_config(model: str, overrides: list[str], host: str | None, port: int | None):
    extra = [f"proxy.host={host}"] if host else []
    extra += [f"proxy.port={port}"] if port is not None else []
    return load_config(None, [f"model.path={model}", *SERVE_DEFAULTS, *extra, *overrides])


def serve_key(args) -> str | None:
    """The API key from --key-file (owner-only) or $LOONGSAGE_SERVE_KEY; None: make one."""
    if args.key is not None:
        raise ValueError(f"--key puts the key on the command line, where any local user reads it "
                         f"(/proc/PID/cmdline); set {KEY_ENV} or pass --key-file FILE (mode 600)")
    if not args.key_file:
        return os.environ.pop(KEY_ENV, None) or None      # not inherited by the engines' Ray workers
    try:
        with open(args.key_file) as f:
            mode, key = os.fstat(f.fileno()).st_mode & 0o777, f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--key-file {args.key_file}: {getattr(e, 'strerror', None) or e}") from None
    if mode & 0o077:
        raise ValueError(f"--key-file {args.key_file} is open to group or others (mode {mode:o}); chmod 600 it")
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"--key-file {args.key_file} must hold one key on one line")
    return key


def cli_serve(args) -> int:
    try:
        cfg = serve_config(args.model, args.overrides, args.host, args.port)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    record = Path(args.record or f"runs/serve-{time.strftime('%Y%m%d-%H%M%S')}")
    try:        # before Ray starts: a refusal is one line at once
        key = serve_key(args)
        record.mkdir(mode=0o700, parents=True, exist_ok=True)
        with locked(record, log=lambda m: print(m, file=sys.stderr)):
            if found := previous_run(record):
                raise RunDirError(f"--record {record} holds a run or recording ({', '.join(found)}); "
                                  f"choose another directory")
            return _serve(Server(cfg, record, key=key).start(), record)
    except (ValueError, RunDirError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _serve(server: Server, record: Path) -> int:
    import signal

    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=_rotated, args=(server,)).start())
    base = server.base_url
    print(f"serving {server.model_path} on {base}\n"
          f"  OPENAI_BASE_URL={base} OPENAI_API_KEY={server.key}\n"
          f"  ANTHROPIC_BASE_URL={base[:-3]} ANTHROPIC_API_KEY={server.key}\n"
          f"recording to {record} (kill -USR1 {os.getpid()}: start the next trajectory; "
          f"Ctrl-C: record and stop)", flush=True)
    done.wait()
    path = server.stop()
    print(f"recorded {server.steps} trajectories in {record}/rollouts" + (f" (last: {path})" if path else "")
          + f"; train from them with: loongsage replay {record}/rollouts", flush=True)
    return 0


def _rotated(server: Server) -> None:
    path = server.rotate()
    print(f"trajectory recorded: {path}" if path else "no model call since the last trajectory: nothing recorded",
          flush=True)


def add_subcommand(sub) -> None:
    s = sub.add_parser("serve")
    s.add_argument("model", help="an HF model directory, a checkpoint (RUN/checkpoints/step_N) or builtin:NAME")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides (sampling.*, proxy.*, model.*)")
    s.add_argument("--host", default=None, help="bind address (default 127.0.0.1: loopback only)")
    s.add_argument("--port", type=int, default=None, help="port (default: any free port, printed)")
    s.add_argument("--key", default=None, help=argparse.SUPPRESS)     # refused: argv is readable by every user
    s.add_argument("--key-file", default=None, help=f"a file (mode 600) holding the API key clients must send "
                                                    f"(or ${KEY_ENV}; default: a random one, printed)")
    s.add_argument("--record", default=None, help="recording directory (default runs/serve-<time>)")
    s.set_defaults(fn=cli_serve)
