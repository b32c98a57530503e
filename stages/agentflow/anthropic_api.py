"""Anthropic Messages (POST /v1/messages): a body read into a `Request`, the choice rendered as the reply, its
events and errors; no I/O.

`system` and `role: "system"` messages (Claude Code sends them mid-conversation) are system turns where they
stand; a final assistant message (prefill) is refused. Errors are Anthropic's body, the message prefixed with the
field at fault; a prompt over the limit reads "prompt is too long: N tokens > M maximum", one leaving no room
"input length and `max_tokens` exceed context limit: ...", the wordings Claude Code reacts to (it compacts, or asks
less). What is honoured, and what only noted: docs/harnesses.md.
"""
from __future__ import annotations

import hashlib
import json

from stages.agentflow.chat import text_of
from stages.agentflow.protocol import (
    APIError,
    Fields,
    Protocol,
    Request,
    bad,
    loads,
    new_id,
    span_pieces,
    sse_events,
    token_pieces,
    with_reasoning,
)

PARAMS = {"model", "metadata", "service_tier", "stream", "messages", "system", "max_tokens", "stop_sequences",
          "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking", "output_config", "context_management",
          "container", "mcp_servers", "inference_geo", "speed"}
COUNT_PARAMS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                "context_management", "mcp_servers"}
OBJECTS = ("metadata", "thinking", "output_config", "context_management")   # must be objects when given
NOT_APPLIED = {"output_config": "output_config", "context_management": "context_management edits",
               "container": "container", "mcp_servers": "mcp_servers"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 529: "overloaded_error"}    # the statuses the proxy answers; else api_error


