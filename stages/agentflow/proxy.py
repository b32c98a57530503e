"""The black-box agent proxy: OpenAI- and Anthropic-compatible HTTP in front of the engines.

One server (aiohttp) per rollout worker, on the worker's event loop, bound to 127.0.0.1
by default. Each trajectory gets its own endpoint and key:

    base_url = http://127.0.0.1:PORT/t/<route>/v1      (route: 24 random url-safe chars)
    api_key  = sk-loongsage-<random>                    (checked on every request)

    POST {base_url}/chat/completions        OpenAI chat (stages/agentflow/openai_api.py)
    POST {base_url}/completions             OpenAI completions
    POST {base_url}/responses               OpenAI Responses (stages/agentflow/responses_api.py)
    POST {base_url}/messages                Anthropic Messages (stages/agentflow/anthropic_api.py)
    POST {base_url}/messages/count_tokens   Anthropic token count (no model call)
    GET  {base_url}/models
    HEAD {base_url} (with or without /v1)   200, no key needed: the reachability check Claude Code sends

The anthropic SDK's base_url is the endpoint without /v1 (it appends /v1/messages itself).
The key is read from `Authorization: Bearer <key>` or `x-api-key: <key>` (what the anthropic
SDK sends), on every endpoint. A call may say what it is part of with the request-kind header
`x-loongsage-request-kind: main | compaction | subagent` (and `x-loongsage-agent-id` for one
subagent among several): see stages/agentflow/session.py.

Every call is forwarded token-in/token-out to the trajectory's engine (the rollout's
session affinity) and recorded by its Session (stages/agentflow/session.py), which builds
the trajectory in token space. Each protocol is an adapter at the edge (openai_api.py,
responses_api.py, anthropic_api.py, sharing protocol.py): it turns a request into ONE internal
call (stages/agentflow/protocol.py `Request`: chat messages, tools, limits, notes), rendered with
the chat template, checked, admitted and recorded exactly like a chat call (`_prompt`, then
`Session.complete`), and turns the generation back into its own reply and events. Harness quirks
live in stages/agentflow/harness.py (request kinds from their headers and prompts) and in
`Session.restore` (a history sent back re-serialised). What a request asked that the proxy
accepts without honouring (an unknown field, a hosted tool, an image) is served without it and
noted with the trajectory (docs/harnesses.md). The proxy keeps a trajectory's stored Responses
(for previous_response_id) until its endpoint closes.

Errors use the protocol's own body: OpenAI's {"error": {message, type, param, code}} on the
OpenAI paths, Anthropic's {"type": "error", "error": {type, message}} on /messages (the message
prefixed with the field at fault). 401 missing or wrong key, 404 unknown path or route (a
trajectory that ended), 413 body over the limit, 400 malformed JSON or JSON nested deeper than
protocol.MAX_JSON_DEPTH / a body that is not `Content-Type: application/json` (Responses,
Messages) / a malformed value of a known parameter, message, item, content block or token id
(`param` names the field) / a tool result without its call / unknown previous_response_id (400
previous_response_not_found, as OpenAI answers) / turn limit reached / trajectory token budget
spent, 400 `context_length_exceeded` (Anthropic: invalid_request_error, "prompt is too long") for
a prompt over the model's context or rollout.max_prompt_tokens (checked before the prompt is
tokenized, see stages/agentflow/limits.py); a completion budget is clamped, never refused
(limits.PromptLimit.clamp), 503 (Anthropic: 529 overloaded_error) request aborted by the engine
(the run is stopping) or the engine restarting.
Anything else is a generic 500 carrying a request id (also in the `x-request-id` header); its
detail goes to the `loongsage.proxy` logger, never to the client. A client that goes away
mid-stream is noted with the trajectory, not an error.

Each response carries `x-loongsage-engine-ms`: the time the call waited on the engine,
so a client can measure the proxy's own overhead (benchmarks/agentflow.py does).
"""
from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import logging
import math
import secrets
import socket
from collections import OrderedDict
from dataclasses import dataclass, replace

from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError

