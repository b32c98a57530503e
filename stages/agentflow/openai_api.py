"""OpenAI Chat Completions and Completions: a body read into a `Request`, the choices rendered as the reply; no I/O.

Chat `messages` may carry an assistant turn's `reasoning_content` (as reasoning parsers and litellm send it back);
a completions `prompt` is text or token ids. `logprobs` is the sampled token's (chat `logprobs: true`,
completions `logprobs: 0`). A stream is written once the engine has returned the whole completion: a chunk per
token, then `data: [DONE]`. What is honoured, and what only noted: docs/harnesses.md.
"""
from __future__ import annotations

import time
from itertools import accumulate

from stages.agentflow.chat import normalise_messages
from stages.agentflow.protocol import Fields, Protocol, Request, bad, logprob_entry, new_id, sse, token_pieces

COMMON = {"model", "user", "metadata", "store", "service_tier", "n", "seed", "temperature", "top_p", "max_tokens",
          "stop", "stream", "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs"}
CHAT_PARAMS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
                        "parallel_tool_calls", "reasoning_effort", "verbosity", "modalities", "audio", "prediction",
                        "web_search_options", "prompt_cache_key", "safety_identifier", "functions", "function_call"}
COMPLETION_PARAMS = COMMON | {"prompt", "echo", "suffix", "best_of"}
MAX_N = 16


def _common(body, known: set, param: str) -> tuple[Fields, Request]:
    f = Fields(body, known)
    f.not_honoured(frequency_penalty=(0, None), presence_penalty=(0, None), logit_bias=(None, {}))
    stop = f.body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    opts = f.body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return f, f.request(n=f.number("n", 1, 1, MAX_N, integer=True), seed=f.number("seed", None, 0, 1 << 62, True),
                        stop=stop, stream=f.flag("stream"), include_usage=bool((opts or {}).get("include_usage")),
                        requested=f.tokens("max_completion_tokens", "max_tokens"), param=param)


def parse_chat(body, session=None) -> Request:
    f, req = _common(body, CHAT_PARAMS, "messages")
    req.messages = normalise_messages(f.body.get("messages"), req.notes)
    req.logprobs = f.flag("logprobs")
    f.not_honoured(top_logprobs=(0, None))
    if f.body.get("response_format") not in (None, {"type": "text"}):
        req.notes.append("'response_format' other than text accepted; the output is not constrained")
    if f.body.get("functions") is not None or f.body.get("function_call") is not None:
        req.notes.append("legacy 'functions' / 'function_call' ignored: send 'tools'")
    tools, choice = f.body.get("tools"), f.body.get("tool_choice")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
    req.tools = None if choice == "none" else tools or None
    names = [t["function"]["name"] for t in tools or []]
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice == "required" and names:
        req.forced = ""
    elif name in names:
        req.forced = name
    elif choice not in ("auto", "none", None):
        if choice != "required" and not isinstance(name, str):
            raise bad("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")
        req.notes.append(f"'tool_choice'={choice!r} names no tool of the request: served as auto")
    return req


def parse_completion(body, session=None) -> Request:
    f, req = _common(body, COMPLETION_PARAMS, "prompt")
    prompt = f.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    ids_ok = isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids_ok:
        raise bad("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt per request)",
                  "prompt")
    logprobs = f.body.get("logprobs")
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise bad("'logprobs' must be null or 0: the engine returns only the sampled token's logprob", "logprobs")
    f.not_honoured(echo=(False, None), suffix=(None, ""))
    if f.body.get("best_of") not in (None, req.n):
        raise bad("'best_of' must equal 'n'", "best_of")
    req.prompt, req.logprobs = prompt, logprobs == 0
    return req


# ---- replies ------------------------------------------------------------------------------------------------
def finish_reason(choice) -> str:
    return "tool_calls" if choice.message.get("tool_calls") and choice.finish_reason == "stop" else choice.finish_reason


def _usage(choices) -> dict:
    prompt, done = choices[0].prompt_tokens, sum(len(c.ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _reply(req: Request, choices, session, prefix: str, kind: str):
    """(the reply's common head, each choice's per-token text: needed only for streams and logprobs)."""
    head = {"id": new_id(prefix, "-"), "object": kind, "created": int(time.time()), "model": req.model}
    return head, [token_pieces(session.tok, c) if req.stream or req.logprobs else [] for c in choices]


def _sse(req: Request, head: dict, chunks: list[dict], choices) -> bytes:
    if req.include_usage:
        chunks.append(head | {"choices": [], "usage": _usage(choices)})
    return b"".join(map(sse, chunks)) + b"data: [DONE]\n\n"


def chat_reply(req: Request, choices, session) -> dict | bytes:
    head, pieces = _reply(req, choices, session, "chatcmpl", "chat.completion")
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
        for p, lp in [] if calls else zip(pieces[i], c.logprobs):
            chunk(i, {"content": p}, lp={"content": [logprob_entry(p, lp)]} if req.logprobs else None)
        chunk(i, {}, finish_reason(c))
    return _sse(req, head, chunks, choices)


def _completion_lp(pieces: list[str], lps: list[float]) -> dict:
    return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None,
            "text_offset": [0, *accumulate(map(len, pieces))][:len(pieces)]}


def completion_reply(req: Request, choices, session) -> dict | bytes:
    head, pieces = _reply(req, choices, session, "cmpl", "text_completion")
    if not req.stream:
        return head | {"choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs":
                                    _completion_lp(pieces[i], c.logprobs) if req.logprobs else None}
                                   for i, c in enumerate(choices)], "usage": _usage(choices)}
    chunks = []
    for i, c in enumerate(choices):
        for p, lp in zip(pieces[i], c.logprobs):
            chunks.append(head | {"choices": [{"index": i, "text": p, "finish_reason": None,
                                               "logprobs": _completion_lp([p], [lp]) if req.logprobs else None}]})
        chunks.append(head | {"choices": [{"index": i, "text": "", "finish_reason": c.finish_reason,
                                           "logprobs": None}]})
    return _sse(req, head, chunks, choices)


CHAT = Protocol(parse_chat, chat_reply)
COMPLETIONS = Protocol(parse_completion, completion_reply)
