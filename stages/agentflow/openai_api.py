"""OpenAI wire format for the proxy: request validation and response bodies, no I/O.

Supported: chat completions and completions, streaming (SSE) and not, `n`, `temperature`,
`top_p`, `seed`, `max_tokens` / `max_completion_tokens`, `stop`, `logprobs` (the sampled token's
log-probability: chat `logprobs: true`, completions `logprobs: 0`), `tools` with
`tool_choice` auto|none, and completions prompts as text or token ids. Anything the
engine cannot honour (top_logprobs, penalties, forced tool choice, echo, ...) is a
400 naming the parameter, never silently ignored. `max_tokens` is capped at the rollout's
per-call budget.

Streams are emitted once the engine returns the completion (the embedded engine
returns whole completions), one chunk per token, then `data: [DONE]`.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from stages.agentflow.chat import decode, normalise_messages, parse_tool_calls, render

IGNORED = {"model", "user", "metadata", "store", "parallel_tool_calls", "service_tier"}
CHAT_PARAMS = IGNORED | {"messages", "n", "seed", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop",
                         "logprobs", "top_logprobs", "stream", "stream_options", "tools", "tool_choice",
                         "frequency_penalty", "presence_penalty", "response_format"}
COMPLETION_PARAMS = IGNORED | {"prompt", "n", "seed", "temperature", "top_p", "max_tokens", "stop", "logprobs",
                               "stream", "stream_options", "echo", "suffix", "best_of", "frequency_penalty",
                               "presence_penalty"}
MAX_N = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", tokens: tuple[int, int] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.tokens = tokens    # context_length_exceeded: (prompt tokens, or a lower bound; completion budget)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    logprobs: bool
    stream: bool
    include_usage: bool
    model: str
    seed: int | None = None                              # choice i samples with seed + i
    max_tokens_set: bool = False                         # the body set max_tokens: not fitting the context is a 400
    messages: list[dict] = field(default_factory=list)   # chat
    tools: list[dict] | None = None                      # chat; None = do not parse tool calls
    prompt: str | list[int] = ""                         # completions


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _number(body: dict, key: str, default, lo, hi, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise _bad(f"'{key}' must be {kind} in [{lo}, {hi}], got {v!r}", key)
    return v


def _unsupported(body: dict, key: str, default_ok) -> None:
    if key in body and body[key] not in default_ok:
        raise _bad(f"'{key}'={body[key]!r} is not supported by this endpoint", key)


def _common(body: dict, allowed: set, defaults: dict, max_tokens_cap: int) -> dict:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(f"unsupported parameter '{unknown[0]}'", unknown[0])
    for key in ("frequency_penalty", "presence_penalty"):
        _unsupported(body, key, (0, 0.0, None))
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _bad("'stop' must be a non-empty string or a list of at most 4 non-empty strings", "stop")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": limit}, "max_tokens", max_tokens_cap, 1, 1 << 20, integer=True)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    return {"n": _number(body, "n", 1, 1, MAX_N, integer=True), "max_tokens": min(max_tokens, max_tokens_cap),
            "temperature": float(_number(body, "temperature", defaults["temperature"], 0, 2)),
            "top_p": float(_number(body, "top_p", defaults["top_p"], 1e-6, 1)),
            "seed": _number(body, "seed", None, 0, 1 << 62, integer=True),
            "stop": stop, "stream": stream, "include_usage": bool((opts or {}).get("include_usage")),
            "model": str(body.get("model") or "loongsage"), "max_tokens_set": limit is not None}


def parse_chat(body: dict, defaults: dict, max_tokens_cap: int) -> Request:
    common = _common(body, CHAT_PARAMS, defaults, max_tokens_cap)
    try:
        messages = normalise_messages(body.get("messages"))
    except ValueError as e:
        raise _bad(str(e), getattr(e, "param", "messages")) from None
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, (bool, type(None))):
        raise _bad("'logprobs' must be a boolean", "logprobs")
    _unsupported(body, "top_logprobs", (0, None))
    _unsupported(body, "tool_choice", ("auto", "none", None))
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad("'response_format' other than text is not supported", "response_format")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise _bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
        tools = tools or None
    if body.get("tool_choice") == "none":
        tools = None
    return Request(**common, logprobs=bool(logprobs), messages=messages, tools=tools)


def parse_completion(body: dict, defaults: dict, max_tokens_cap: int) -> Request:
    common = _common(body, COMPLETION_PARAMS, defaults, max_tokens_cap)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    ids_ok = isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids_ok:
        raise _bad("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt per request)",
                   "prompt")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise _bad("'logprobs' must be null or 0: the engine returns only the sampled token's logprob", "logprobs")
    _unsupported(body, "echo", (False, None))
    _unsupported(body, "suffix", (None, ""))
    if body.get("best_of") not in (None, common["n"]):
        raise _bad("'best_of' must equal 'n'", "best_of")
    return Request(**common, logprobs=logprobs == 0, prompt=prompt)


# ---- responses ----------------------------------------------------------------------------
def _usage(prompt_tokens: int, choices) -> dict:
    done = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}


def token_pieces(tok, context_ids: list[int], ids: list[int], text: str) -> list[str]:
    """Per-token text pieces whose concatenation is `text` (one piece if a character spans tokens)."""
    pieces, ctx = [], list(context_ids[-4:])
    for t in ids:
        head = decode(tok, ctx, skip_special=True)
        full = decode(tok, ctx + [t], skip_special=True)
        pieces.append(full[len(head):] if full.startswith(head) else "")
        ctx = (ctx + [t])[-4:]
    return pieces if "".join(pieces) == text else [text] + [""] * (len(ids) - 1)


def assistant_message(req: Request, choice) -> tuple[dict, str]:
    """The assistant message of one choice and its finish_reason (tool calls parsed when tools were given)."""
    content, calls = (parse_tool_calls(choice.text) if req.tools else (choice.text, []))
    msg = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg, "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason


def chat_body(req: Request, choices, messages: list[tuple[dict, str]], pieces: list[list[str]],
              prompt_tokens: int) -> dict:
    out = []
    for i, (c, (msg, finish)) in enumerate(zip(choices, messages)):
        lp = {"content": [_chat_lp(p, lp) for p, lp in zip(pieces[i], c.logprobs)]} if req.logprobs else None
        out.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": finish})
    return {"id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion", "created": int(time.time()),
            "model": req.model, "choices": out, "usage": _usage(prompt_tokens, choices)}


def _chat_lp(piece: str, lp: float) -> dict:
    return {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}


def chat_chunks(req: Request, choices, messages, pieces, prompt_tokens: int):
    """The SSE payloads of a streamed chat completion (without the final [DONE])."""
    head = {"id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion.chunk",
            "created": int(time.time()), "model": req.model}
    for i, (c, (msg, finish)) in enumerate(zip(choices, messages)):
        yield head | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]}
        if msg.get("tool_calls"):  # content then calls, each whole: pieces of markup are no use to a client
            if msg["content"]:
                yield head | {"choices": [{"index": i, "delta": {"content": msg["content"]}, "logprobs": None,
                                           "finish_reason": None}]}
            calls = [{"index": j} | tc for j, tc in enumerate(msg["tool_calls"])]
            yield head | {"choices": [{"index": i, "delta": {"tool_calls": calls}, "logprobs": None,
                                       "finish_reason": None}]}
        else:
            for p, lp in zip(pieces[i], c.logprobs):
                yield head | {"choices": [{"index": i, "delta": {"content": p},
                                           "logprobs": {"content": [_chat_lp(p, lp)]} if req.logprobs else None,
                                           "finish_reason": None}]}
        yield head | {"choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}]}
    if req.include_usage:
        yield head | {"choices": [], "usage": _usage(prompt_tokens, choices)}


def _completion_lp(pieces: list[str], lps: list[float]) -> dict:
    offsets, pos = [], 0
    for p in pieces:
        offsets.append(pos)
        pos += len(p)
    return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}


def completion_body(req: Request, choices, pieces, prompt_tokens: int) -> dict:
    out = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
            "logprobs": _completion_lp(pieces[i], c.logprobs) if req.logprobs else None}
           for i, c in enumerate(choices)]
    return {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": out, "usage": _usage(prompt_tokens, choices)}


def completion_chunks(req: Request, choices, pieces, prompt_tokens: int):
    head = {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": int(time.time()),
            "model": req.model}
    for i, c in enumerate(choices):
        for p, lp in zip(pieces[i], c.logprobs):
            yield head | {"choices": [{"index": i, "text": p, "finish_reason": None,
                                       "logprobs": _completion_lp([p], [lp]) if req.logprobs else None}]}
        yield head | {"choices": [{"index": i, "text": "", "finish_reason": c.finish_reason, "logprobs": None}]}
    if req.include_usage:
        yield head | {"choices": [], "usage": _usage(prompt_tokens, choices)}


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_event(payload: dict) -> bytes:
    """An SSE event named by its payload's `type` (the Responses and Messages streams)."""
    return b"event: " + payload["type"].encode() + b"\n" + sse(payload)