def error_response(e: APIError) -> tuple[int, dict]:
    """(status, body) of an error in Anthropic's format; an unavailable engine is 529 overloaded_error."""
    if e.code == "context_length_exceeded" and e.tokens:
        n, m, cap, context = e.tokens
        e = bad(f"prompt is too long: {n} tokens > {cap} maximum" if cap and n > cap else
                f"input length and `max_tokens` exceed context limit: {n} + {m} > {context}, decrease input "
                f"length or `max_tokens` and try again")
    status = 529 if e.status == 503 else e.status
    msg = e.message if not e.param or e.message.startswith(e.param) else f"{e.param}: {e.message}"
    return status, {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": msg}}


def parse_messages(body, session=None, count_only: bool = False) -> Request:
    f = Fields(body, COUNT_PARAMS if count_only else PARAMS)
    requested = 1 if count_only else f.tokens("max_tokens")
    if requested is None:
        raise bad("Field required", "max_tokens")
    stops = f.body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("must be a list of non-empty strings", "stop_sequences")
    stream = f.flag("stream", message="must be a boolean")
    for key in OBJECTS:
        if f.body.get(key) is not None and not isinstance(f.body[key], dict):
            raise bad("must be an object", key)
    if f.body.get("top_k") is not None:
        f.notes.append(f"'top_k'={f.body['top_k']!r} not honoured: the engine samples with temperature and top_p")
    for key, what in NOT_APPLIED.items():
        if f.body.get(key):
            brief = json.dumps(f.body[key], separators=(",", ":"))
            f.notes.append(f"{what} {brief if len(brief) <= 120 else brief[:117] + '...'} accepted, not applied")
    tools = _tools(f.body.get("tools"), f.notes)
    forced = _tool_choice(f.body.get("tool_choice"), tools, f.notes)
    return f.request(messages=to_messages(f.body.get("system"), f.body.get("messages"), f.notes),
                     tools=None if forced == "none" else tools or None, stop=stops,
                     forced=None if forced == "none" else forced, requested=requested, stream=stream, reasoning=True,
                     call_prefix="toolu_", top_temperature=1)


def _tools(tools, notes: list[str]) -> list[dict]:
    """The custom tools (the only ones a text model can be told about) as chat tools; others are dropped, noted."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("must be a list of tools", "tools")
    kept = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad("a tool must be an object", f"tools[{i}]")
        if t.get("type", "custom") != "custom":
            notes.append(f"tools[{i}]: a {t.get('type')!r} tool ({t.get('name')!r}) cannot be served here: "
                         f"dropped from the prompt")
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad("must be a non-empty string", f"tools[{i}].name")
        if not isinstance(t.get("input_schema"), dict):
            raise bad("Field required (a JSON schema object)", f"tools[{i}].input_schema")
        kept.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                       "parameters": t["input_schema"]}})
    return kept


def _tool_choice(choice, tools: list[dict], notes: list[str]) -> str | None:
    """None (auto), "none", "" (any tool) or the forced tool's name."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    names = [t["function"]["name"] for t in tools]
    if kind == "tool" and choice.get("name") not in names:
        notes.append(f"tool_choice names {choice.get('name')!r}, a tool not served here: served as auto")
    elif kind == "any" and not tools:
        raise bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    elif kind in ("any", "tool", "none"):
        return {"any": "", "none": "none"}.get(kind, choice.get("name"))
    elif choice is not None and kind != "auto":
        raise bad(f"must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or {{\"type\": \"tool\", \"name\": one of "
                  f"{names}}}, got {choice!r}", "tool_choice")
    return None


# ---- messages -> chat messages ----------------------------------------------------------------------------------
def to_messages(system, messages, notes: list[str]) -> list[dict]:
    """Chat messages: an assistant's thinking goes inline before its text, its tool_use blocks are its tool calls;
    a user's tool_results (each answering a tool_use of the previous message; `is_error` prefixes "Error: ") are
    tool messages before its text."""
    system = None if system is None else text_of(system, "system", noun="block")
    if not isinstance(messages, list) or not messages:
        raise bad("must be a non-empty list of messages", "messages")
    out = [{"role": "system", "content": system}] if system else []
    open_calls: set[str] = set()        # tool_use ids of the previous assistant message
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad("role must be 'user', 'assistant' or 'system'", f"messages[{i}].role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad("must be a string or a list of content blocks", where)
        for j, b in enumerate(blocks):
            if not isinstance(b, dict):
                raise bad("a content block must be an object", f"{where}[{j}]")
        if m["role"] == "system":
            out.append({"role": "system", "content": text_of(blocks, where, notes, noun="block")})
            continue
        role, texts, thinking, calls, results = m["role"], [], [], [], []
        for j, b in enumerate(blocks):
            at, kind = f"{where}[{j}]", b.get("type")
            if kind == "text":
                texts.append(_field(b, "text", str, at))
            elif kind == "thinking" and role == "assistant":
                thinking.append(_field(b, "thinking", str, at))
            elif kind == "tool_use" and role == "assistant":
                call_id, name, args = _field(b, "id", str, at), _field(b, "name", str, at), _field(b, "input", dict, at)
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args)}})
            elif kind == "tool_result" and role == "user":
                call_id = _field(b, "tool_use_id", str, at)
                if call_id not in open_calls:
                    raise bad(f"tool_result for {call_id!r} has no matching tool_use block in the previous "
                              f"(assistant) message", f"{at}.tool_use_id")
                text = "" if b.get("content") is None else text_of(b["content"], f"{at}.content", notes, noun="block")
                results.append({"role": "tool", "tool_call_id": call_id,
                                "content": "Error: " + text if b.get("is_error") else text})
            else:
                notes.append(f"{at}: a {kind!r} block dropped from the prompt (a text model reads text)")
        if role == "assistant":
            content = with_reasoning("".join(thinking) if thinking else None, "".join(texts))
            out.append({"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {}))
        else:
            out += results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
        open_calls = {c["id"] for c in calls}
    if messages[-1]["role"] == "assistant":
        raise bad("a final assistant message (prefill) is not supported: the last message must be the user's",
                  f"messages[{len(messages) - 1}].role")
    return out


def _field(b: dict, key: str, kind, where: str):
    v = b.get(key)
    if not isinstance(v, kind):
        raise bad(f"Field required ({kind.__name__})" if v is None else f"must be a {kind.__name__}", f"{where}.{key}")
    return v


# ---- the reply ------------------------------------------------------------------------------------------------
def respond(req: Request, choices, session) -> dict | bytes:
    (c,) = choices
    gen, pieces = c.gen, token_pieces(session.tok, c) if req.stream else []
    blocks, deltas = [], []     # each block's stream deltas as (text, token index)
    if gen.reasoning is not None:   # its signature is opaque: clients pass it back, the proxy never checks it
        sig = "loongsage:" + hashlib.sha256(gen.reasoning.encode()).hexdigest()[:32]
        blocks.append({"type": "thinking", "thinking": gen.reasoning, "signature": sig})
        deltas.append(span_pieces(pieces, gen.reasoning_span, gen.offset))
    if gen.text or not gen.calls:
        blocks.append({"type": "text", "text": gen.text})
        deltas.append(span_pieces(pieces, gen.text_span, gen.offset) if not gen.calls else [(gen.text, -1)])
    for call in gen.calls:
        args = loads(call["function"]["arguments"], call["function"]["arguments"])
        # tool input must be an object: a call whose arguments are not one keeps them under "arguments"
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": args if isinstance(args, dict) else {"arguments": args}})
        deltas.append([(json.dumps(blocks[-1]["input"]), -1)])
    reason = "max_tokens" if c.finish_reason == "length" else "stop_sequence" if c.stop is not None else \
        "tool_use" if gen.calls else "end_turn"
    body = {"id": new_id("msg"), "type": "message", "role": "assistant", "model": req.model, "content": blocks,
            "stop_reason": reason, "stop_sequence": c.stop,
            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": len(c.ids),
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
    return sse_events(_events(body, deltas)) if req.stream else body


def _events(body: dict, deltas: list):
    yield {"type": "message_start", "message": body | {"content": [], "stop_reason": None, "stop_sequence": None,
                                                       "usage": body["usage"] | {"output_tokens": 0}}}
    yield {"type": "ping"}
    for i, (block, parts) in enumerate(zip(body["content"], deltas)):
        kind = block["type"]
        shell = {"text": {"type": "text", "text": ""}, "tool_use": block | {"input": {}},
                 "thinking": {"type": "thinking", "thinking": "", "signature": ""}}[kind]
        yield {"type": "content_block_start", "index": i, "content_block": shell}
        for d, _ in parts:
            delta = {"text": {"type": "text_delta", "text": d}, "thinking": {"type": "thinking_delta", "thinking": d},
                     "tool_use": {"type": "input_json_delta", "partial_json": d}}[kind]
            yield {"type": "content_block_delta", "index": i, "delta": delta}
        if kind == "thinking":
            yield {"type": "content_block_delta", "index": i,
                   "delta": {"type": "signature_delta", "signature": block["signature"]}}
        yield {"type": "content_block_stop", "index": i}
    yield {"type": "message_delta", "usage": {"output_tokens": body["usage"]["output_tokens"]},
           "delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}}
    yield {"type": "message_stop"}


MESSAGES = Protocol(parse_messages, respond, strict=True)
