"""OpenAI wire format for the proxy (Chat Completions, Completions): request parsing and response bodies, no I/O.

Honoured: `messages` (text content parts; `reasoning_content` on an assistant turn, as reasoning
parsers and litellm send it back), `n`, `temperature`, `top_p`, `seed`, `max_tokens` /
`max_completion_tokens` (clamped, never refused: stages/agentflow/limits.py), `stop`, `logprobs`
(the sampled token's log-probability: chat `logprobs: true`, completions `logprobs: 0`), `tools`
with `tool_choice` auto | none | required | {"type": "function", "function": {"name"}} (a forced
call ends the prompt with the template's tool-call opening), streaming (SSE,
`stream_options.include_usage`), completions prompts as text or token ids.

Accepted and recorded as a note, not honoured: any field this proxy does not know, penalties,
`logit_bias`, `top_logprobs`, `response_format` other
than text, non-text content parts (dropped from the prompt), `echo`, `suffix`. A malformed value
of a known field is a 400 naming it.

Streams are emitted once the engine returns the completion (the embedded engine returns whole
completions), one chunk per token, then `data: [DONE]`.
"""
from __future__ import annotations

import secrets
import time

from stages.agentflow.chat import MessageError, decode, normalise_messages, parse_tool_calls
from stages.agentflow.protocol import Request, bad, number, unknown_fields

COMMON = {"model", "user", "metadata", "store", "service_tier", "n", "seed", "temperature", "top_p", "max_tokens",
          "stop", "stream", "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs"}
CHAT_PARAMS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
                        "parallel_tool_calls", "reasoning_effort", "verbosity", "modalities", "audio", "prediction",
                        "web_search_options", "prompt_cache_key", "safety_identifier", "functions", "function_call"}
COMPLETION_PARAMS = COMMON | {"prompt", "echo", "suffix", "best_of"}
MAX_N = 16
MAX_TOKENS = 1 << 62    # any positive budget is accepted (then clamped); only a malformed one is a 400


def _not_honoured(body: dict, key: str, default_ok, notes: list[str]) -> None:
    if key in body and body[key] not in default_ok:
        notes.append(f"'{key}'={body[key]!r} accepted but not honoured")


def requested_tokens(body: dict, *keys: str) -> int | None:
    """The harness's own completion limit (the first of `keys` it set), or None; a malformed one is a 400."""
    key = next((k for k in keys if body.get(k) is not None), None)
    return None if key is None else number(body, key, None, 1, MAX_TOKENS, integer=True)


def _common(body: dict, allowed: set, defaults: dict) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    notes = unknown_fields(body, allowed)
    for key in ("frequency_penalty", "presence_penalty"):
        _not_honoured(body, key, (0, 0.0, None), notes)
    _not_honoured(body, "logit_bias", (None, {}), notes)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, (bool, type(None))):
        raise bad("'stream' must be a boolean", "stream")
    requested = requested_tokens(body, "max_completion_tokens", "max_tokens")
    return {"n": number(body, "n", 1, 1, MAX_N, integer=True), "max_tokens": requested or 0,
            "temperature": float(number(body, "temperature", defaults["temperature"], 0, 2)),
            "top_p": float(number(body, "top_p", defaults["top_p"], 1e-6, 1)),
            "seed": number(body, "seed", None, 0, 1 << 62, integer=True),
            "stop": stop, "stream": bool(stream), "include_usage": bool((opts or {}).get("include_usage")),
            "model": str(body.get("model") or "loongsage"), "requested": requested, "notes": notes}


def parse_chat(body: dict, defaults: dict) -> Request:
    common = _common(body, CHAT_PARAMS, defaults)
    notes = common["notes"]
    try:
        messages = normalise_messages(body.get("messages"), notes)
    except MessageError as e:
        raise bad(str(e), e.param) from None
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, (bool, type(None))):
        raise bad("'logprobs' must be a boolean", "logprobs")
    _not_honoured(body, "top_logprobs", (0, None), notes)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        notes.append("'response_format' other than text accepted; the output is not constrained")
    if body.get("functions") is not None or body.get("function_call") is not None:
        notes.append("legacy 'functions' / 'function_call' ignored: send 'tools'")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
        tools = tools or None
    forced = _forced(body.get("tool_choice"), tools, notes)
    if body.get("tool_choice") == "none":
        tools = None
    return Request(**common, logprobs=bool(logprobs), messages=messages, tools=tools, forced=forced)


def _forced(choice, tools: list[dict] | None, notes: list[str]) -> str | None:
    """A forced tool choice as the prompt's ending: "" (required: any tool), a tool's name, or None (auto)."""
    if choice in ("auto", "none", None):
        return None
    names = [t["function"]["name"] for t in tools or []]
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if choice == "required" and names:
        return ""
    if name in names:
        return name
    if choice != "required" and not isinstance(name, str):
        raise bad("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}", "tool_choice")
    notes.append(f"'tool_choice'={choice!r} names no tool of the request: served as auto")
    return None


def parse_completion(body: dict, defaults: dict) -> Request:
    common = _common(body, COMPLETION_PARAMS, defaults)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    ids_ok = isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids_ok:
        raise bad("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt per request)",
                  "prompt")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise bad("'logprobs' must be null or 0: the engine returns only the sampled token's logprob", "logprobs")
    _not_honoured(body, "echo", (False, None), common["notes"])
    _not_honoured(body, "suffix", (None, ""), common["notes"])
    if body.get("best_of") not in (None, common["n"]):
        raise bad("'best_of' must equal 'n'", "best_of")
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


def assistant_message(req: Request, choice, separator: str = "") -> tuple[dict, str]:
    """The assistant message of one choice and its finish_reason (tool calls parsed when tools were given).
    Its content is the model's text byte for byte, less the `separator` the chat template writes itself
    between content and a tool call (protocol.call_separator): rendered back, the turn spells the same text."""
    content, calls = (parse_tool_calls(choice.text) if req.tools else (choice.text, []))
    if calls and separator:
        content = content.removesuffix(separator)
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
