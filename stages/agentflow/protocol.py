"""What the protocol adapters share (Chat, Completions, Responses, Messages): no protocol's own format here.

Each adapter turns its request into ONE internal call, a `Request` (messages for the chat template,
tools, sampling, the harness's own token limit, request kind, stream or not, and `notes`: what the
request asked that the proxy accepted without honouring: an unknown field, a hosted tool, a content
block a text model cannot read), and turns the generation (`read_generation`: reasoning, text, tool
calls with their spans) back into its reply and events. Errors are `APIError`; each path renders it
in its protocol's format (stages/agentflow/proxy.py `_error`).

Bodies are read by `read_json`, which bounds JSON nesting (MAX_JSON_DEPTH): Python's parser recurses
per level, and a body nested 100,000 deep would otherwise end in a RecursionError (a 500).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from stages.agentflow.chat import THINK_CLOSE, THINK_OPEN, parse_tool_calls, render

MAX_JSON_DEPTH = 64     # arrays/objects inside each other; real requests use about 10 (a JSON schema in a tool)


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
    max_tokens: int                                      # the completion budget (clamped: stages/agentflow/limits.py)
    temperature: float
    top_p: float
    stop: list[str]
    logprobs: bool
    stream: bool
    include_usage: bool
    model: str
    seed: int | None = None                              # choice i samples with seed + i
    requested: int | None = None                         # the harness's own max_tokens (None: it set none)
    bound: str = "request"                               # what bound max_tokens: request | rollout | context | budget
    messages: list[dict] = field(default_factory=list)   # chat
    tools: list[dict] | None = None                      # chat; None = do not parse tool calls
    prompt: str | list[int] = ""                         # completions
    notes: list[str] = field(default_factory=list)       # accepted, not honoured: recorded with the trajectory
    forced: str | None = None                            # chat: "" (any tool) or a tool: the prompt ends in a call


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def number(body: dict, key: str, default, lo, hi, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise bad(f"'{key}' must be {kind} in [{lo}, {hi}], got {v!r}", key)
    return v


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_event(payload: dict) -> bytes:
    """An SSE event named by its payload's `type` (the Responses and Messages streams)."""
    return b"event: " + payload["type"].encode() + b"\n" + sse(payload)


# ---- a generation as the adapters present it ------------------------------------------------------------


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


def call_separator(tok) -> str:
    """What the chat template writes between an assistant turn's content and its first tool call (Qwen's: a
    newline; the fallback's: nothing), found by rendering one. A reply's content leaves it out, so the turn
    rendered back spells what the model wrote."""
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "PROBE", "tool_calls": [call]}]
    try:
        turn = render(tok, msgs, generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that cannot render a tool call separates nothing
        return ""
    i = turn.rfind("PROBE")
    j = turn.find("<tool_call>", i)
    return turn[i + len("PROBE"):j] if 0 <= i < j else ""


def custom_input(arguments: str) -> str:
    """A free-form (custom) tool's input from the call the model wrote: its `input` string, else the text."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(args, dict) and isinstance(args.get("input"), str):
        return args["input"]
    return args if isinstance(args, str) else arguments


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


# ---- reading bodies -------------------------------------------------------------------------------------------
def read_json(raw: bytes):
    """The body as JSON, or a 400: malformed, or nested deeper than MAX_JSON_DEPTH."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise too_deep() from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if _depth_over(obj, MAX_JSON_DEPTH):
        raise too_deep()
    return obj


def too_deep() -> APIError:
    return APIError(400, f"the request body nests JSON arrays/objects more than {MAX_JSON_DEPTH} levels deep")


def _depth_over(obj, limit: int) -> bool:
    """Whether containers nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if d > limit:
            return True
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return False


def unknown_fields(body: dict, known: set, where: str = "") -> list[str]:
    """Notes for the fields of `body` this proxy does not know: accepted and recorded, never a 400."""
    return [f"ignored unknown field '{where}{k}'" for k in sorted(set(body) - known)]
