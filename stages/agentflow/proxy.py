"""The black-box agent proxy: OpenAI- and Anthropic-compatible HTTP in front of the engines.

One aiohttp server per rollout worker, on its event loop, bound to 127.0.0.1 by default; each trajectory gets its
own endpoint `http://127.0.0.1:PORT/t/<route>/v1` (route: 24 random url-safe chars) and key (`Authorization:
Bearer <key>` or `x-api-key: <key>`). It serves ENDPOINTS, each protocol's adapter named in PROTOCOLS, and a
keyless HEAD on the base URL (Claude Code's reachability check).

A request walks one way: the guard (path, key, route), the protocol's `parse` into one `Request`, the trajectory's
`Session.call` (session.py), the protocol's `respond`. Errors are in the path's protocol (OpenAI's or Anthropic's
body): 401 a missing or wrong key, 404 an unknown path or route (an ended trajectory), 413 a body over the limit,
400 a malformed body or field (named), a prompt over the context or sampling.max_prompt_tokens
(`context_length_exceeded`), the turn limit or the token budget; 503 (Anthropic: 529) an engine that aborted the
call or restarts; anything else a generic 500 with a request id (its detail only in the `loongsage.proxy` log).
Each error status is noted with the trajectory. Each reply carries `x-loongsage-engine-ms`, the time the call
waited on the engine (benchmarks/agentflow.py measures the rest).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import socket
from dataclasses import dataclass
from functools import partial
from typing import Awaitable, Callable

from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError

from stages.agentflow import anthropic_api
from stages.agentflow.anthropic_api import MESSAGES, parse_messages
from stages.agentflow.chat import ensure_chat_template
from stages.agentflow.client import ENGINE_LOST
from stages.agentflow.limits import PromptLimit, RequestRejected, longest_token_chars
from stages.agentflow.openai_api import CHAT, COMPLETIONS
from stages.agentflow.protocol import APIError, Protocol, new_id, read_json
from stages.agentflow.responses_api import RESPONSES
from stages.agentflow.session import Session

SESSION = web.RequestKey("session", Session)
log = logging.getLogger("loongsage.proxy")
PROTOCOLS = {"chat/completions": CHAT, "completions": COMPLETIONS, "responses": RESPONSES, "messages": MESSAGES}
ENDPOINTS = "chat/completions, completions, responses, messages, messages/count_tokens (POST) and models (GET)"


@dataclass
class Endpoint:
    base_url: str
    api_key: str
    route: str
    session: Session
    connect: Callable[[], Awaitable[socket.socket]]     # a connection to it alone, for a jail's forwarder (attach)


class Proxy:
    def __init__(self, tokenizer, host: str = "127.0.0.1", port: int = 0, max_body_bytes: int = 8 << 20,
                 force_sampling: bool = False, limit: PromptLimit | None = None):
        self.tok = ensure_chat_template(tokenizer)
        self.host, self.port, self.max_body = host, port, max_body_bytes
        self.force_sampling = force_sampling    # True: rollout temperature/top_p/seeds override the agent's
        # the model's context and sampling.max_prompt_tokens (PromptLimit.for_model); without, only the engine's
        # own per-row check bounds a prompt
        self.limit = limit or PromptLimit(longest=longest_token_chars(self.tok))
        self.sessions: dict[str, tuple[str, Session]] = {}
        self._runner: web.AppRunner | None = None
        self._bound: dict[asyncio.Transport, str] = {}   # connections that serve one route only (attach)

    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application(client_max_size=self.max_body, middlewares=[self._guard])
        for path, api in PROTOCOLS.items():
            app.router.add_post(f"/t/{{route}}/v1/{path}", partial(self._serve, api=api))
        app.router.add_post("/t/{route}/v1/messages/count_tokens", self._count_tokens)
        app.router.add_get("/t/{route}/v1/models", self._models)
        for path in ("/t/{route}", "/t/{route}/", "/t/{route}/v1"):     # a client's reachability check
            app.router.add_route("HEAD", path, self._reachable)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port, backlog=1024).start()
        self.port = runner.addresses[0][1]
        self._runner = runner

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def open(self, client, sampling: dict, max_turns: int = 0, max_tokens: int = 0) -> Endpoint:
        """A fresh endpoint for one trajectory; its calls go to `client` (one engine). `max_tokens`: the
        completion tokens the trajectory may generate in all (agent.max_trajectory_tokens; 0 = no budget)."""
        await self.start()
        route, key = secrets.token_urlsafe(18), "sk-loongsage-" + secrets.token_urlsafe(24)
        session = Session(client, self.tok, sampling, self.limit, max_turns, max_tokens, self.force_sampling)
        self.sessions[route] = (key, session)
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return Endpoint(f"http://{host}:{self.port}/t/{route}/v1", key, route, session, partial(self.attach, route))

    def close(self, ep: Endpoint) -> None:
        """End a trajectory's endpoint: later calls get 404 and in-flight results are not recorded."""
        self.sessions.pop(ep.route, None)
        for t in [t for t, r in self._bound.items() if r == ep.route]:
            del self._bound[t]
            t.close()
        ep.session.closed = True

    async def attach(self, route: str) -> socket.socket:
        """One end of a new connection whose other end this server serves as bound to `route`: a request on it
        for any other route is refused, so a key an agent jail learns is of no use from another jail."""
        await self.start()
        ours, theirs = socket.socketpair()
        transport, _ = await asyncio.get_running_loop().connect_accepted_socket(self._runner.server, ours)
        self._bound[transport] = route
        return theirs

    # ---- the guard: path, key, route, error format ----------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler):
        try:
            if request.match_info.http_exception is not None:
                raise APIError(request.match_info.http_exception.status,
                               f"no such endpoint {request.method} {request.path}; this proxy serves "
                               f"<base_url>/ {ENDPOINTS}", kind="not_found_error")
            if request.match_info.handler == self._reachable:
                return await handler(request)       # no key, no route lookup: it says nothing of either
            auth = request.headers.get("Authorization", "")
            key = request.headers.get("x-api-key", "").strip() or (auth[7:].strip() if auth.startswith("Bearer ")
                                                                   else "")
            if not key:
                how = "'x-api-key: <key>'" if "/v1/messages" in request.path else "'Authorization: Bearer <key>'"
                raise APIError(401, f"missing API key: send {how}", code="invalid_api_key",
                               kind="authentication_error")
            route = request.match_info["route"]
            entry = self.sessions.get(route)
            if entry is None or self._bound.get(request.transport, route) != route:
                raise APIError(404, "unknown trajectory endpoint (it has ended, or never existed)",
                               code="unknown_route", kind="not_found_error")
            if not hmac.compare_digest(key.encode(), entry[0].encode()):
                raise APIError(401, "invalid API key for this endpoint", code="invalid_api_key",
                               kind="authentication_error")
            request[SESSION] = entry[1]
            return await handler(request)
        except APIError as e:
            return _error(request, e)
        except RequestRejected as e:  # a bad message (chat.MessageError); a row the engine refused, as our checks would
            return _error(request, APIError(400, str(e), e.param, e.code))
        except web.HTTPRequestEntityTooLarge:
            return _error(request, APIError(413, f"request body over the {self.max_body} byte limit"))
        except Exception as e:  # noqa: BLE001 - the proxy lives on; the client learns nothing of its insides
            rid = new_id("req")
            log.error("request %s: %s %s failed", rid, request.method, request.path, exc_info=e)
            status, msg = (503, "the engine serving this trajectory is unavailable (restarting); retry later") \
                if isinstance(e, ENGINE_LOST) else (500, "the server had an error while processing this request")
            err = APIError(status, f"{msg} (request id {rid}; the detail is in the run's log)", kind="server_error")
            return _error(request, err, {"x-request-id": rid})

    async def _body(self, request: web.Request, strict: bool):
        """The body as JSON; `strict`: it must also say so (Content-Type: application/json)."""
        if strict and request.content_type != "application/json":
            raise APIError(400, f"the request body must be JSON sent with 'Content-Type: application/json', "
                                f"got {request.content_type!r}", "content-type")
        return read_json(await request.read())

    # ---- endpoints --------------------------------------------------------------------------------------
    async def _serve(self, request: web.Request, api: Protocol) -> web.StreamResponse:
        session: Session = request[SESSION]
        req = api.parse(await self._body(request, api.strict), session)
        choices = await session.call(req, request.headers)
        reply = api.respond(req, choices, session)
        headers = {"x-loongsage-engine-ms": f"{choices[0].engine_s * 1e3:.3f}"}
        if not isinstance(reply, bytes):
            return web.json_response(reply, headers=headers, dumps=lambda o: json.dumps(o, separators=(",", ":")))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
        try:
            await resp.prepare(request)
            await resp.write(reply)     # the whole completion exists already: one write
            await resp.write_eof()
        except (ConnectionError, ClientConnectionResetError):
            # the client went away mid-stream: the call is recorded already; the trajectory says so, no 500
            session.note("a client closed its connection before a streamed reply was written")
        return resp

    async def _count_tokens(self, request: web.Request) -> web.Response:
        req = parse_messages(await self._body(request, strict=True), count_only=True)
        return web.json_response({"input_tokens": await request[SESSION].count(req)})

    async def _reachable(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "loongsage", "object": "model", "created": 0,
                                                              "owned_by": "loongsage"}]})


def _error(request: web.Request, e: APIError, headers: dict | None = None) -> web.Response:
    """An error in the protocol of the path it answers, noted with the trajectory it was for (proxy_notes:
    a run's rows then show what status a harness saw, as `loongsage serve`'s requests.jsonl does)."""
    status, body = anthropic_api.error_response(e) if "/v1/messages" in request.path else (e.status, e.body())
    if request.get(SESSION) is not None:
        request[SESSION].note(f"answered HTTP {status} to {request.method} {request.path.rsplit('/v1', 1)[-1]}")
    return web.json_response(body, status=status, headers=headers)
