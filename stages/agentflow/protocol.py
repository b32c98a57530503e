"""What the protocol adapters share, and nothing of any one protocol's format.

An adapter (openai_api.py: Chat and Completions; responses_api.py; anthropic_api.py) is a `Protocol`: `parse`
reads its body (`Fields`) into ONE internal call, a `Request`, which `Session.call` serves; `respond` turns the
choices back into its reply or its stream of events. What a request asked that the proxy accepts without
honouring is a note (docs/harnesses.md); a malformed value of a known field is an `APIError` naming it.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Callable

from stages.agentflow.chat import THINK_CLOSE, THINK_OPEN, decode_continuation, parse_tool_calls

MAX_JSON_DEPTH = 64     # arrays/objects inside each other; real requests use about 10 (a JSON schema in a tool)
MAX_TOKENS = 1 << 62    # any positive completion limit is accepted (then clamped); only a malformed one is a 400


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", tokens: tuple[int, int, int, int] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.tokens = tokens    # a prompt over the limit: (its tokens or a lower bound, max_tokens, cap, context)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class Request:
    """One model call, whichever protocol asked for it."""
    messages: list[dict] | None = None      # chat messages for the template (None: `prompt` is the prompt)
    prompt: str | list[int] = ""            # completions: text or token ids
    tools: list[dict] | None = None         # chat function tools; None: tool calls are not parsed
    forced: str | None = None               # "" (any tool) or a tool's name: the prompt ends in a call's opening
    n: int = 1
    temperature: float | None = None        # None: the trajectory's own sampling
    top_p: float | None = None
    seed: int | None = None                 # choice i samples with seed + i
    stop: list[str] = field(default_factory=list)
    requested: int | None = None            # the harness's own completion limit (None: it set none)
    max_tokens: int = 0                     # the budget served: Session.call clamps (limits.PromptLimit.clamp)
    bound: str = "request"                  # what bound it: request | rollout | context | budget
    stream: bool = False
    logprobs: bool = False
    include_usage: bool = False
    model: str = "loongsage"
    notes: list[str] = field(default_factory=list)     # accepted, not honoured: recorded with the trajectory
    param: str = "messages"                 # the field a refused prompt is blamed on
    reasoning: bool = False                 # the reply gives reasoning apart from the text (Responses, Messages)
    call_prefix: str = "call_"              # how the reply's tool-call ids start


@dataclass(frozen=True)
class Protocol:
    parse: Callable       # (body, session=None) -> Request
    respond: Callable     # (request, choices, session) -> a reply body (dict), or a whole SSE stream (bytes)
    strict: bool = False  # the body must come as `Content-Type: application/json`


def read_json(raw: bytes):
    """The body as JSON, or a 400: malformed, or nested deeper than MAX_JSON_DEPTH (Python's parser recurses
    per level: a body nested 100,000 deep would end in a RecursionError)."""
    deep = APIError(400, f"the request body nests JSON arrays/objects more than {MAX_JSON_DEPTH} levels deep")
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise deep from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:        # iterative: no recursion to exhaust
        v, d = stack.pop()
        if d > MAX_JSON_DEPTH:
            raise deep
        stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (dict, list)))
    return obj


class Fields:
    """A request body, read field by field: a malformed value of a known field is a 400 naming it; a field the
    proxy does not know, or cannot honour, is a note (accepted and recorded)."""

    def __init__(self, body, known: set):
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        self.body, self.notes = body, [f"ignored unknown field '{k}'" for k in sorted(set(body) - known)]

    def number(self, key: str, default, lo, hi, integer: bool = False):
        v = self.body.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or not lo <= v <= hi:
            raise bad(f"'{key}' must be {'an integer' if integer else 'a number'} in [{lo}, {hi}], got {v!r}", key)
        return v

    def flag(self, key: str, default: bool = False, message: str | None = None) -> bool:
        v = self.body.get(key)
        if not isinstance(v, (bool, type(None))):
            raise bad(message or f"'{key}' must be a boolean", key)
        return default if v is None else v

    def not_honoured(self, **honoured: tuple) -> None:
        """Notes for the fields set to other than the only values (`honoured[key]`) the proxy serves."""
        self.notes += [f"'{k}'={self.body[k]!r} accepted but not honoured" for k, ok in honoured.items()
                       if k in self.body and self.body[k] not in ok]

    def tokens(self, *keys: str) -> int | None:
        """The harness's own completion limit: the first of `keys` it set (None: none)."""
        key = next((k for k in keys if self.body.get(k) is not None), keys[0])
        return self.number(key, None, 1, MAX_TOKENS, integer=True)

    def request(self, cls: type = Request, top_temperature: float = 2, **kw) -> Request:
        t, p = self.number("temperature", None, 0, top_temperature), self.number("top_p", None, 1e-6, 1)
        return cls(temperature=None if t is None else float(t), top_p=None if p is None else float(p),
                   model=str(self.body.get("model") or "loongsage"), notes=self.notes, **kw)


