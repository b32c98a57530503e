"""Anthropic Messages wire format for the proxy (POST /v1/messages): validation, conversion, bodies,
events and errors; no I/O.

A Messages call becomes a chat call: `system` and the content blocks are converted to chat
messages, rendered with the model's chat template and sent token-in/token-out through the
trajectory's Session, exactly like /chat/completions (same recording, same prefix reuse).

    block (role)                      chat message
    text (user | assistant)           the turn's content (blocks joined)
    thinking (assistant)              `<think>\\n...\\n</think>\\n\\n` before the turn's text (what the model wrote)
    tool_use {id, name, input}        a tool call of the assistant turn
    tool_result {tool_use_id, ...}    a tool message, before the user turn's text; `is_error: true`
                                      prefixes the result with "Error: "; its tool_use_id must name a
                                      tool_use of the previous assistant message

Honoured: `system` (string or text blocks) and `role: "system"` messages inside `messages`
(rendered as the template's system turns, where they stand), `messages`, `tools` (custom tools
with `input_schema`), `tool_choice` auto | none | any | {"type": "tool", "name"} (any / tool are
honoured by ending the prompt with the template's tool-call opening: the model must continue a
call), `stop_sequences` (the one matched is `stop_sequence`), `max_tokens` (required; clamped to
what the rollout and the context allow, never refused: stages/agentflow/limits.py),
`temperature`, `top_p`, `stream`.
Accepted and recorded as notes, not honoured: `top_k`, `output_config` (effort, format),
`context_management` (the history is served as sent), `thinking` (the model thinks or not as it
was trained), `container`, `mcp_servers`, `inference_geo`, `speed`, any field this proxy does not
know; blocks a text model cannot read (image, document, search_result, redacted_thinking, server
tools' blocks, unknown block types) are dropped from the prompt; tools other than custom ones
(server tools such as web_search, Anthropic-defined client tools) are dropped from the prompt.
Accepted silently: `model`, `metadata`, `service_tier`, `cache_control` on blocks.
Refused with a 400 naming the field: a malformed value of a known field, a final assistant message
(prefill).

Errors use Anthropic's body {"type": "error", "error": {"type", "message"}}, the message prefixed with
the field at fault; an over-long prompt reads "prompt is too long: N tokens > M maximum" and prompt +
max_tokens over the context "input length and `max_tokens` exceed context limit: ...", the wordings
Claude Code reacts to (compaction, a smaller max_tokens).
"""
from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field

from stages.agentflow.protocol import APIError, Generation, Request, number, span_pieces, unknown_fields, with_reasoning

SILENT = {"model", "metadata", "service_tier", "stream"}      # accepted: nothing about generation to honour
PARAMS = SILENT | {"messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "tools",
                   "tool_choice", "thinking", "output_config", "context_management", "container", "mcp_servers",
                   "inference_geo", "speed"}
