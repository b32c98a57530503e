"""Chat text <-> token ids, shared by white-box contexts and the black-box proxy.

Rendering uses the tokenizer's own chat template. One without (the built-in character tokenizer) gets
FALLBACK_TEMPLATE, plain enough for any vocabulary to spell: [{"role": "user", "content": "37+48="}] renders to
exactly "37+48=", the format the built-in tiny model was warmed on. Generated tool calls are read in the
Hermes/Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>` form it writes, so a tool-calling turn
round-trips.
"""
from __future__ import annotations

import json
import re
import secrets

from stages.agentflow.limits import RequestRejected

FALLBACK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- endif -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- for tc in m['tool_calls'] or [] -%}"
    "{%- set f = tc['function'] -%}"
    "<tool_call>{\"name\": {{ f['name'] | tojson }}, \"arguments\": "
    "{%- if f['arguments'] is string %} {{ f['arguments'] }}{% else %} {{ f['arguments'] | tojson }}{% endif -%}"
    "}</tool_call>"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARGUMENTS_KEY = re.compile(r'"arguments"\s*:\s*')
ROLES = ("system", "developer", "user", "assistant", "tool")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def ensure_chat_template(tok):
    """Give a tokenizer without a chat template the documented fallback (in place)."""
    if not getattr(tok, "chat_template", None):
        tok.chat_template = FALLBACK_TEMPLATE
    return tok


def render(tok, messages: list[dict], tools: list | None = None, generation_prompt: bool = True) -> str:
    """The prompt text for `messages` (already normalised by `normalise_messages`)."""
    kw = {"tools": tools} if tools else {}
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)


def encode(tok, text: str) -> list[int]:
    # special tokens come from the template text itself; never let the tokenizer add a second bos
    return tok(text, add_special_tokens=False)["input_ids"] if text else []


def decode(tok, ids: list[int], skip_special: bool = False) -> str:
    """The text exactly as the tokens spell it (no clean-up of tokenization spaces)."""
    return tok.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


def decode_continuation(tok, context_ids: list[int], new_ids: list[int], skip_special: bool = False) -> str:
    """Text of `new_ids` as it reads after `context_ids`: decoded alone, a continuation can lose a leading
    space (SentencePiece); decoded after a few context tokens whose text is then cut off, it does not."""
    ctx = context_ids[-4:]
    head = decode(tok, ctx, skip_special)
    full = decode(tok, ctx + new_ids, skip_special)
    return full[len(head):] if full.startswith(head) else decode(tok, new_ids, skip_special)


def cut_at_stop(tok, context_ids: list[int], ids: list[int], stops: list[str],
                keep_stop: bool) -> tuple[list[int], str | None]:
    """Generated ids cut at the earliest stop string in their text (special tokens skipped), and that string
    (None: no stop string). keep_stop=False (OpenAI) keeps the tokens wholly before it; keep_stop=True keeps
    through the token that completes it (a white-box agent stopping on its own syntax trains on it)."""
    def text(k: int) -> str:
        return decode_continuation(tok, context_ids, ids[:k], skip_special=True)

    full = text(len(ids)) if stops else ""
    hits = [(full.find(s), s) for s in stops if s and s in full]
    if not hits:
        return ids, None
    pos, stop = min(hits)
    limit = pos + len(stop) if keep_stop else pos
    k = next(k for k in range(len(ids) + 1) if len(text(k)) >= limit)  # the shortest prefix reaching the limit
    if not keep_stop and len(text(k)) > pos:
        k -= 1  # that token straddles the stop string: drop it too
    return ids[:k], stop


class MessageError(RequestRejected):
    """A malformed message or content part, a 400 at the proxy; `param` names the field (messages[0].content)."""

    code = None


