"""OpenAI Chat Completions and Completions for the proxy: parse a body into a `Request`, render the reply; no I/O.

Honoured: chat `messages` (text parts; an assistant turn's `reasoning_content`, as reasoning parsers and
litellm send it back) or a completions `prompt` (text or token ids), `n`, `temperature`, `top_p`, `seed`,
`max_tokens` / `max_completion_tokens` (clamped, never refused), `stop`, `logprobs` (the sampled token's:
chat `logprobs: true`, completions `logprobs: 0`), `tools` with `tool_choice` auto | none | required |
{"type": "function", "function": {"name"}}, `stream` with `stream_options.include_usage`. Accepted and noted,
not honoured: unknown fields, penalties, `logit_bias`, `top_logprobs`, `response_format` other than text,
non-text content parts (dropped), `echo`, `suffix`. A stream is written once the engine has returned the
whole completion: one chunk per token, then `data: [DONE]`.
"""
from __future__ import annotations

import time
from itertools import accumulate

from stages.agentflow.chat import MessageError, normalise_messages
from stages.agentflow.protocol import (
    MAX_TOKENS,
    Protocol,
    Request,
    bad,
    body_object,
    flag,
    logprob_entry,
    new_id,
    not_honoured,
    number,
    sampling,
    sse,
    token_pieces,
    unknown_fields,
)

COMMON = {"model", "user", "metadata", "store", "service_tier", "n", "seed", "temperature", "top_p", "max_tokens",
          "stop", "stream", "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs"}
CHAT_PARAMS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
                        "parallel_tool_calls", "reasoning_effort", "verbosity", "modalities", "audio", "prediction",
                        "web_search_options", "prompt_cache_key", "safety_identifier", "functions", "function_call"}
COMPLETION_PARAMS = COMMON | {"prompt", "echo", "suffix", "best_of"}
MAX_N = 16


def _common(body, allowed: set, param: str) -> Request:
    body = body_object(body)
    notes = unknown_fields(body, allowed) + not_honoured(body, {
        "frequency_penalty": (0, None), "presence_penalty": (0, None), "logit_bias": (None, {})})
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    key = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    requested = None if key is None else number(body, key, None, 1, MAX_TOKENS, integer=True)
    return Request(n=number(body, "n", 1, 1, MAX_N, integer=True), seed=number(body, "seed", None, 0, 1 << 62, True),
                   stop=stop, stream=flag(body, "stream"), include_usage=bool((opts or {}).get("include_usage")),
                   requested=requested, notes=notes, param=param, **sampling(body))


def parse_chat(body, session=None) -> Request:
    req = _common(body, CHAT_PARAMS, "messages")
    try:
        req.messages = normalise_messages(body.get("messages"), req.notes)
    except MessageError as e:
        raise bad(str(e), e.param) from None
    req.logprobs = flag(body, "logprobs")
    req.notes += not_honoured(body, {"top_logprobs": (0, None)})
    if body.get("response_format") not in (None, {"type": "text"}):
        req.notes.append("'response_format' other than text accepted; the output is not constrained")
    if body.get("functions") is not None or body.get("function_call") is not None:
        req.notes.append("legacy 'functions' / 'function_call' ignored: send 'tools'")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
    req.tools = tools or None
    choice = body.get("tool_choice")
    names = [t["function"]["name"] for t in req.tools or []]
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if choice == "required" and names:
        req.forced = ""
    elif name in names:
        req.forced = name
    elif choice not in ("auto", "none", None):
        if choice != "required" and not isinstance(name, str):
            raise bad("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")
        req.notes.append(f"'tool_choice'={choice!r} names no tool of the request: served as auto")
    if choice == "none":
        req.tools = None
    return req


def parse_completion(body, session=None) -> Request:
    req = _common(body, COMPLETION_PARAMS, "prompt")
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
    req.notes += not_honoured(body, {"echo": (False, None), "suffix": (None, "")})
    if body.get("best_of") not in (None, req.n):
        raise bad("'best_of' must equal 'n'", "best_of")
    req.prompt, req.logprobs = prompt, logprobs == 0
    return req


# ---- replies ------------------------------------------------------------------------------------------------
def finish_reason(choice) -> str:
    return "tool_calls" if choice.message.get("tool_calls") and choice.finish_reason == "stop" else choice.finish_reason


def _usage(choices) -> dict:
    prompt, done = choices[0].prompt_tokens, sum(len(c.ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _pieces(req: Request, choices, session) -> list[list[str]]:
    return [token_pieces(session.tok, c) if req.stream or req.logprobs else [] for c in choices]


def _sse(req: Request, head: dict, chunks: list[dict], choices) -> bytes:
    if req.include_usage:
        chunks.append(head | {"choices": [], "usage": _usage(choices)})
    return b"".join(map(sse, chunks)) + b"data: [DONE]\n\n"


def chat_reply(req: Request, choices, session) -> dict | bytes:
    pieces = _pieces(req, choices, session)
    head = {"id": new_id("chatcmpl", "-"), "object": "chat.completion", "created": int(time.time()), "model": req.model}
    if not req.stream:
        return head | {"choices": [
            {"index": i, "message": c.message, "logprobs": {"content": [
                logprob_entry(p, lp) for p, lp in zip(pieces[i], c.logprobs)]} if req.logprobs else None,
             "finish_reason": finish_reason(c)} for i, c in enumerate(choices)], "usage": _usage(choices)}
    head["object"] = "chat.completion.chunk"
    chunks = []

    def chunk(i: int, delta: dict, finish: str | None = None, lp: dict | None = None) -> None:
        chunks.append(head | {"choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]})

    for i, c in enumerate(choices):
        chunk(i, {"role": "assistant", "content": ""})
        calls = c.message.get("tool_calls")
        if calls:  # content then calls, each whole: pieces of markup are no use to a client
            if c.message["content"]:
                chunk(i, {"content": c.message["content"]})
            chunk(i, {"tool_calls": [{"index": j} | tc for j, tc in enumerate(calls)]})
        else:
            for p, lp in zip(pieces[i], c.logprobs):
                chunk(i, {"content": p}, lp={"content": [logprob_entry(p, lp)]} if req.logprobs else None)
        chunk(i, {}, finish_reason(c))
    return _sse(req, head, chunks, choices)


def _completion_lp(pieces: list[str], lps: list[float]) -> dict:
    offsets = [0, *accumulate(map(len, pieces))][:len(pieces)]
    return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}


def completion_reply(req: Request, choices, session) -> dict | bytes:
    pieces = _pieces(req, choices, session)
    head = {"id": new_id("cmpl", "-"), "object": "text_completion", "created": int(time.time()), "model": req.model}
    if not req.stream:
        return head | {"choices": [
            {"index": i, "text": c.text, "finish_reason": c.finish_reason,
             "logprobs": _completion_lp(pieces[i], c.logprobs) if req.logprobs else None}
            for i, c in enumerate(choices)], "usage": _usage(choices)}
    chunks = []
    for i, c in enumerate(choices):
        chunks += [head | {"choices": [{"index": i, "text": p, "finish_reason": None,
                                        "logprobs": _completion_lp([p], [lp]) if req.logprobs else None}]}
                   for p, lp in zip(pieces[i], c.logprobs)]
        chunks.append(head | {"choices": [{"index": i, "text": "", "finish_reason": c.finish_reason,
                                           "logprobs": None}]})
    return _sse(req, head, chunks, choices)


CHAT = Protocol(parse_chat, chat_reply)
COMPLETIONS = Protocol(parse_completion, completion_reply)
