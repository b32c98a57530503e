"""OpenAI Responses wire format for the proxy (POST /v1/responses): validation, conversion, bodies, events; no I/O.

A Responses call becomes a chat call: its input items are converted to chat messages, rendered
with the model's chat template and sent token-in/token-out through the trajectory's Session,
exactly like /chat/completions (same recording, same prefix reuse).

    input item                          chat message
    message user|system|developer       user | system (developer -> system), content parts joined
    message assistant                   assistant (output_text parts joined)
    reasoning (content, else summary)   `<think>\\n...\\n</think>\\n\\n` before the next assistant turn
    function_call {call_id, name, ...}  a tool call of the assistant turn it follows (or a new one)
    function_call_output {call_id, ...} tool message (its call_id must name an earlier function_call)

Supported: `input` (string or items), `instructions` (a leading system message, not carried over by
`previous_response_id`, as documented), function `tools`, `tool_choice` auto | none | required |
{"type": "function", "name"} (a forced choice is honoured by ending the prompt with the template's
tool-call opening), `max_output_tokens`, `temperature`, `top_p`, `stream`, `previous_response_id`
(this trajectory's stored responses; an unknown id is 400 previous_response_not_found, as OpenAI
answers), `store` (default true), `include` of `reasoning.encrypted_content` (the reasoning text,
opaque to the client, read back when a client resends it without content) and
`message.output_text.logprobs`. Accepted with no effect: `model`, `metadata`, `user`,
`parallel_tool_calls`, `reasoning`, `service_tier`, `prompt_cache_key`, `safety_identifier`,
`max_tool_calls`, `stream_options`, text verbosity. Refused with a 400 naming the parameter:
built-in tools, non-text content, non-text output formats, `truncation: auto`, `background`,
`top_logprobs`, and any other item type.

Model output becomes output items: a `reasoning` item when the text opens with `<think>`, a
`message`, then one `function_call` per `<tool_call>` block. A completion cut by the token budget
is `status: incomplete` (`incomplete_details.reason: max_output_tokens`; the stream ends with
`response.incomplete`, as OpenAI's does).
"""
from __future__ import annotations

import base64
import secrets
import time
from dataclasses import dataclass, field

from stages.agentflow.openai_api import (
    APIError,
    Generation,
    Request,
    _number,
    span_pieces,
    tokens_before,
    with_reasoning,
)

PARAMS = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
          "stream", "previous_response_id", "store", "include", "metadata", "user", "parallel_tool_calls",
          "reasoning", "text", "truncation", "background", "service_tier", "prompt_cache_key", "safety_identifier",
          "max_tool_calls", "stream_options", "top_logprobs"}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = {"input_text", "output_text", "text"}
ENCRYPTED = "loongsage:"   # our reasoning.encrypted_content: the reasoning text, base64


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class ResponsesRequest:
    call: Request                                   # sampling and budget for the engine call
    items: list[dict]                               # this request's input, normalised (see _item)
    instructions: str | None
    tools: list[dict] = field(default_factory=list)  # Responses form, echoed in the response
    tool_choice: str | dict = "auto"
    forced: str | None = None                       # "" (any tool) or a function name: prompt ends in a call
    previous_response_id: str | None = None
    store: bool = True
    encrypted: bool = False                         # include reasoning.encrypted_content
    logprobs: bool = False                          # include message.output_text.logprobs
    max_output_tokens: int | None = None
    metadata: dict = field(default_factory=dict)