# ---- shared by the Responses and Messages adapters -------------------------------------------------
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Generation:
    """A completion's text as the Responses / Messages APIs present it: reasoning, text, tool calls,
    with the spans they came from (offsets into the raw text) for streaming them piece by piece."""
    raw: str
    reasoning: str | None                 # inside <think>...</think>, None if the model wrote none
    reasoning_span: tuple[int, int]
    text: str                             # the visible text (before the first tool call)
    text_span: tuple[int, int]
    calls: list[dict]                     # chat-form tool calls (parse_tool_calls)
    think_end: int                        # offset just past </think> (0 without reasoning)


def _strip_span(raw: str, a: int, b: int) -> tuple[int, int]:
    while a < b and raw[a].isspace():
        a += 1
    while b > a and raw[b - 1].isspace():
        b -= 1
    return a, b


def read_generation(raw: str, parse_calls: bool, reasoning: bool = True) -> Generation:
    """Split generated text into reasoning, text and tool calls. Reasoning is `<think>...</think>` at the
    start, or text up to a `</think>` with no opening tag (a template that opens the block in the
    generation prompt, as Qwen3's does when thinking)."""
    r, r_span, start = None, (0, 0), 0
    close = raw.find(THINK_CLOSE) if reasoning else -1
    if close >= 0:
        opened = raw.find(THINK_OPEN, 0, close)
        if opened < 0 or not raw[:opened].strip():
            a = opened + len(THINK_OPEN) if opened >= 0 else 0
            r_span = _strip_span(raw, a, close)
            r = raw[r_span[0]:r_span[1]]
            start = close + len(THINK_CLOSE)
    rest = raw[start:]
    content, calls = parse_tool_calls(rest) if parse_calls else (rest, [])
    if calls:
        t_span = _strip_span(raw, start, start + rest.index("<tool_call>"))
    else:
        t_span = (_strip_span(raw, start, len(raw))[0] if r is not None else start, len(raw))
    return Generation(raw, r, r_span, raw[t_span[0]:t_span[1]], t_span, calls, start if r is not None else 0)


