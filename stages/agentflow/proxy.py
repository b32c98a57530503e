"""The black-box agent proxy: an OpenAI-compatible HTTP server in front of the engines.

One server (aiohttp) per rollout worker, on the worker's event loop, bound to 127.0.0.1
by default. Each trajectory gets its own endpoint and key:

    base_url = http://127.0.0.1:PORT/t/<route>/v1      (route: 24 random url-safe chars)
    api_key  = sk-loongsage-<random>                    (checked on every request)

    POST {base_url}/chat/completions   POST {base_url}/completions   GET {base_url}/models

Every call is forwarded token-in/token-out to the trajectory's engine (the rollout's
session affinity) and recorded by its Session (stages/agentflow/session.py), which builds
the trajectory in token space. Errors use the OpenAI error body: 401 missing or wrong key,
404 unknown path or route (a trajectory that ended), 413 body over the limit, 400
malformed JSON / unsupported parameter / invalid message or token id (`param` names the
field) / turn limit reached, 400 `context_length_exceeded` for a prompt over the model's
context or rollout.max_prompt_tokens (checked before the prompt is tokenized, see
stages/agentflow/limits.py), 503 request aborted by the engine (the run is stopping) or the
engine restarting. Anything else is a generic 500 carrying a request id (also in the
`x-request-id` header); its detail goes to the `loongsage.proxy` logger, never to the client.

Each response carries `x-loongsage-engine-ms`: the time the call waited on the engine,
so a client can measure the proxy's own overhead (benchmarks/agentflow.py does).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
from dataclasses import dataclass

from aiohttp import web

from stages.agentflow.chat import ensure_chat_template, render
from stages.agentflow.client import ENGINE_LOST
from stages.agentflow.limits import PromptLimit, RequestRejected, longest_token_chars
from stages.agentflow.openai_api import (
    APIError,
    assistant_message,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
    parse_chat,
    parse_completion,
    sse,
    token_pieces,
)
from stages.agentflow.session import KindError, Session, TurnLimitReached, request_kind

SESSION = web.RequestKey("session", Session)
log = logging.getLogger("loongsage.proxy")
THREAD_CHARS = 1 << 16  # a longer prompt text is tokenized on a thread (the tokenizer releases the GIL):
                        # the proxy's loop serves other trajectories meanwhile


@dataclass
class Endpoint:
    base_url: str
    api_key: str
    route: str
    session: Session


class Proxy:
    def __init__(self, tokenizer, host: str = "127.0.0.1", port: int = 0, max_body_bytes: int = 8 << 20,
                 force_sampling: bool = False, limit: PromptLimit | None = None):
        self.tok = ensure_chat_template(tokenizer)
        self.host, self.port, self.max_body = host, port, max_body_bytes
        self.force_sampling = force_sampling    # True: rollout temperature/top_p override the agent's
        # the model's context and rollout.max_prompt_tokens (PromptLimit.for_model); without one, only the
        # engine's own per-row check bounds a prompt
        self.limit = limit or PromptLimit(longest=longest_token_chars(self.tok))
        self.vocab = len(self.tok)
        self.sessions: dict[str, tuple[str, Session]] = {}
        self._runner: web.AppRunner | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application(client_max_size=self.max_body, middlewares=[self._guard])
        app.router.add_post("/t/{route}/v1/chat/completions", self._chat)
        app.router.add_post("/t/{route}/v1/completions", self._completions)
        app.router.add_get("/t/{route}/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port, backlog=1024).start()
        self.port = runner.addresses[0][1]
        self._runner = runner

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def open(self, client, sampling: dict, max_turns: int = 0) -> Endpoint:
        """A fresh endpoint for one trajectory; its calls go to `client` (one engine)."""
        await self.start()
        route, key = secrets.token_urlsafe(18), "sk-loongsage-" + secrets.token_urlsafe(24)
        session = Session(client, self.tok, sampling, max_turns)
        self.sessions[route] = (key, session)
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return Endpoint(f"http://{host}:{self.port}/t/{route}/v1", key, route, session)

    def close(self, ep: Endpoint) -> None:
        """End a trajectory's endpoint: later calls get 404 and in-flight results are not recorded."""
        self.sessions.pop(ep.route, None)
        ep.session.close()

    # ---- request guard: path, key, route, error format ----------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler):
        try:
            if request.match_info.http_exception is not None:
                raise APIError(request.match_info.http_exception.status,
                               f"no such endpoint {request.method} {request.path}; this proxy serves "
                               f"POST <base_url>/chat/completions and POST <base_url>/completions")
            auth = request.headers.get("Authorization", "")
            if not auth.startswith("Bearer ") or not auth[7:].strip():
                raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key", kind="authentication_error")
            entry = self.sessions.get(request.match_info["route"])
            if entry is None:
                raise APIError(404, "unknown trajectory endpoint (it has ended, or never existed)",
                               code="unknown_route", kind="not_found_error")
            if not hmac.compare_digest(auth[7:].strip().encode(), entry[0].encode()):
                raise APIError(401, "invalid API key for this endpoint", code="invalid_api_key",
                               kind="authentication_error")
            request[SESSION] = entry[1]
            return await handler(request)
        except APIError as e:
            return web.json_response(e.body(), status=e.status)
        except RequestRejected as e:    # the engine refused the row: what the proxy's own checks would say
            return web.json_response(APIError(400, str(e), e.param, e.code).body(), status=400)
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(APIError(413, f"request body over the {self.max_body} byte limit").body(),
                                     status=413)
        except Exception as e:  # noqa: BLE001 - the proxy lives on; the client learns nothing of its insides
            return self._internal_error(request, e)

    @staticmethod
    def _internal_error(request: web.Request, e: Exception) -> web.Response:
        """A generic 500 (503 while the engine restarts) with a request id; the detail goes to the log."""
        rid = "req_" + secrets.token_hex(12)
        log.error("request %s: %s %s failed", rid, request.method, request.path, exc_info=e)
        if isinstance(e, ENGINE_LOST):
            status, msg = 503, "the engine serving this trajectory is unavailable (restarting); retry later"
        else:
            status, msg = 500, "the server had an error while processing this request"
        err = APIError(status, f"{msg} (request id {rid}; the detail is in the run's log)", kind="server_error")
        return web.json_response(err.body(), status=status, headers={"x-request-id": rid})

    async def _json(self, request: web.Request) -> dict:
        raw = await request.read()
        try:
            return json.loads(raw)
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    def _defaults(self, session: Session) -> dict:
        return {"temperature": session.sampling.get("temperature", 1.0), "top_p": session.sampling.get("top_p", 1.0)}

    # ---- endpoints ------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session: Session = request[SESSION]
        req = parse_chat(await self._json(request), self._defaults(session), session.sampling["max_new_tokens"])
        try:
            text = render(self.tok, req.messages, req.tools)
        except Exception as e:  # noqa: BLE001 - jinja raises template-specific errors for unsupported histories
            raise APIError(400, f"the chat template cannot render these messages: {e}", "messages") from None
        base = await self._prompt(request, req, text=text, param="messages")
        choices = await self._complete(session, base, req)
        msgs = [assistant_message(req, c) for c in choices]
        if not session.closed:
            session.transcript = req.messages + [msgs[0][0]]
        pieces = self._pieces(req, base, choices)
        if req.stream:
            return await self._sse(request, choices, chat_chunks(req, choices, msgs, pieces, len(base.ids)))
        return self._reply(choices, chat_body(req, choices, msgs, pieces, len(base.ids)))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session: Session = request[SESSION]
        req = parse_completion(await self._json(request), self._defaults(session), session.sampling["max_new_tokens"])
        if isinstance(req.prompt, list):
            base = await self._prompt(request, req, ids=req.prompt, param="prompt")
        else:
            base = await self._prompt(request, req, text=req.prompt, param="prompt")
        choices = await self._complete(session, base, req)
        if not session.closed:
            prompt = req.prompt if isinstance(req.prompt, str) else base.text
            session.transcript = [{"role": "prompt", "content": prompt},
                                  {"role": "assistant", "content": choices[0].text}]
        pieces = self._pieces(req, base, choices)
        if req.stream:
            return await self._sse(request, choices, completion_chunks(req, choices, pieces, len(base.ids)))
        return self._reply(choices, completion_body(req, choices, pieces, len(base.ids)))

    def _pieces(self, req, base, choices) -> list[list[str]]:
        """Per-token text, needed only for streaming and logprobs (a decode per token costs)."""
        if not (req.stream or req.logprobs):
            return [[] for _ in choices]
        return [token_pieces(self.tok, base.ids, c.ids, c.text) for c in choices]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "loongsage", "object": "model", "created": 0,
                                                              "owned_by": "loongsage"}]})

    async def _prompt(self, request: web.Request, req, text: str | None = None, ids: list[int] | None = None,
                      param: str = "messages"):
        """The call's prompt stream, checked against the context before anything long is tokenized
        (req.max_tokens becomes the budget that fits), then admitted as one of the trajectory's calls
        (of the kind its request-kind header names: session.request_kind)."""
        session: Session = request[SESSION]
        try:
            kind, agent = request_kind(request.headers)
        except KindError as e:
            raise APIError(400, str(e), "headers") from None
        try:
            if ids is not None:
                if max(ids) >= self.vocab:
                    bad = next(i for i, t in enumerate(ids) if t >= self.vocab)
                    raise APIError(400, f"prompt[{bad}] = {ids[bad]} is not a token id: the vocabulary has "
                                        f"{self.vocab} tokens (ids 0..{self.vocab - 1})", param)
                self.limit.budget(len(ids), 0, param=param)     # the length alone, before the ids are decoded
                base = session.base_for_ids(ids)
            else:
                self.limit.check_text(text, param=param)        # cheap: no tokenizing of a hopeless text
                if len(text) > THREAD_CHARS:
                    base = await asyncio.to_thread(session.base_for_text, text)
                else:
                    base = session.base_for_text(text)
            req.max_tokens = self.limit.budget(len(base.ids), req.max_tokens, req.max_tokens_set, param)
        except RequestRejected as e:
            raise APIError(400, str(e), e.param, e.code) from None
        try:
            session.admit(base, kind, agent)
        except TurnLimitReached as e:
            raise APIError(400, str(e), code="turn_limit_reached") from None
        return base

    async def _complete(self, session: Session, base, req):
        temp, top_p = req.temperature, req.top_p
        if self.force_sampling:
            temp, top_p = self._defaults(session).values()
        choices = await session.complete(base, req.n, req.max_tokens, temp, top_p, req.stop, req.seed)
        if any(c.status == "aborted" for c in choices):
            raise APIError(503, "the engine aborted this request (the run is stopping or the window closed)",
                           kind="server_error")
        return choices

    def _reply(self, choices, body: dict) -> web.Response:
        return web.json_response(body, headers=_timing(choices), dumps=_dumps)

    async def _sse(self, request, choices, payloads) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **_timing(choices)})
        await resp.prepare(request)
        # the whole completion exists already: one write keeps the per-call cost flat in its length
        await resp.write(b"".join(sse(p) for p in payloads) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp



def _timing(choices) -> dict:
    return {"x-loongsage-engine-ms": f"{choices[0].engine_s * 1e3:.3f}"}


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))