def parse_responses(body, defaults: dict, max_tokens_cap: int) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - PARAMS)
    if unknown:
        raise _bad(f"Unknown parameter: '{unknown[0]}'.", unknown[0], "unknown_parameter")
    _refuse(body)
    limit = _number(body, "max_output_tokens", None, 1, 1 << 20, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    store = body.get("store", True)
    if not isinstance(store, (bool, type(None))):
        raise _bad("'store' must be a boolean", "store")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise _bad("'include' must be a list of strings", "include")
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev):
        raise _bad("'previous_response_id' must be a non-empty string", "previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise _bad("'metadata' must be an object", "metadata")
    tools, chat_tools = _tools(body.get("tools"))
    choice, forced = _tool_choice(body.get("tool_choice"), tools)
    call = Request(n=1, max_tokens=limit if limit is not None else max_tokens_cap,
                   temperature=float(_number(body, "temperature", defaults["temperature"], 0, 2)),
                   top_p=float(_number(body, "top_p", defaults["top_p"], 1e-6, 1)), stop=[], logprobs=False,
                   stream=stream, include_usage=False, model=str(body.get("model") or "loongsage"),
                   max_tokens_set=limit is not None, tools=None if choice == "none" else chat_tools or None)
    return ResponsesRequest(call, _items(body.get("input")), instructions or None, tools, choice, forced, prev,
                            store is not False, "reasoning.encrypted_content" in include,
                            "message.output_text.logprobs" in include, limit, metadata)


def _refuse(body: dict) -> None:
    """Parameters whose only value we can honour is their default."""
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else body.get("text")
    if fmt not in (None, {"type": "text"}):
        raise _bad("only text output is supported ('text.format' must be {\"type\": \"text\"})", "text.format")
    for key, ok in (("truncation", ("disabled", None)), ("background", (False, None)), ("top_logprobs", (0, None))):
        if body.get(key) not in ok:
            raise _bad(f"'{key}'={body[key]!r} is not supported by this endpoint", key)


def _tools(tools) -> tuple[list[dict], list[dict]]:
    """(tools as sent, chat-form tools for the template). Only function tools reach a text model."""
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    chat = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise _bad(f"tools[{i}]: only function tools are supported, got {kind!r}", f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        fn = {"name": t["name"], "description": t.get("description") or "",
              "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        chat.append({"type": "function", "function": fn})
    return tools, chat


def _tool_choice(choice, tools: list[dict]) -> tuple[str | dict, str | None]:
    if choice in (None, "auto", "none"):
        return choice or "auto", None
    if not tools:
        raise _bad("'tool_choice' other than auto/none needs 'tools'", "tool_choice")
    if choice == "required":
        return choice, ""
    names = {t["name"] for t in tools}
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name") in names:
        return choice, choice["name"]
    raise _bad(f"'tool_choice' must be auto, none, required or {{\"type\": \"function\", \"name\": <one of "
               f"{sorted(names)}>}}, got {choice!r}", "tool_choice")


# ---- input items -------------------------------------------------------------------------------------
def _items(value) -> list[dict]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad("'input' must be a string or a list of input items", "input")
    return [_item(it, f"input[{i}]") for i, it in enumerate(value)]


def _item(it, where: str) -> dict:
    """One input item, normalised: {type: message, role, content: str} | {type: function_call, call_id,
    name, arguments} | {type: function_call_output, call_id, output} | {type: reasoning, text}."""
    if not isinstance(it, dict):
        raise _bad(f"{where} must be an object", where)
    kind = it.get("type", "message" if "role" in it else None)
    if kind == "message":
        role = it.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        return {"type": "message", "role": ROLES[role], "content": _text(it.get("content"), f"{where}.content")}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(it.get(key), str):
                raise _bad(f"{where}.{key} must be a string", f"{where}.{key}")
        return {"type": kind, "call_id": it["call_id"], "name": it["name"], "arguments": it["arguments"]}
    if kind == "function_call_output":
        if not isinstance(it.get("call_id"), str):
            raise _bad(f"{where}.call_id must be a string", f"{where}.call_id")
        return {"type": kind, "call_id": it["call_id"], "output": _text(it.get("output"), f"{where}.output")}
    if kind == "reasoning":
        return {"type": kind, "text": _reasoning_text(it, where)}
    raise _bad(f"{where}: unsupported input item type {kind!r}; this endpoint accepts message, function_call, "
               f"function_call_output and reasoning items", f"{where}.type")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]: only text parts (input_text, output_text) are supported, got {kind!r}",
                       f"{where}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(it: dict, where: str) -> str:
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = it.get(key)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise _bad(f"{where}.{key} must be a list of {kind} parts", f"{where}.{key}")
            return "".join(p["text"] for p in parts)
    enc = it.get("encrypted_content")
    if isinstance(enc, str) and enc.startswith(ENCRYPTED):
        try:
            return base64.b64decode(enc[len(ENCRYPTED):], validate=True).decode()
        except ValueError:
            raise _bad(f"{where}.encrypted_content is corrupt", f"{where}.encrypted_content") from None
    return ""


def to_messages(instructions: str | None, items: list[dict], first_new: int = 0) -> list[dict]:
    """Chat messages for normalised items. Items before `first_new` came from previous_response_id; an
    error in one of the request's own items names it as input[i]."""
    msgs = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: str | None = None
    calls: set[str] = set()
    for k, it in enumerate(items):
        where = f"input[{k - first_new}]" if k >= first_new else "previous_response_id"
        kind = it["type"]
        if kind == "reasoning":
            reasoning = it["text"] if reasoning is None else reasoning + it["text"]
        elif kind == "message" and it["role"] != "assistant":
            msgs.append({"role": it["role"], "content": it["content"]})
        elif kind == "message":
            msgs.append({"role": "assistant", "content": with_reasoning(reasoning, it["content"])})
            reasoning = None
        elif kind == "function_call":
            last = msgs[-1] if msgs else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = {"role": "assistant", "content": with_reasoning(reasoning, "")}
                msgs.append(last)
                reasoning = None
            fn = {"name": it["name"], "arguments": it["arguments"]}
            last.setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": fn})
            calls.add(it["call_id"])
        else:   # function_call_output
            if it["call_id"] not in calls:
                raise _bad(f"No tool call found for function call output with call_id {it['call_id']}.",
                           f"{where}.call_id")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    if reasoning is not None:
        msgs.append({"role": "assistant", "content": with_reasoning(reasoning, "")})
    if not msgs:
        raise _bad("'input' must hold at least one item", "input")
    return msgs


# ---- output -----------------------------------------------------------------------------------------------
@dataclass
class Output:
    """One response's output: the wire items, the same as normalised input items (stored for
    previous_response_id), and each wire item's stream deltas as (text, token index)."""
    wire: list[dict]
    items: list[dict]
    deltas: list[list[tuple[str, int]]]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def output(gen: Generation, pieces: list[str], offset: int, logprobs: list[float], req: ResponsesRequest,
           status: str) -> Output:
    """Output items of a generation (`pieces`: per-token text of the model's part, which starts at
    `offset` of gen.raw: a forced tool choice's prefill comes before it)."""
    wire, items, deltas = [], [], []
    if gen.reasoning is not None:
        item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": gen.reasoning}]}
        if req.encrypted:
            item["encrypted_content"] = ENCRYPTED + base64.b64encode(gen.reasoning.encode()).decode()
        wire.append(item)
        items.append({"type": "reasoning", "text": gen.reasoning})
        deltas.append(span_pieces(pieces, gen.reasoning_span, offset))
    if gen.text or not gen.calls:
        parts = span_pieces(pieces, gen.text_span, offset)
        text = {"type": "output_text", "text": gen.text, "annotations": []}
        if req.logprobs:
            text["logprobs"] = [_lp(p, logprobs[i]) for p, i in parts if i < len(logprobs)]
        wire.append({"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
                     "content": [text]})
        items.append({"type": "message", "role": "assistant", "content": gen.text})
        deltas.append(parts if not gen.calls else [(gen.text, -1)])
    for c in gen.calls:
        call_id, fn = c["id"], c["function"]
        wire.append({"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": call_id,
                     "name": fn["name"], "arguments": fn["arguments"]})
        items.append({"type": "function_call", "call_id": call_id, "name": fn["name"], "arguments": fn["arguments"]})
        deltas.append([(fn["arguments"], -1)])
    return Output(wire, items, deltas)


def _lp(piece: str, lp: float) -> dict:
    return {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}


def usage(prompt_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def reasoning_tokens(gen: Generation, pieces: list[str], offset: int) -> int:
    return tokens_before(pieces, gen.think_end - offset) if gen.think_end else 0


def response_body(resp_id: str, req: ResponsesRequest, out: Output, finish: str, use: dict) -> dict:
    incomplete = finish == "length"
    return {"id": resp_id, "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if incomplete else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.call.model,
            "output": out.wire, "parallel_tool_calls": True, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store, "temperature": req.call.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": req.tool_choice, "tools": req.tools,
            "top_p": req.call.top_p, "truncation": "disabled", "usage": use, "user": None, "metadata": req.metadata}


def stream_events(body: dict, out: Output, logprobs: list[float]):
    """The event sequence of a streamed response, each with `type` and `sequence_number`."""
    seq = iter(range(1 << 30))

    def ev(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    start = body | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    for n, (item, deltas) in enumerate(zip(body["output"], out.deltas)):
        at = {"item_id": item["id"], "output_index": n}
        if item["type"] == "function_call":
            shell = item | {"arguments": "", "status": "in_progress"}
            yield ev("response.output_item.added", output_index=n, item=shell)
            for d, _ in deltas:
                yield ev("response.function_call_arguments.delta", **at, delta=d)
            yield ev("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            yield ev("response.output_item.added", output_index=n, item=item | {"status": "in_progress", "content": []})
            yield ev("response.content_part.added", **at, content_index=0,
                     part={k: ([] if k in ("annotations", "logprobs") else "" if k == "text" else v)
                           for k, v in part.items()})
            for d, i in deltas:
                lp = [_lp(d, logprobs[i])] if "logprobs" in part and 0 <= i < len(logprobs) else []
                yield ev(f"response.{kind}.delta", **at, content_index=0, delta=d,
                         **({"logprobs": lp} if kind == "output_text" else {}))
            yield ev(f"response.{kind}.done", **at, content_index=0, text=part["text"],
                     **({"logprobs": part.get("logprobs", [])} if kind == "output_text" else {}))
            yield ev("response.content_part.done", **at, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=n, item=item)
    yield ev("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
