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

Honoured: `input` (string or items), `instructions` (a leading system message, not carried over by
`previous_response_id`, as documented), `tools`, `tool_choice` auto | none | required |
{"type": "function" | "custom", "name"} (a forced choice is honoured by ending the prompt with the
template's tool-call opening), `max_output_tokens` (clamped, never refused:
stages/agentflow/limits.py), `temperature`, `top_p`, `stream`, `previous_response_id` (this
trajectory's stored responses; an unknown id is 400 previous_response_not_found, as OpenAI answers),
`store` (default true), `include` of `reasoning.encrypted_content` (the reasoning text, opaque to
the client, read back when a client resends it without content) and `message.output_text.logprobs`.

Tools (`Toolset`): `function` tools as they are; `namespace` tools (Codex) flattened to function
tools (named `namespace.name` where another tool has the name), the namespace given back on the call
(`function_call.namespace`);
`custom` tools (Codex's freeform tools, e.g. apply_patch) as a function of one string argument
`input`, grammar-free: the model's text is the input, given back as a `custom_tool_call`; hosted
tools (web_search, file_search, code_interpreter, image_generation, local_shell, mcp, ...) are not
servable here: dropped from the prompt with a note, never a 400. An `additional_tools` input item
adds its tools the same way.

Accepted and recorded as notes, not honoured: any field this proxy does not know (`client_metadata`,
...), `text.format` other than text, `truncation: auto`, `background`, `top_logprobs`, input items a
text model cannot use (web_search_call, image and file parts, compaction, ...: dropped from the
prompt). Accepted silently: `model`, `metadata`, `user`, `parallel_tool_calls`, `reasoning`,
`service_tier`, `prompt_cache_key`, `safety_identifier`, `max_tool_calls`, `stream_options`, text
verbosity. A malformed value of a known field is a 400 naming it.

Model output becomes output items: a `reasoning` item when the text opens with `<think>`, a
`message`, then one `function_call` per `<tool_call>` block. A completion cut by the token budget
is `status: incomplete` (`incomplete_details.reason: max_output_tokens`; the stream ends with
`response.incomplete`, as OpenAI's does).
"""
from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import dataclass, field

from stages.agentflow.protocol import (
    APIError,
    Generation,
    Request,
    custom_input,
    number,
    span_pieces,
    tokens_before,
    unknown_fields,
    with_reasoning,
)

PARAMS = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
          "stream", "previous_response_id", "store", "include", "metadata", "user", "parallel_tool_calls",
          "reasoning", "text", "truncation", "background", "service_tier", "prompt_cache_key", "safety_identifier",
          "max_tool_calls", "stream_options", "top_logprobs"}
CUSTOM_PARAMS = {"type": "object", "required": ["input"],       # a custom tool, as a function the model can call
                 "properties": {"input": {"type": "string", "description": "the tool's input, as text"}}}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = {"input_text", "output_text", "text"}
ENCRYPTED = "loongsage:"   # our reasoning.encrypted_content: the reasoning text, base64


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class Toolset:
    """The tools a text model is told about, as chat function tools, and how each prompt name maps back:
    prompt name -> (kind: function | custom, namespace or None, the name as the client knows it). A
    namespace's tool keeps its own name in the prompt unless another tool has it (then `namespace.name`)."""
    chat: list[dict] = field(default_factory=list)
    served: dict[str, tuple[str, str | None, str]] = field(default_factory=dict)
    names: dict[tuple[str | None, str], str] = field(default_factory=dict)   # (namespace, name) -> prompt name

    def add(self, tools, where: str, notes: list[str], namespace: str | None = None) -> None:
        if not isinstance(tools, list):
            raise _bad(f"'{where}' must be a list", where)
        for i, t in enumerate(tools):
            at = f"{where}[{i}]"
            kind = t.get("type") if isinstance(t, dict) else None
            if kind not in ("function", "custom", "namespace"):
                if not isinstance(kind, str):
                    raise _bad(f"{at} must be a tool object with a 'type'", f"{at}.type")
                notes.append(f"{at}: the hosted tool {kind!r} cannot be served here: dropped from the prompt")
                continue
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise _bad(f"{at}.name must be a non-empty string", f"{at}.name")
            if kind == "namespace":
                self.add(t.get("tools") or [], f"{at}.tools", notes, namespace=t["name"])
                continue
            name = t["name"] if t["name"] not in self.served else f"{namespace}.{t['name']}"
            self.names[(namespace, t["name"])] = name
            params = CUSTOM_PARAMS if kind == "custom" else t.get("parameters") or {"type": "object", "properties": {}}
            self.served[name] = (kind, namespace, t["name"])
            self.chat.append({"type": "function", "function": {"name": name, "description": t.get("description") or "",
                                                                "parameters": params}})

    def prompt_name(self, name: str, namespace: str | None = None) -> str:
        return self.names.get((namespace, name)) or (f"{namespace}.{name}" if namespace else name)


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
    toolset: Toolset = field(default_factory=Toolset)


def parse_responses(body, defaults: dict) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    notes = unknown_fields(body, PARAMS) + _not_honoured(body)
    limit = number(body, "max_output_tokens", None, 1, 1 << 62, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, (bool, type(None))):
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
    toolset = Toolset()
    if body.get("tools") is not None:
        toolset.add(body["tools"], "tools", notes)
    items = _items(body.get("input"), toolset, notes)     # additional_tools items add to the toolset
    choice, forced = _tool_choice(body.get("tool_choice"), toolset, notes)
    call = Request(n=1, max_tokens=limit or 0,
                   temperature=float(number(body, "temperature", defaults["temperature"], 0, 2)),
                   top_p=float(number(body, "top_p", defaults["top_p"], 1e-6, 1)), stop=[], logprobs=False,
                   stream=bool(stream), include_usage=False, model=str(body.get("model") or "loongsage"),
                   requested=limit, notes=notes, tools=None if choice == "none" else toolset.chat or None)
    return ResponsesRequest(call, items, instructions or None, body.get("tools") or [], choice, forced, prev,
                            store is not False, "reasoning.encrypted_content" in include,
                            "message.output_text.logprobs" in include, limit, metadata, toolset)


def _not_honoured(body: dict) -> list[str]:
    """Notes for parameters whose only value we can honour is their default."""
    notes = []
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else body.get("text")
    if fmt not in (None, {"type": "text"}):
        notes.append("'text.format' other than text accepted; the output is not constrained")
    for key, ok in (("truncation", ("disabled", None)), ("background", (False, None)), ("top_logprobs", (0, None))):
        if body.get(key) not in ok:
            notes.append(f"'{key}'={body[key]!r} accepted but not honoured")
    return notes


def _tool_choice(choice, toolset: Toolset, notes: list[str]) -> tuple[str | dict, str | None]:
    """(the choice as echoed, the forced prompt name: "" any tool, None auto)."""
    if choice in (None, "auto", "none"):
        return choice or "auto", None
    if choice == "required":
        if not toolset.chat:
            raise _bad("'tool_choice' other than auto/none needs 'tools'", "tool_choice")
        return choice, ""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        name = toolset.prompt_name(choice["name"], choice.get("namespace"))
        if name in toolset.served:
            return choice, name
        raise _bad(f"'tool_choice' names {choice['name']!r}, which is not one of the tools", "tool_choice")
    if isinstance(kind, str):       # allowed_tools, a hosted tool's type, mcp: served as auto
        notes.append(f"'tool_choice' {kind!r} served as auto")
        return "auto", None
    raise _bad(f"'tool_choice' must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}, "
               f"got {choice!r}", "tool_choice")


# ---- input items -------------------------------------------------------------------------------------
def _items(value, toolset: Toolset, notes: list[str]) -> list[dict]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad("'input' must be a string or a list of input items", "input")
    out = []
    for i, it in enumerate(value):
        item = _item(it, f"input[{i}]", toolset, notes)
        if item is not None:
            out.append(item)
    return out


def _item(it, where: str, toolset: Toolset, notes: list[str]) -> dict | None:
    """One input item, normalised: {type: message, role, content: str} | {type: function_call, call_id,
    name (the prompt name), arguments} | {type: function_call_output, call_id, output} | {type: reasoning,
    text}; None for an item that only adds tools or that a text model cannot use (noted)."""
    if not isinstance(it, dict):
        raise _bad(f"{where} must be an object", where)
    kind = it.get("type", "message" if "role" in it else None)
    if kind == "message":
        role = it.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        return {"type": "message", "role": ROLES[role], "content": _text(it.get("content"), f"{where}.content", notes)}
    if kind in ("function_call", "custom_tool_call"):
        keys = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "name", "input")
        for key in keys:
            if not isinstance(it.get(key), str):
                raise _bad(f"{where}.{key} must be a string", f"{where}.{key}")
        name = toolset.prompt_name(it["name"], it.get("namespace"))
        args = it["arguments"] if kind == "function_call" else json.dumps({"input": it["input"]})
        return {"type": "function_call", "call_id": it["call_id"], "name": name, "arguments": args}
    if kind in ("function_call_output", "custom_tool_call_output"):
        if not isinstance(it.get("call_id"), str):
            raise _bad(f"{where}.call_id must be a string", f"{where}.call_id")
        return {"type": "function_call_output", "call_id": it["call_id"],
                "output": _text(it.get("output"), f"{where}.output", notes)}
    if kind == "reasoning":
        return {"type": kind, "text": _reasoning_text(it, where)}
    if kind == "additional_tools":
        toolset.add(it.get("tools") or [], f"{where}.tools", notes)
        return None
    if not isinstance(kind, str):
        raise _bad(f"{where}.type must be a string", f"{where}.type")
    notes.append(f"{where}: a {kind!r} item dropped from the prompt (not servable by a text model here)")
    return None


def _text(content, where: str, notes: list[str]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(kind, str) and kind not in TEXT_PARTS:
            notes.append(f"{where}[{j}]: a {kind!r} part dropped from the prompt (a text model reads text)")
        else:
            raise _bad(f"{where}[{j}] must be a content part with a 'type' (input_text, output_text, ...)",
                       f"{where}[{j}].type")
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
        wire.append(_call_item(call_id, fn["name"], fn["arguments"], req.toolset))
        items.append({"type": "function_call", "call_id": call_id, "name": fn["name"], "arguments": fn["arguments"]})
        deltas.append([(wire[-1].get("arguments", wire[-1].get("input")), -1)])
    return Output(wire, items, deltas)


def _call_item(call_id: str, name: str, arguments: str, toolset: Toolset) -> dict:
    """A tool call as the client knows its tool: a function_call (with its namespace, for a namespace's
    tool) or, for a custom tool, a custom_tool_call whose input is the model's text."""
    kind, namespace, bare = toolset.served.get(name, ("function", None, name))
    if kind == "custom":
        return {"id": new_id("ctc"), "type": "custom_tool_call", "status": "completed", "call_id": call_id,
                "name": bare, "input": custom_input(arguments)}
    item = {"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": call_id, "name": bare,
            "arguments": arguments}
    return item | ({"namespace": namespace} if namespace else {})


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
        elif item["type"] == "custom_tool_call":
            yield ev("response.output_item.added", output_index=n, item=item | {"input": "", "status": "in_progress"})
            for d, _ in deltas:
                yield ev("response.custom_tool_call_input.delta", **at, delta=d)
            yield ev("response.custom_tool_call_input.done", **at, input=item["input"])
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