COUNT_PARAMS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                "context_management", "mcp_servers"}
OBJECTS = ("metadata", "thinking", "output_config", "context_management")   # must be objects when given
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# ---- errors -------------------------------------------------------------------------------------------------
def error_response(e: APIError) -> tuple[int, dict]:
    """(status, body) of an error in Anthropic's format; an unavailable engine is 529 overloaded_error."""
    status = 529 if e.status == 503 else e.status
    msg = e.message if not e.param or e.message.startswith(e.param) else f"{e.param}: {e.message}"
    return status, {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": msg}}


def context_error(e: APIError, prompt_cap: int, context: int) -> APIError:
    """An over-context refusal in Anthropic's wording (e.tokens: prompt tokens and max_tokens)."""
    n, m = e.tokens
    if prompt_cap and n > prompt_cap:
        return _bad(f"prompt is too long: {n} tokens > {prompt_cap} maximum")
    return _bad(f"input length and `max_tokens` exceed context limit: {n} + {m} > {context}, decrease input "
                f"length or `max_tokens` and try again")


# ---- requests -------------------------------------------------------------------------------------------------
@dataclass
class MessagesRequest:
    call: Request                       # sampling, budget, chat messages and tools for the template
    forced: str | None = None           # "" (any tool) or a tool name: the prompt ends in a call
    tools: list[dict] = field(default_factory=list)


def parse_messages(body, defaults: dict, count_only: bool = False) -> MessagesRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    notes = unknown_fields(body, COUNT_PARAMS if count_only else PARAMS)
    requested = 1 if count_only else number(body, "max_tokens", None, 1, 1 << 62, integer=True)
    if requested is None:
        raise _bad("Field required", "max_tokens")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("must be a list of non-empty strings", "stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, (bool, type(None))):
        raise _bad("must be a boolean", "stream")
    for key in OBJECTS:
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise _bad("must be an object", key)
    notes += _not_honoured(body)
    tools = _tools(body.get("tools"), notes)
    forced = _tool_choice(body.get("tool_choice"), tools, notes)
    messages = to_messages(_system(body.get("system")), body.get("messages"), notes)
    call = Request(n=1, max_tokens=requested, temperature=float(number(body, "temperature", defaults["temperature"],
                                                                       0, 1)),
                   top_p=float(number(body, "top_p", defaults["top_p"], 1e-6, 1)), stop=stops, logprobs=False,
                   stream=bool(stream), include_usage=False, model=str(body.get("model") or "loongsage"),
                   requested=requested, messages=messages, notes=notes,
                   tools=None if forced == "none" else [_chat_tool(t) for t in tools] or None)
    return MessagesRequest(call, None if forced == "none" else forced, tools)


def _not_honoured(body: dict) -> list[str]:
    """Notes for the fields that would change generation here but cannot (recorded with the trajectory)."""
    notes = []
    if body.get("top_k") is not None:
        notes.append(f"'top_k'={body['top_k']!r} not honoured: the engine samples with temperature and top_p")
    for key, what in (("output_config", "output_config"), ("context_management", "context_management edits"),
                      ("container", "container"), ("mcp_servers", "mcp_servers")):
        if body.get(key):
            notes.append(f"{what} {_brief(body[key])} accepted, not applied")
    return notes


def _brief(v) -> str:
    text = json.dumps(v, separators=(",", ":"))
    return text if len(text) <= 120 else text[:117] + "..."


def _system(system) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    if isinstance(system, list):
        return _texts(system, "system") or None
    raise _bad("must be a string or a list of text blocks", "system")


def _tools(tools, notes: list[str]) -> list[dict]:
    """The custom tools (the only ones a text model can be told about); others are dropped, noted."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("must be a list of tools", "tools")
    kept = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _bad("a tool must be an object", f"tools[{i}]")
        if t.get("type", "custom") != "custom":
            notes.append(f"tools[{i}]: a {t.get('type')!r} tool ({t.get('name')!r}) cannot be served here: "
                         f"dropped from the prompt")
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad("must be a non-empty string", f"tools[{i}].name")
        if not isinstance(t.get("input_schema"), dict):
            raise _bad("Field required (a JSON schema object)", f"tools[{i}].input_schema")
        kept.append(t)
    return kept


def _chat_tool(t: dict) -> dict:
    return {"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                             "parameters": t["input_schema"]}}


def _tool_choice(choice, tools: list[dict], notes: list[str]) -> str | None:
    """None (auto), "none", "" (any tool) or the forced tool's name."""
    if choice is None:
        return None
    if isinstance(choice, dict) and choice.get("type") == "tool" and not any(t["name"] == choice.get("name")
                                                                             for t in tools):
        notes.append(f"tool_choice names {choice.get('name')!r}, a tool not served here: served as auto")
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return None if kind == "auto" else "none"
    if kind in ("any", "tool") and not tools:
        raise _bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "any":
        return ""
    names = [t["name"] for t in tools]
    if kind == "tool" and choice.get("name") in names:
        return choice["name"]
    raise _bad(f"must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or {{\"type\": \"tool\", \"name\": one of "
               f"{names}}}, got {choice!r}", "tool_choice")


# ---- messages -> chat messages ----------------------------------------------------------------------------------
def to_messages(system: str | None, messages, notes: list[str]) -> list[dict]:
    """Chat messages for Messages' `system` and `messages`; a `role: "system"` message (Claude Code sends
    them mid-conversation) becomes a system turn where it stands."""
    if not isinstance(messages, list) or not messages:
        raise _bad("must be a non-empty list of messages", "messages")
    out = [{"role": "system", "content": system}] if system else []
    open_calls: set[str] = set()        # tool_use ids of the previous assistant message
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise _bad("role must be 'user', 'assistant' or 'system'", f"{where}.role")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if m["role"] == "system":
            out.append({"role": "system", "content": _texts(blocks, f"{where}.content", notes)})
        elif m["role"] == "assistant":
            msg = _assistant(blocks, f"{where}.content", notes)
            out.append(msg)
            open_calls = {c["id"] for c in msg.get("tool_calls", [])}
        else:
            out += _user(blocks, f"{where}.content", open_calls, notes)
            open_calls = set()
    if messages[-1]["role"] == "assistant":
        raise _bad("a final assistant message (prefill) is not supported: the last message must be the user's",
                   f"messages[{len(messages) - 1}].role")
    return out


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad("must be a string or a list of content blocks", where)
    for j, b in enumerate(content):
        if not isinstance(b, dict):
            raise _bad("a content block must be an object", f"{where}[{j}]")
    return content


def _dropped(b: dict, where: str, notes: list[str]) -> None:
    """A block a text model cannot read (image, document, server tool blocks, an unknown type): noted, dropped."""
    notes.append(f"{where}: a {b.get('type')!r} block dropped from the prompt (a text model reads text)")


def _field(b: dict, key: str, kind, where: str):
    v = b.get(key)
    if not isinstance(v, kind):
        raise _bad(f"Field required ({kind.__name__})" if v is None else f"must be a {kind.__name__}",
                   f"{where}.{key}")
    return v


def _texts(blocks: list, where: str, notes: list[str] | None = None) -> str:
    """The text of text blocks; with `notes`, other blocks are dropped and noted, else refused."""
    out = []
    for j, b in enumerate(blocks):
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str):
            out.append(b["text"])
        elif notes is not None and isinstance(b, dict):
            _dropped(b, f"{where}[{j}]", notes)
        else:
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(f"only text blocks are supported here, got {kind!r}", f"{where}[{j}]")
    return "".join(out)


def _assistant(blocks: list[dict], where: str, notes: list[str]) -> dict:
    thinking, texts, calls = [], [], []
    for j, b in enumerate(blocks):
        at, kind = f"{where}[{j}]", b.get("type")
        if kind == "text":
            texts.append(_field(b, "text", str, at))
        elif kind == "thinking":
            thinking.append(_field(b, "thinking", str, at))
        elif kind == "tool_use":
            call_id, name, args = _field(b, "id", str, at), _field(b, "name", str, at), _field(b, "input", dict, at)
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}})
        else:
            _dropped(b, at, notes)
    msg = {"role": "assistant", "content": with_reasoning("".join(thinking) if thinking else None, "".join(texts))}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list[dict], where: str, open_calls: set[str], notes: list[str]) -> list[dict]:
    results, texts = [], []
    for j, b in enumerate(blocks):
        at, kind = f"{where}[{j}]", b.get("type")
        if kind == "text":
            texts.append(_field(b, "text", str, at))
        elif kind == "tool_result":
            call_id = _field(b, "tool_use_id", str, at)
            if call_id not in open_calls:
                raise _bad(f"tool_result for {call_id!r} has no matching tool_use block in the previous "
                           f"(assistant) message", f"{at}.tool_use_id")
            content = b.get("content")
            text = content if isinstance(content, str) else "" if content is None else \
                _texts(content, f"{at}.content", notes) if isinstance(content, list) else None
            if text is None:
                raise _bad("must be a string or a list of text blocks", f"{at}.content")
            results.append({"role": "tool", "tool_call_id": call_id,
                            "content": "Error: " + text if b.get("is_error") else text})
        else:
            _dropped(b, at, notes)
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