from stages.agentflow import anthropic_api, responses_api
from stages.agentflow.chat import decode_continuation, encode, ensure_chat_template, render
from stages.agentflow.client import ENGINE_LOST
from stages.agentflow.limits import PromptLimit, RequestRejected, longest_token_chars
from stages.agentflow.openai_api import (
    assistant_message,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
    parse_chat,
    parse_completion,
    token_pieces,
)
from stages.agentflow.protocol import (
    APIError,
    Request,
    call_separator,
    read_generation,
    read_json,
    sse,
    sse_event,
    tool_call_opening,
    with_reasoning,
)
from stages.agentflow.session import BudgetSpent, KindError, Session, TurnLimitReached, request_kind

SESSION = web.RequestKey("session", Session)
log = logging.getLogger("loongsage.proxy")
THREAD_CHARS = 1 << 16  # a longer prompt text is tokenized on a thread (the tokenizer releases the GIL):
                        # the proxy's loop serves other trajectories meanwhile
MAX_STORED = 256        # Responses kept per trajectory for previous_response_id (the oldest are dropped)
ENDPOINTS = "chat/completions, completions, responses, messages, messages/count_tokens (POST) and models (GET)"
_RAW: contextvars.ContextVar[list | None] = contextvars.ContextVar("loongsage_raw_rows", default=None)