def normalise_messages(messages, notes: list[str] | None = None) -> list[dict]:
    """OpenAI chat messages -> plain dicts with string content (and an assistant turn's `reasoning_content`).
    With `notes`, content parts a text model cannot read (images, audio, files) are dropped and noted there;
    without, they are an error."""
    if not isinstance(messages, list) or not messages:
        raise MessageError("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise MessageError(f"{at} must be an object", at)
        role = m.get("role")
        if role not in ROLES:
            raise MessageError(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{at}.role")
        if m.get("content") is None and role != "assistant":    # an assistant turn may be its tool calls alone
            raise MessageError(f"{at}.content must be a string or a list of text parts, got null "
                               f"(only an assistant message may omit its content)", f"{at}.content")
        content = "" if m.get("content") is None else m["content"]
        msg = {"role": "system" if role == "developer" else role, "content": text_of(content, f"{at}.content", notes)}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise MessageError(f"{at}.tool_calls must be a list", f"{at}.tool_calls")
            for j, c in enumerate(calls):
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    raise MessageError(f"{at}.tool_calls[{j}] needs function.name", f"{at}.tool_calls")
            msg["tool_calls"] = calls
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    return out


def text_of(content, where: str, notes: list[str] | None = None, kinds=("text",), noun: str = "part") -> str:
    """The text of a content field (every protocol's): a string, or a list of parts of a type in `kinds`, joined.
    With `notes`, a part of another type is dropped and noted (a text model reads text); else it is an error."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(f"{where} must be a string or a list of text {noun}s, got {type(content).__name__}", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in kinds and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif notes is not None and isinstance(kind, str) and kind not in kinds:
            notes.append(f"{where}[{j}]: a {kind!r} {noun} dropped from the prompt (a text model reads text)")
        else:
            raise MessageError(f"{where}[{j}] must be a text {noun}", f"{where}[{j}]")
    return "".join(texts)


def parse_tool_calls(text: str, prefix: str = "call_") -> tuple[str, list[dict]]:
    """(content before the first call, as written; OpenAI tool_calls with ids `prefix` + random). Unparseable
    blocks stay in the content: the agent sees what the model wrote. A call's arguments are the model's own
    text of them (its spacing kept: rendered back, they spell the same tokens)."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        args = args if isinstance(args, str) else _written_arguments(m.group(1), args)
        calls.append({"id": prefix + secrets.token_hex(8), "type": "function",
                      "function": {"name": str(name), "arguments": args}})
    return (text[:text.index("<tool_call>")], calls) if calls else (text, [])


def _written_arguments(block: str, args) -> str:
    """`args` as the model wrote them inside a tool-call block, else re-serialised."""
    for m in _ARGUMENTS_KEY.finditer(block):
        try:
            value, end = json.JSONDecoder().raw_decode(block, m.end())
        except ValueError:
            continue
        if value == args:
            return block[m.end():end]
    return json.dumps(args)


def split_reasoning(content: str, reasoning: str | None) -> tuple[str | None, str]:
    """(reasoning, visible text) of an assistant turn, both stripped, whether the reasoning came inline
    (`<think>R</think>A`) or apart (`reasoning_content`). Empty reasoning is None."""
    if reasoning is None and THINK_CLOSE in content:
        head, _, content = content.partition(THINK_CLOSE)
        reasoning = head.split(THINK_OPEN)[-1]
    return (reasoning or "").strip() or None, content.strip()


def _probe(tok, content: str, name: str) -> tuple[str, str] | None:
    """(the generation prompt after a user turn, an assistant turn calling `name`) as the template renders
    them; None for a template that cannot render a tool call."""
    call = {"id": "c0", "type": "function", "function": {"name": name, "arguments": "{}"}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": content, "tool_calls": [call]}]
    try:
        return render(tok, msgs[:1]), render(tok, msgs, generation_prompt=False)
    except Exception:  # noqa: BLE001 - jinja raises template-specific errors
        return None


def call_separator(tok) -> str:
    """What the template writes between an assistant turn's content and its first tool call (Qwen's: a
    newline; the fallback's: nothing). A reply's content leaves it out, so the turn rendered back spells
    what the model wrote."""
    _, turn = _probe(tok, "PROBE", "f") or ("", "")
    i = turn.rfind("PROBE")
    j = turn.find("<tool_call>", i)
    return turn[i + len("PROBE"):j] if 0 <= i < j else ""


def tool_call_opening(tok) -> str | None:
    """How the template opens a tool call, up to the function name (e.g. '<tool_call>\\n{"name": '); None if it
    writes no <tool_call> block. A forced tool choice ends the prompt with it: the model must continue a call."""
    probe = "loongsage_probe_fn"
    head, turn = _probe(tok, "", probe) or ("", "")
    turn = turn.removeprefix(head)
    i, j = turn.find("<tool_call>"), turn.find(json.dumps(probe))
    return turn[i:j] if 0 <= i < j else None