# ---- responses ------------------------------------------------------------------------------------------------
@dataclass
class Reply:
    """A message's content blocks, with each block's stream deltas as (text, token index)."""
    blocks: list[dict]
    deltas: list[list[tuple[str, int]]]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients pass it back; the proxy never needs to check it)."""
    return "loongsage:" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def reply(gen: Generation, pieces: list[str], offset: int) -> Reply:
    blocks, deltas = [], []
    if gen.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": gen.reasoning, "signature": signature(gen.reasoning)})
        deltas.append(span_pieces(pieces, gen.reasoning_span, offset))
    if gen.text or not gen.calls:
        blocks.append({"type": "text", "text": gen.text})
        deltas.append(span_pieces(pieces, gen.text_span, offset) if not gen.calls else [(gen.text, -1)])
    for c in gen.calls:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = c["function"]["arguments"]
        # tool input must be an object: a call whose arguments are not one keeps them under "arguments"
        blocks.append({"type": "tool_use", "id": tool_use_id(c["id"]),
                       "name": c["function"]["name"], "input": args if isinstance(args, dict) else {"arguments": args}})
        deltas.append([(json.dumps(blocks[-1]["input"]), -1)])
    return Reply(blocks, deltas)


def tool_use_id(call_id: str) -> str:
    """A tool call's id as a tool_use block carries it."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(gen: Generation, finish: str, stop_sequence: str | None) -> str:
    if finish == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if gen.calls else "end_turn"


def message_body(model: str, rep: Reply, reason: str, stop_sequence: str | None, prompt_tokens: int,
                 output_tokens: int) -> dict:
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": model, "content": rep.blocks,
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def stream_events(body: dict, rep: Reply):
    """The SSE payloads of a streamed message (each is sent as `event: <type>`)."""
    yield {"type": "message_start", "message": body | {"content": [], "stop_reason": None, "stop_sequence": None,
                                                       "usage": body["usage"] | {"output_tokens": 0}}}
    yield {"type": "ping"}
    for i, (block, deltas) in enumerate(zip(body["content"], rep.deltas)):
        kind = block["type"]
        shell = {"text": {"type": "text", "text": ""},
                 "thinking": {"type": "thinking", "thinking": "", "signature": ""},
                 "tool_use": block | {"input": {}}}[kind]
        yield {"type": "content_block_start", "index": i, "content_block": shell}
        for d, _ in deltas:
            delta = {"text": {"type": "text_delta", "text": d}, "thinking": {"type": "thinking_delta", "thinking": d},
                     "tool_use": {"type": "input_json_delta", "partial_json": d}}[kind]
            yield {"type": "content_block_delta", "index": i, "delta": delta}
        if kind == "thinking":
            yield {"type": "content_block_delta", "index": i,
                   "delta": {"type": "signature_delta", "signature": block["signature"]}}
        yield {"type": "content_block_stop", "index": i}
    yield {"type": "message_delta",
           "delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
           "usage": {"output_tokens": body["usage"]["output_tokens"]}}
    yield {"type": "message_stop"}