def with_reasoning(reasoning: str | None, content: str) -> str:
    """An assistant turn's content with its reasoning written back inline, the way read_generation
    reads it and Qwen-style templates render it (a template that drops old reasoning drops it)."""
    return content if reasoning is None else f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"


def span_pieces(pieces: list[str], span: tuple[int, int], offset: int = 0) -> list[tuple[str, int]]:
    """The parts of per-token `pieces` (starting at `offset` of the raw text) inside `span`, each with
    its token's index: a part's stream deltas."""
    out, pos = [], offset
    a, b = span
    for i, p in enumerate(pieces):
        lo, hi = max(a, pos), min(b, pos + len(p))
        if lo < hi:
            out.append((p[lo - pos:hi - pos], i))
        pos += len(p)
    return out


def tokens_before(pieces: list[str], end: int) -> int:
    """How many tokens it takes to reach character `end` of their text (reasoning token counts)."""
    pos = 0
    for i, p in enumerate(pieces):
        if pos >= end:
            return i
        pos += len(p)
    return len(pieces)


def tool_call_opening(tok) -> str | None:
    """How the chat template opens a tool call, up to the function name (e.g. '<tool_call>\\n{"name": '),
    found by rendering one; None if it writes no <tool_call> block. A forced tool choice is honoured by
    ending the prompt with it: the model must continue a call (its tokens are context, not trained)."""
    probe = "loongsage_probe_fn"
    call = {"id": "c0", "type": "function", "function": {"name": probe, "arguments": "{}"}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        head = render(tok, msgs[:1], generation_prompt=True)
        turn = render(tok, msgs, generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that cannot render a tool call cannot be forced to write one
        return None
    turn = turn[len(head):] if turn.startswith(head) else turn
    i, j = turn.find("<tool_call>"), turn.find(json.dumps(probe))
    return turn[i:j] if 0 <= i < j else None