# ---- a generation as the adapters present it ------------------------------------------------------------------
@dataclass
class Generation:
    """A completion's text as the replies present it: reasoning, text and tool calls, with the spans they came
    from (offsets into the raw text, which starts with a forced call's prefill of `offset` characters)."""
    raw: str
    reasoning: str | None                 # inside <think>...</think>, None if the model wrote none
    reasoning_span: tuple[int, int]
    text: str                             # the visible text (before the first tool call)
    text_span: tuple[int, int]
    calls: list[dict]                     # chat-form tool calls (parse_tool_calls)
    think_end: int                        # offset just past </think> (0 without reasoning)
    offset: int = 0

    def turn(self) -> dict:
        """The reply as an assistant turn of the history a client sends back: reasoning inline, text, calls."""
        return {"role": "assistant", "content": with_reasoning(self.reasoning, self.text)} | (
            {"tool_calls": self.calls} if self.calls else {})


def _strip_span(raw: str, a: int, b: int) -> tuple[int, int]:
    part = raw[a:b]
    a += len(part) - len(part.lstrip())
    return a, max(a, b - len(part) + len(part.rstrip()))


def read_generation(raw: str, parse_calls: bool, reasoning: bool, prefix: str = "call_") -> Generation:
    """Generated text split into reasoning, text and tool calls. Reasoning (if `reasoning`) is `<think>...
    </think>` at the start, or text up to a `</think>` with no opening (a template that opens the block in
    the generation prompt, as Qwen3's does when thinking)."""
    r, r_span, start = None, (0, 0), 0
    close = raw.find(THINK_CLOSE) if reasoning else -1
    if close >= 0:
        opened = raw.find(THINK_OPEN, 0, close)
        if opened < 0 or not raw[:opened].strip():
            r_span = _strip_span(raw, opened + len(THINK_OPEN) if opened >= 0 else 0, close)
            r, start = raw[r_span[0]:r_span[1]], close + len(THINK_CLOSE)
    rest = raw[start:]
    _, calls = parse_tool_calls(rest, prefix) if parse_calls else (rest, [])
    if calls:
        t_span = _strip_span(raw, start, start + rest.index("<tool_call>"))
    else:
        t_span = (_strip_span(raw, start, len(raw))[0] if r is not None else start, len(raw))
    return Generation(raw, r, r_span, raw[t_span[0]:t_span[1]], t_span, calls, start if r is not None else 0)


def with_reasoning(reasoning: str | None, content: str) -> str:
    """An assistant turn's content with its reasoning inline, as read_generation reads it and Qwen-style
    templates render it (a template that drops old reasoning drops it)."""
    return content if reasoning is None else f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"


def loads(text: str, default):
    try:
        return json.loads(text)
    except ValueError:
        return default


def custom_input(arguments: str) -> str:
    """A free-form (custom) tool's input from the call the model wrote: its `input` string, else the text."""
    args = loads(arguments, arguments)
    if isinstance(args, dict) and isinstance(args.get("input"), str):
        return args["input"]
    return args if isinstance(args, str) else arguments


# ---- replies ------------------------------------------------------------------------------------------------
def token_pieces(tok, choice) -> list[str]:
    """The completion's per-token text, whose concatenation is its text (one piece where a character spans
    tokens): for streams and logprobs only, a decode per token costs."""
    ids, n = choice.stream.ids, len(choice.ids)
    pieces = [decode_continuation(tok, ids[max(k - 4, 0):k], [ids[k]], skip_special=True)
              for k in range(len(ids) - n, len(ids))]
    return pieces if "".join(pieces) == choice.text else [choice.text] + [""] * (n - 1)


def span_pieces(pieces: list[str], span: tuple[int, int], offset: int = 0) -> list[tuple[str, int]]:
    """The parts of per-token `pieces` (starting at `offset` of the raw text) inside `span`, each with its
    token's index: a part's stream deltas."""
    out, pos = [], offset
    for i, p in enumerate(pieces):
        lo, hi = max(span[0], pos), min(span[1], pos + len(p))
        if lo < hi:
            out.append((p[lo - pos:hi - pos], i))
        pos += len(p)
    return out


def logprob_entry(piece: str, lp: float) -> dict:
    return {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}


def new_id(prefix: str, sep: str = "_") -> str:
    return f"{prefix}{sep}{secrets.token_hex(12)}"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_events(payloads) -> bytes:
    """Events named by their payload's `type` (the Responses and Messages streams)."""
    return b"".join(b"event: " + p["type"].encode() + b"\n" + sse(p) for p in payloads)