class _Tap:
    """The engine client as a Session sees it; also hands the engine's rows of a call back to the
    handler that made it (through a context variable, so concurrent calls never mix): Anthropic's
    `stop_sequence` names the stop string the model wrote, which the recorded cut leaves out."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def generate(self, requests: list[dict]) -> list[dict]:
        out = await self._client.generate(requests)
        sink = _RAW.get()
        if sink is not None:
            sink.extend(out)
        return out


@dataclass
class Endpoint:
    base_url: str
    api_key: str
    route: str
    session: Session
    proxy: "Proxy"

    async def connect(self) -> socket.socket:
        """A connection to this endpoint alone (for an agent jail's forwarder: Proxy.attach)."""
        return await self.proxy.attach(self.route)


class Proxy:
    def __init__(self, tokenizer, host: str = "127.0.0.1", port: int = 0, max_body_bytes: int = 8 << 20,
                 force_sampling: bool = False, limit: PromptLimit | None = None):
        self.tok = ensure_chat_template(tokenizer)
        self.host, self.port, self.max_body = host, port, max_body_bytes
        self.force_sampling = force_sampling    # True: rollout temperature/top_p/seeds override the agent's
        # the model's context and rollout.max_prompt_tokens (PromptLimit.for_model); without one, only the
        # engine's own per-row check bounds a prompt
        self.limit = limit or PromptLimit(longest=longest_token_chars(self.tok))
        self.vocab = len(self.tok)
        self.sessions: dict[str, tuple[str, Session]] = {}
        self.stored: dict[str, OrderedDict[str, list[dict]]] = {}   # route -> response id -> its items
        self._opening: str | None = None
        self._sep: str | None = None            # what the template writes between content and a tool call
        self._runner: web.AppRunner | None = None
        self._bound: dict[asyncio.Transport, str] = {}   # connections that serve one route only (attach)

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application(client_max_size=self.max_body, middlewares=[self._guard])
        app.router.add_post("/t/{route}/v1/chat/completions", self._chat)
        app.router.add_post("/t/{route}/v1/completions", self._completions)
        app.router.add_post("/t/{route}/v1/responses", self._responses)
        app.router.add_post("/t/{route}/v1/messages", self._messages)
        app.router.add_post("/t/{route}/v1/messages/count_tokens", self._count_tokens)
        app.router.add_get("/t/{route}/v1/models", self._models)
        for path in ("/t/{route}", "/t/{route}/", "/t/{route}/v1"):     # a client's reachability check
            app.router.add_route("HEAD", path, self._reachable, name=None)
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
        completion tokens the trajectory may generate in all (rollout.max_trajectory_tokens; 0 = no budget)."""
        await self.start()
        route, key = secrets.token_urlsafe(18), "sk-loongsage-" + secrets.token_urlsafe(24)
        session = Session(_Tap(client), self.tok, sampling, max_turns, max_tokens)
        self.sessions[route] = (key, session)
        self.stored[route] = OrderedDict()
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return Endpoint(f"http://{host}:{self.port}/t/{route}/v1", key, route, session, self)

    def close(self, ep: Endpoint) -> None:
        """End a trajectory's endpoint: later calls get 404 and in-flight results are not recorded."""
        self.sessions.pop(ep.route, None)
        self.stored.pop(ep.route, None)
        for t in [t for t, r in self._bound.items() if r == ep.route]:
            del self._bound[t]
            t.close()
        ep.session.close()

    async def attach(self, route: str) -> socket.socket:
        """One end of a new connection whose other end this server serves as bound to `route`: a request on it
        for any other route is refused, so a key an agent jail learns is of no use from another jail."""
        await self.start()
        ours, theirs = socket.socketpair()
        transport, _ = await asyncio.get_running_loop().connect_accepted_socket(self._runner.server, ours)
        self._bound[transport] = route
        return theirs

    # ---- request guard: path, key, route, error format ----------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler):
        try:
            if request.match_info.http_exception is not None:
                raise APIError(request.match_info.http_exception.status,
                               f"no such endpoint {request.method} {request.path}; this proxy serves "
                               f"<base_url>/ {ENDPOINTS}", kind="not_found_error")
            if request.match_info.handler == self._reachable:
                return await handler(request)       # no key, no route lookup: it says nothing of either
            key = _api_key(request)
            if not key:
                how = "'x-api-key: <key>'" if _anthropic(request) else "'Authorization: Bearer <key>'"
                raise APIError(401, f"missing API key: send {how}", code="invalid_api_key",
                               kind="authentication_error")
            entry = self.sessions.get(request.match_info["route"])
            if entry is None or self._bound.get(request.transport, request.match_info["route"]) != \
                    request.match_info["route"]:
                raise APIError(404, "unknown trajectory endpoint (it has ended, or never existed)",
                               code="unknown_route", kind="not_found_error")
            if not hmac.compare_digest(key.encode(), entry[0].encode()):
                raise APIError(401, "invalid API key for this endpoint", code="invalid_api_key",
                               kind="authentication_error")
            request[SESSION] = entry[1]
            return await handler(request)
        except APIError as e:
            return _error(request, e)
        except RequestRejected as e:    # the engine refused the row: what the proxy's own checks would say
            return _error(request, APIError(400, str(e), e.param, e.code))
        except web.HTTPRequestEntityTooLarge:
            return _error(request, APIError(413, f"request body over the {self.max_body} byte limit"))
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
        return _error(request, err, {"x-request-id": rid})

    async def _json(self, request: web.Request, strict: bool = False) -> dict:
        """The body as JSON; `strict`: it must also say so (Content-Type: application/json)."""
        if strict and request.content_type != "application/json":
            raise APIError(400, f"the request body must be JSON sent with 'Content-Type: application/json', "
                                f"got {request.content_type!r}", "content-type")
        return read_json(await request.read())

    def _defaults(self, session: Session) -> dict:
        return {"temperature": session.sampling.get("temperature", 1.0), "top_p": session.sampling.get("top_p", 1.0)}

    # ---- endpoints ------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session: Session = request[SESSION]
        req = parse_chat(await self._json(request), self._defaults(session))
        req.messages = session.restore(req.messages)
        prefill = self._prefill(req.forced, "tool_choice")
        base = await self._prompt(request, req, text=self._render(req.messages, req.tools, "messages") + prefill,
                                  param="messages")
        choices = await self._complete(session, base, req)
        msgs = [assistant_message(req, replace(c, text=prefill + c.text), self._separator()) for c in choices]
        for msg, _ in msgs:
            session.remember(msg["content"], msg.get("tool_calls", []))
        if not session.closed:
            session.transcript = req.messages + [msgs[0][0]]
        pieces = self._pieces(req, base, choices)
        if req.stream:
            chunks = chat_chunks(req, choices, msgs, pieces, len(base.ids))
            return await self._sse(request, choices, _openai_sse(chunks))
        return self._reply(choices, chat_body(req, choices, msgs, pieces, len(base.ids)))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session: Session = request[SESSION]
        req = parse_completion(await self._json(request), self._defaults(session))
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
            chunks = completion_chunks(req, choices, pieces, len(base.ids))
            return await self._sse(request, choices, _openai_sse(chunks))
        return self._reply(choices, completion_body(req, choices, pieces, len(base.ids)))

    def _pieces(self, req, base, choices) -> list[list[str]]:
        """Per-token text, needed only for streaming and logprobs (a decode per token costs)."""
        if not (req.stream or req.logprobs):
            return [[] for _ in choices]
        return [token_pieces(self.tok, base.ids, c.ids, c.text) for c in choices]

    async def _reachable(self, request: web.Request) -> web.Response:
        """HEAD on the base URL: Claude Code opens its connection with one, without a key, before its first call."""
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "loongsage", "object": "model", "created": 0,
                                                              "owned_by": "loongsage"}]})

    async def _prompt(self, request: web.Request, req, text: str | None = None, ids: list[int] | None = None,
                      param: str = "messages"):
        """The call's prompt stream, checked against the context before anything long is tokenized, its
        completion budget clamped (limits.PromptLimit.clamp: never a 400 for asking too much), then admitted
        as one of the trajectory's calls (of the kind its request-kind header names: session.request_kind).
        What the request asked that is not honoured is recorded with the trajectory (req.notes)."""
        session: Session = request[SESSION]
        try:
            kind, agent = request_kind(request.headers, getattr(req, "messages", None))
        except KindError as e:
            raise APIError(400, str(e), "headers") from None
        count = 0       # the prompt's tokens (a lower bound until it is tokenized): for Anthropic's wording
        try:
            if ids is not None:
                if max(ids) >= self.vocab:
                    bad = next(i for i, t in enumerate(ids) if t >= self.vocab)
                    raise APIError(400, f"prompt[{bad}] = {ids[bad]} is not a token id: the vocabulary has "
                                        f"{self.vocab} tokens (ids 0..{self.vocab - 1})", param)
                count = len(ids)
                self.limit.budget(len(ids), 0, param=param)     # the length alone, before the ids are decoded
                base = session.base_for_ids(ids)
            else:
                if not text:
                    raise APIError(400, "the prompt is empty: nothing in this request is text the model can read",
                                   param)
                count = math.ceil(len(text) / self.limit.longest) if self.limit.longest else 0
                self.limit.check_text(text, param=param)        # cheap: no tokenizing of a hopeless text
                if len(text) > THREAD_CHARS:
                    base = await asyncio.to_thread(session.base_for_text, text)
                else:
                    base = session.base_for_text(text)
            count = len(base.ids)
            self.limit.budget(count, 0, param=param)
        except RequestRejected as e:
            raise APIError(400, str(e), e.param, e.code, tokens=(count, req.requested or 0)) from None
        req.max_tokens, req.bound = self.limit.clamp(count, req.requested, session.sampling["max_new_tokens"],
                                                     session.tokens_left())
        try:
            session.admit(base, kind, agent)
        except TurnLimitReached as e:
            code = "trajectory_budget_spent" if isinstance(e, BudgetSpent) else "turn_limit_reached"
            raise APIError(400, str(e), code=code) from None
        session.note(*req.notes)
        return base

    async def _complete(self, session: Session, base, req):
        temp, top_p, seed = req.temperature, req.top_p, req.seed
        if self.force_sampling:     # the rollout's sampling, its per-sample seeds too: an agent's fixed seed
            temp, top_p = self._defaults(session).values()      # would give a group's samples one answer
            seed = None
        choices = await session.complete(base, req.n, req.max_tokens, temp, top_p, req.stop, seed)
        if any(c.status == "aborted" for c in choices):
            raise APIError(503, "the engine aborted this request (the run is stopping or the window closed)",
                           kind="server_error")
        if req.bound in ("rollout", "budget") and any(c.finish_reason == "length" for c in choices):
            # the cut is ours, not the model's context nor the harness's own limit: the harness is told the
            # completion stopped (it would otherwise ask the model to "resume"); the trajectory keeps the
            # truth (status truncated, and this note)
            what = "rollout.max_new_tokens" if req.bound == "rollout" else "rollout.max_trajectory_tokens"
            session.note(f"a completion was cut at {req.max_tokens} tokens by {what}: reported to the harness "
                         f"as stopped")
            for c in choices:
                c.finish_reason = "stop" if c.finish_reason == "length" else c.finish_reason
        return choices

    def _reply(self, choices, body: dict) -> web.Response:
        return web.json_response(body, headers=_timing(choices), dumps=_dumps)

    async def _sse(self, request, choices, data: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **_timing(choices)})
        try:
            await resp.prepare(request)
            # the whole completion exists already: one write keeps the per-call cost flat in its length
            await resp.write(data)
            await resp.write_eof()
        except (ConnectionError, ClientConnectionResetError):
            # the client went away mid-stream: the call is recorded already; the trajectory says so, no 500
            request[SESSION].note("a client closed its connection before a streamed reply was written")
        return resp

    # ---- Responses and Messages: chat calls underneath -------------------------------------------
    def _render(self, messages: list[dict], tools: list | None, param: str) -> str:
        try:
            return render(self.tok, messages, tools)
        except Exception as e:  # noqa: BLE001 - jinja raises template-specific errors for unsupported histories
            raise APIError(400, f"the chat template cannot render these messages: {e}", param) from None

    def _separator(self) -> str:
        if self._sep is None:
            self._sep = call_separator(self.tok)
        return self._sep

    def _prefill(self, forced: str | None, param: str) -> str:
        """The prompt's ending that makes the model call a tool ("" = any tool, else the named one)."""
        if forced is None:
            return ""
        if self._opening is None:
            self._opening = tool_call_opening(self.tok) or ""
        if not self._opening:
            raise APIError(400, "this model's chat template writes no <tool_call> block, so a tool call cannot be "
                                "forced; use auto", param)
        return self._opening + (json.dumps(forced) if forced else "")

    async def _generate(self, request: web.Request, call: Request, forced: str | None, param: str, call_id=None):
        """One chat-shaped call of a Responses / Messages request: (prompt, choice, prefill, engine rows).
        `call_id`: how the protocol names a tool call given its chat id (remembered to restore the history)."""
        session: Session = request[SESSION]
        prefill = self._prefill(forced, "tool_choice")
        call.messages = session.restore(call.messages)
        text = self._render(call.messages, call.tools, param) + prefill
        base = await self._prompt(request, call, text=text, param=param)
        rows: list[dict] = []
        token = _RAW.set(rows)
        try:
            (choice,) = await self._complete(session, base, call)
        finally:
            _RAW.reset(token)
        gen = read_generation(prefill + choice.text, call.tools is not None, reasoning=not prefill)
        ids = [call_id(c["id"]) for c in gen.calls] if call_id else None
        content = gen.raw[:gen.raw.index("<tool_call>")].removesuffix(self._separator()) if gen.calls else gen.raw
        session.remember(content, gen.calls, ids)
        if not session.closed:
            turn = {"role": "assistant", "content": with_reasoning(gen.reasoning, gen.text)}
            session.transcript = call.messages + [turn | ({"tool_calls": gen.calls} if gen.calls else {})]
        return base, choice, prefill, gen, rows

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        session: Session = request[SESSION]
        req = responses_api.parse_responses(await self._json(request, strict=True), self._defaults(session))
        store = self.stored.get(request.match_info["route"], OrderedDict())
        prior = []
        if req.previous_response_id is not None:
            prior = store.get(req.previous_response_id)
            if prior is None:
                raise APIError(400, f"Previous response with id '{req.previous_response_id}' not found.",
                               "previous_response_id", "previous_response_not_found")
        items = prior + req.items
        req.call.messages = responses_api.to_messages(req.instructions, items, first_new=len(prior))
        base, choice, prefill, gen, _ = await self._generate(request, req.call, req.forced, "input")
        need = req.call.stream or req.logprobs or gen.reasoning is not None
        pieces = token_pieces(self.tok, base.ids, choice.ids, choice.text) if need else []
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        out = responses_api.output(gen, pieces, len(prefill), choice.logprobs, req, status)
        use = responses_api.usage(len(base.ids), len(choice.ids),
                                  responses_api.reasoning_tokens(gen, pieces, len(prefill)))
        resp_id = responses_api.new_id("resp")
        body = responses_api.response_body(resp_id, req, out, choice.finish_reason, use)
        if req.store and not session.closed:
            store[resp_id] = items + out.items
            while len(store) > MAX_STORED:
                store.popitem(last=False)
        if req.call.stream:
            events = responses_api.stream_events(body, out, choice.logprobs)
            return await self._sse(request, [choice], b"".join(map(sse_event, events)))
        return self._reply([choice], body)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        session: Session = request[SESSION]
        req = anthropic_api.parse_messages(await self._json(request, strict=True), self._defaults(session))
        try:
            base, choice, prefill, gen, rows = await self._generate(request, req.call, req.forced, "messages",
                                                                    anthropic_api.tool_use_id)
        except APIError as e:
            if e.code == "context_length_exceeded" and e.tokens:
                raise anthropic_api.context_error(e, self.limit.prompt_cap, self.limit.context) from None
            raise
        pieces = token_pieces(self.tok, base.ids, choice.ids, choice.text) if req.call.stream else []
        rep = anthropic_api.reply(gen, pieces, len(prefill))
        stop = self._stop_matched(base.ids, rows, req.call.stop)
        reason = anthropic_api.stop_reason(gen, choice.finish_reason, stop)
        body = anthropic_api.message_body(req.call.model, rep, reason, stop, len(base.ids), len(choice.ids))
        if req.call.stream:
            events = anthropic_api.stream_events(body, rep)
            return await self._sse(request, [choice], b"".join(map(sse_event, events)))
        return self._reply([choice], body)

    def _stop_matched(self, context_ids: list[int], rows: list[dict], stops: list[str]) -> str | None:
        """The stop string the Session cut the completion at (the earliest in the engine's text, as
        chat.cut_at_stop finds it), or None."""
        if not stops or not rows:
            return None
        full = decode_continuation(self.tok, context_ids, rows[0]["response_ids"], skip_special=True)
        hits = [(full.find(s), s) for s in stops if s in full]
        return min(hits)[1] if hits else None

    async def _count_tokens(self, request: web.Request) -> web.Response:
        req = anthropic_api.parse_messages(await self._json(request, strict=True), {"temperature": 1, "top_p": 1},
                                           count_only=True)
        text = self._render(req.call.messages, req.call.tools, "messages")
        ids = await asyncio.to_thread(encode, self.tok, text) if len(text) > THREAD_CHARS else encode(self.tok, text)
        return web.json_response({"input_tokens": len(ids)})


def _anthropic(request: web.Request) -> bool:
    """Anthropic's paths (…/v1/messages and below) answer in its error format."""
    return "/v1/messages" in request.path


def _api_key(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    bearer = auth[7:].strip() if auth.startswith("Bearer ") else ""
    return request.headers.get("x-api-key", "").strip() or bearer


def _error(request: web.Request, e: APIError, headers: dict | None = None) -> web.Response:
    """An error in the protocol of the path it answers, noted with the trajectory it was for (proxy_notes:
    a run's rows then show what status a harness saw, as `loongsage serve`'s requests.jsonl does)."""
    status, body = anthropic_api.error_response(e) if _anthropic(request) else (e.status, e.body())
    if request.get(SESSION) is not None:
        request[SESSION].note(f"answered HTTP {status} to {request.method} {request.path.rsplit('/v1', 1)[-1]}")
    return web.json_response(body, status=status, headers=headers)


def _openai_sse(payloads) -> bytes:
    return b"".join(sse(p) for p in payloads) + b"data: [DONE]\n\n"


def _timing(choices) -> dict:
    return {"x-loongsage-engine-ms": f"{choices[0].engine_s * 1e3:.3f}"}


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))
