"""OpenAI Responses (POST /v1/responses): a body read into a `Request`, the choice rendered as the reply and its
events; no I/O.

`previous_response_id` names a response stored with this trajectory as the chat messages it ended with, less
its instructions (an unknown id is 400 previous_response_not_found, as OpenAI answers). The output: a `reasoning`
item when the text opens with `<think>`, a `message`, a call item per `<tool_call>` block; a completion cut by the
token limit is `status: incomplete`. Codex's namespace and custom tools, and what is honoured or only noted:
docs/harnesses.md.
"""
from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from itertools import accumulate

from stages.agentflow.chat import text_of
from stages.agentflow.protocol import (
    Fields,
    Protocol,
    Request,
    bad,
    custom_input,
    logprob_entry,
    new_id,
    span_pieces,
    sse_events,
    token_pieces,
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
MAX_STORED = 256           # responses kept per trajectory for previous_response_id (the oldest are dropped)
CALL_EVENTS = {"function_call": ("arguments", "function_call_arguments"),     # a call item's streamed field
               "custom_tool_call": ("input", "custom_tool_call_input")}


@dataclass
class Toolset:
    """The tools as chat function tools, and each prompt name's (kind: function | custom, namespace, name as the
    client knows it). A namespace's tool keeps its own name in the prompt unless another tool has it."""
    chat: list[dict] = field(default_factory=list)
    served: dict[str, tuple[str, str | None, str]] = field(default_factory=dict)
    names: dict[tuple[str | None, str], str] = field(default_factory=dict)   # (namespace, name) -> prompt name

    def add(self, tools, where: str, notes: list[str], namespace: str | None = None) -> None:
        if not isinstance(tools, list):
            raise bad(f"'{where}' must be a list", where)
        for i, t in enumerate(tools):
            at = f"{where}[{i}]"
            kind = t.get("type") if isinstance(t, dict) else None
            if kind not in ("function", "custom", "namespace"):
                if not isinstance(kind, str):
                    raise bad(f"{at} must be a tool object with a 'type'", f"{at}.type")
                notes.append(f"{at}: the hosted tool {kind!r} cannot be served here: dropped from the prompt")
                continue
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise bad(f"{at}.name must be a non-empty string", f"{at}.name")
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
class ResponsesRequest(Request):
    body: dict = field(default_factory=dict)        # as sent: its instructions, tools, metadata are echoed
    tool_choice: str | dict = "auto"
    store: bool = True
    encrypted: bool = False                         # include reasoning.encrypted_content
    toolset: Toolset = field(default_factory=Toolset)


def parse_responses(body, session=None) -> ResponsesRequest:
    f = Fields(body, PARAMS)
    text = f.body.get("text")
    if (text.get("format") if isinstance(text, dict) else text) not in (None, {"type": "text"}):
        f.notes.append("'text.format' other than text accepted; the output is not constrained")
    f.not_honoured(truncation=("disabled", None), background=(False, None), top_logprobs=(0, None))
    include, prev = f.body.get("include") or [], f.body.get("previous_response_id")
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad("'include' must be a list of strings", "include")
    if prev is not None and (not isinstance(prev, str) or not prev):
        raise bad("'previous_response_id' must be a non-empty string", "previous_response_id")
    instructions = f.body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("'instructions' must be a string", "instructions")
    if not isinstance(f.body.get("metadata") or {}, dict):
        raise bad("'metadata' must be an object", "metadata")
    requested, stream, store = f.tokens("max_output_tokens"), f.flag("stream"), f.flag("store", True)
    toolset = Toolset()
    if f.body.get("tools") is not None:
        toolset.add(f.body["tools"], "tools", f.notes)
    prior = [] if prev is None else (session.responses if session is not None else {}).get(prev)
    if prior is None:
        raise bad(f"Previous response with id '{prev}' not found.", "previous_response_id",
                  "previous_response_not_found")
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = system + _messages(f.body.get("input"), toolset, f.notes, prior)     # additional_tools add tools
    if not messages:
        raise bad("'input' must hold at least one item", "input")
    choice, forced = _tool_choice(f.body.get("tool_choice"), toolset, f.notes)
    return f.request(ResponsesRequest, messages=messages, tools=None if choice == "none" else toolset.chat or None,
                     forced=forced, requested=requested, stream=stream, param="input", reasoning=True,
                     logprobs="message.output_text.logprobs" in include, body=f.body, tool_choice=choice,
                     store=store, encrypted="reasoning.encrypted_content" in include, toolset=toolset)


def _tool_choice(choice, toolset: Toolset, notes: list[str]) -> tuple[str | dict, str | None]:
    """(the choice as echoed, the forced prompt name: "" any tool, None auto)."""
    if choice in (None, "auto", "none"):
        return choice or "auto", None
    if choice == "required":
        if not toolset.chat:
            raise bad("'tool_choice' other than auto/none needs 'tools'", "tool_choice")
        return choice, ""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        name = toolset.prompt_name(choice["name"], choice.get("namespace"))
        if name in toolset.served:
            return choice, name
        raise bad(f"'tool_choice' names {choice['name']!r}, which is not one of the tools", "tool_choice")
    if isinstance(kind, str):       # allowed_tools, a hosted tool's type, mcp: served as auto
        notes.append(f"'tool_choice' {kind!r} served as auto")
        return "auto", None
    raise bad(f"'tool_choice' must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}, "
              f"got {choice!r}", "tool_choice")


# ---- input items -> chat messages ---------------------------------------------------------------------
def _messages(value, toolset: Toolset, notes: list[str], prior: list[dict]) -> list[dict]:
    """The chat messages of a stored response (`prior`), then of this request's input items: a reasoning item
    (its content, else its summary) goes inline before the next assistant turn, a function call joins the
    assistant turn it follows (or opens one), an output must answer an earlier call. Items a text model cannot
    use are dropped, noted."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad("'input' must be a string or a list of input items", "input")
    msgs, reasoning = list(prior), None
    calls = {c["id"] for m in prior for c in m.get("tool_calls", [])}
    for i, it in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad(f"{where} must be an object", where)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = ROLES.get(it.get("role"))
            if role is None:
                raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {it.get('role')!r}", f"{where}.role")
            content = text_of(it.get("content"), f"{where}.content", notes, TEXT_PARTS)
            if role == "assistant":
                content, reasoning = with_reasoning(reasoning, content), None
            msgs.append({"role": role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            for key in ("call_id", "name", "arguments" if kind == "function_call" else "input"):
                if not isinstance(it.get(key), str):
                    raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
            args = it["arguments"] if kind == "function_call" else json.dumps({"input": it["input"]})
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": toolset.prompt_name(it["name"], it.get("namespace")), "arguments": args}}
            if msgs and msgs[-1]["role"] == "assistant" and reasoning is None:     # a copy: prior turns are stored
                msgs[-1] = msgs[-1] | {"tool_calls": msgs[-1].get("tool_calls", []) + [call]}
            else:
                msgs.append({"role": "assistant", "content": with_reasoning(reasoning, ""), "tool_calls": [call]})
                reasoning = None
            calls.add(it["call_id"])
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(it.get("call_id"), str):
                raise bad(f"{where}.call_id must be a string", f"{where}.call_id")
            if it["call_id"] not in calls:
                raise bad(f"No tool call found for function call output with call_id {it['call_id']}.",
                          f"{where}.call_id")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": text_of(it.get("output"), f"{where}.output", notes, TEXT_PARTS)})
        elif kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(it, where)
        elif kind == "additional_tools":
            toolset.add(it.get("tools") or [], f"{where}.tools", notes)
        elif isinstance(kind, str):
            notes.append(f"{where}: a {kind!r} item dropped from the prompt (not servable by a text model here)")
        else:
            raise bad(f"{where}.type must be a string", f"{where}.type")
    if reasoning is not None:
        msgs.append({"role": "assistant", "content": with_reasoning(reasoning, "")})
    return msgs


def _reasoning_text(it: dict, where: str) -> str:
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = it.get(key)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise bad(f"{where}.{key} must be a list of {kind} parts", f"{where}.{key}")
            return "".join(p["text"] for p in parts)
    enc = it.get("encrypted_content")
    if isinstance(enc, str) and enc.startswith(ENCRYPTED):
        try:
            return base64.b64decode(enc[len(ENCRYPTED):], validate=True).decode()
        except ValueError:
            raise bad(f"{where}.encrypted_content is corrupt", f"{where}.encrypted_content") from None
    return ""


# ---- the reply -----------------------------------------------------------------------------------------------
def respond(req: ResponsesRequest, choices, session) -> dict | bytes:
    (c,) = choices
    gen = c.gen
    pieces = token_pieces(session.tok, c) if req.stream or req.logprobs or gen.reasoning is not None else []
    status = "incomplete" if c.finish_reason == "length" else "completed"
    wire, deltas = _output(gen, pieces, c.logprobs, req, status)
    ends = [0, *accumulate(map(len, pieces))]   # reasoning tokens: those it takes to reach the text
    think = next(i for i, e in enumerate(ends) if e >= gen.think_end - gen.offset) if gen.think_end else 0
    n, m = c.prompt_tokens, len(c.ids)
    body = {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.body.get("instructions") or None, "max_output_tokens": req.requested,
            "model": req.model, "output": wire, "parallel_tool_calls": True, "store": req.store,
            "previous_response_id": req.body.get("previous_response_id"), "text": {"format": {"type": "text"}},
            "reasoning": {"effort": None, "summary": None}, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice, "tools": req.body.get("tools") or [], "truncation": "disabled",
            "user": None, "metadata": req.body.get("metadata") or {},
            "usage": {"input_tokens": n, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": m,
                      "output_tokens_details": {"reasoning_tokens": think}, "total_tokens": n + m}}
    if req.store and not session.closed:     # the history as chat messages, less the instructions
        session.responses[body["id"]] = req.messages[bool(body["instructions"]):] + [gen.turn()]
        while len(session.responses) > MAX_STORED:
            del session.responses[next(iter(session.responses))]
    return sse_events(_events(body, deltas, c.logprobs)) if req.stream else body


def _output(gen, pieces: list[str], logprobs: list[float], req: ResponsesRequest, status: str):
    """(output items, each one's stream deltas as (text, token index))."""
    wire, deltas = [], []
    if gen.reasoning is not None:
        item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": gen.reasoning}]}
        if req.encrypted:
            item["encrypted_content"] = ENCRYPTED + base64.b64encode(gen.reasoning.encode()).decode()
        wire.append(item)
        deltas.append(span_pieces(pieces, gen.reasoning_span, gen.offset))
    if gen.text or not gen.calls:
        parts = span_pieces(pieces, gen.text_span, gen.offset)
        text = {"type": "output_text", "text": gen.text, "annotations": []}
        if req.logprobs:
            text["logprobs"] = [logprob_entry(p, logprobs[i]) for p, i in parts if i < len(logprobs)]
        wire.append({"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
                     "content": [text]})
        deltas.append(parts if not gen.calls else [(gen.text, -1)])
    for c in gen.calls:
        call_id, fn = c["id"], c["function"]
        kind, namespace, name = req.toolset.served.get(fn["name"], ("function", None, fn["name"]))
        if kind == "custom":    # the client's custom tool: its input is the model's text
            wire.append({"id": new_id("ctc"), "type": "custom_tool_call", "status": "completed", "call_id": call_id,
                         "name": name, "input": custom_input(fn["arguments"])})
        else:
            wire.append({"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": call_id,
                         "name": name, "arguments": fn["arguments"]} | ({"namespace": namespace} if namespace else {}))
        deltas.append([(wire[-1].get("arguments", wire[-1].get("input")), -1)])
    return wire, deltas


def _events(body: dict, deltas: list, logprobs: list[float]):
    """The event sequence of a streamed response, each with `type` and `sequence_number`."""
    seq = iter(range(1 << 30))

    def ev(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    start = body | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    for n, (item, parts) in enumerate(zip(body["output"], deltas)):
        at = {"item_id": item["id"], "output_index": n}
        if item["type"] in CALL_EVENTS:
            key, name = CALL_EVENTS[item["type"]]
            yield ev("response.output_item.added", output_index=n, item=item | {key: "", "status": "in_progress"})
            for d, _ in parts:
                yield ev(f"response.{name}.delta", **at, delta=d)
            done = {"name": item["name"]} if key == "arguments" else {}
            yield ev(f"response.{name}.done", **at, **done, **{key: item[key]})
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            lps = {"logprobs": part.get("logprobs", [])} if kind == "output_text" else {}
            yield ev("response.output_item.added", output_index=n, item=item | {"status": "in_progress", "content": []})
            yield ev("response.content_part.added", **at, content_index=0,
                     part={k: ([] if k in ("annotations", "logprobs") else "" if k == "text" else v)
                           for k, v in part.items()})
            for d, i in parts:
                lp = [logprob_entry(d, logprobs[i])] if "logprobs" in part and 0 <= i < len(logprobs) else []
                yield ev(f"response.{kind}.delta", **at, content_index=0, delta=d,
                         **({"logprobs": lp} if kind == "output_text" else {}))
            yield ev(f"response.{kind}.done", **at, content_index=0, text=part["text"], **lps)
            yield ev("response.content_part.done", **at, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=n, item=item)
    yield ev("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)


RESPONSES = Protocol(parse_responses, respond, strict=True)
