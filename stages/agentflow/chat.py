"""Chat text <-> token ids, shared by white-box contexts and the black-box proxy.

Rendering uses the tokenizer's own chat template. A tokenizer without one (the built-in
character tokenizer) gets FALLBACK_TEMPLATE, which is deliberately plain so that any
vocabulary can spell it:

    each message's content, concatenated, with no role markers;
    an assistant message ends with the eos token;
    an assistant tool call is written `<tool_call>{"name": ..., "arguments": ...}</tool_call>`;
    no generation prompt (the model continues right after the last message).

So `[{"role": "user", "content": "37+48="}]` renders to exactly "37+48=", the format the
built-in tiny model was warmed on. Tools are not described to the model by this template;
the agent's own prompt must do that.

Tool calls in generated text are read in the Hermes/Qwen form `<tool_call>{json}</tool_call>`,
which is also what the fallback template writes back, so a tool-calling turn round-trips.
"""
from __future__ import annotations

import json
import re
import secrets

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
ROLES = ("system", "developer", "user", "assistant", "tool")


def ensure_chat_template(tok):
    """Give a tokenizer without a chat template the documented fallback (in place)."""
    if not getattr(tok, "chat_template", None):
        tok.chat_template = FALLBACK_TEMPLATE
    return tok


def render(tok, messages: list[dict], tools: list | None = None, generation_prompt: bool = True) -> str:
    """The prompt text for `messages` (already normalised by `normalise_messages`).

    Plain messages (str/int/float/bool, lists and dicts of them, no reasoning fields) are rendered with
    the tokenizer's chat template compiled once, as `apply_chat_template` renders it (same Jinja
    environment, same variables: the messages less their None-valued keys, tools, add_generation_prompt,
    the special tokens); anything else goes through `apply_chat_template` itself. The proxy renders
    every call's whole history, and transformers' per-call conversion of it cost ~35 us of ~50."""
    compiled = _compiled_template(tok)
    if compiled is not None and _plain_messages(messages):
        template, special = compiled
        return template.render(messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                               tools=tools or None, documents=None, add_generation_prompt=generation_prompt,
                               **special)
    kw = {"tools": tools} if tools else {}
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)


def _compiled_template(tok):
    """(compiled template, special tokens) for `tok`'s current chat template, or None where this
    transformers does not expose its template compiler (then apply_chat_template renders)."""
    template = getattr(tok, "chat_template", None)
    if not isinstance(template, str):
        return None
    special = tok.special_tokens_map
    cached = getattr(tok, "_loongsage_template", None)
    if cached is not None and cached[0] == template and cached[2] == special:
        return cached[1], cached[2]
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    tok._loongsage_template = (template, _compile_jinja_template(template), dict(special))
    return tok._loongsage_template[1], tok._loongsage_template[2]


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")   # apply_chat_template aliases these


def _plain_messages(messages) -> bool:
    def plain(v) -> bool:
        if v is None or type(v) in (str, int, float, bool):
            return True
        if type(v) is list:
            return all(plain(x) for x in v)
        if type(v) is dict:
            return all(type(k) is str and plain(x) for k, x in v.items())
        return False
    return type(messages) is list and all(
        type(m) is dict and not any(m.get(k) is not None for k in _REASONING_KEYS) and plain(m) for m in messages)


def _backend(tok):
    """The Rust tokenizer under a fast tokenizer, when calling it directly gives what tok() / tok.decode()
    give (no padding, truncation or split special tokens left set on it); else None."""
    b = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if b is None or b.padding is not None or b.truncation is not None or b.encode_special_tokens:
        return None
    return b


def encode(tok, text: str) -> list[int]:
    # special tokens come from the template text itself; never let the tokenizer add a second bos
    if not text:
        return []
    b = _backend(tok)
    if b is not None:       # encode_batch, not encode: it lets go of the GIL (a long prompt is tokenized on
        return b.encode_batch([text], add_special_tokens=False)[0].ids     # a thread while the loop serves)
    return tok(text, add_special_tokens=False)["input_ids"]


def decode(tok, ids: list[int], skip_special: bool = False) -> str:
    """tok.decode(ids) with no clean-up of tokenization spaces (the text exactly as the tokens spell it)."""
    b = _backend(tok)
    if b is not None:
        return b.decode(ids, skip_special_tokens=skip_special)
    return tok.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


class MessageError(ValueError):
    """A malformed chat message; `param` names the field at fault (e.g. messages[0].content)."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


def normalise_messages(messages, notes: list[str] | None = None) -> list[dict]:
    """OpenAI chat messages -> plain dicts with string content (and an assistant turn's `reasoning_content`).
    Raises MessageError naming the bad field. With `notes`, content parts a text model cannot read (images,
    audio, files) are dropped and noted there; without, they are an error."""
    if not isinstance(messages, list) or not messages:
        raise MessageError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise MessageError(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise MessageError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                               f"messages[{i}].role")
        content = m.get("content")
        if content is None and role != "assistant":  # only an assistant turn (e.g. tool calls alone) may be empty
            raise MessageError(f"messages[{i}].content must be a string or a list of text parts, got null "
                               f"(only an assistant message may omit its content)", f"messages[{i}].content")
        msg = {"role": "system" if role == "developer" else role, "content": _content_text(content, i, notes)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _check_tool_calls(m["tool_calls"], i)
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    return out


def _content_text(content, i: int, notes: list[str] | None = None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: only text parts can reach a text model
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif notes is not None and isinstance(part, dict) and isinstance(part.get("type"), str):
                notes.append(f"messages[{i}].content[{j}]: a {part['type']!r} part dropped (a text model reads text)")
            else:
                raise MessageError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        return "".join(texts)
    raise MessageError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}",
                       f"messages[{i}].content")


def _check_tool_calls(calls, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise MessageError(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise MessageError(f"messages[{i}].tool_calls[{j}] needs function.name", f"messages[{i}].tool_calls")
    return calls


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split generated text into (content before the first call, as written, OpenAI tool_calls). Unparseable
    blocks stay in the content: the agent then sees what the model actually wrote. A call's arguments
    are the model's own text of them (its spacing kept: rendered back, they spell the same tokens)."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        args = args if isinstance(args, str) else _written_arguments(m.group(1), args)
        calls.append({"id": "call_" + secrets.token_hex(8), "type": "function",
                      "function": {"name": str(name), "arguments": args}})
    if not calls:
        return text, []
    return text[: text.index("<tool_call>")], calls     # byte for byte: the template writes it back


_ARGUMENTS_KEY = re.compile(r'"arguments"\s*:\s*')


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


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(content: str, reasoning: str | None) -> tuple[str | None, str]:
    """(reasoning, visible text) of an assistant turn, both stripped, however it was sent: reasoning inline
    as `<think>R</think>A` or apart (`reasoning_content`). Empty reasoning is None."""
    if reasoning is None and THINK_CLOSE in content:
        head, _, content = content.partition(THINK_CLOSE)
        reasoning = head.split(THINK_OPEN)[-1]
    reasoning = reasoning.strip() if reasoning is not None else ""
    return reasoning or None, content.strip()


def decode_continuation(tok, context_ids: list[int], new_ids: list[int], skip_special: bool = False) -> str:
    """Text of `new_ids` as it reads after `context_ids`. Decoding a continuation alone can
    lose a leading space (SentencePiece); decoding it with a few context tokens and cutting
    their text off does not."""
    ctx = context_ids[-4:]
    head = decode(tok, ctx, skip_special)
    full = decode(tok, ctx + new_ids, skip_special)
    return full[len(head):] if full.startswith(head) else decode(tok, new_ids, skip_special)


def cut_at_stop(tok, context_ids: list[int], ids: list[int], stops: list[str],
                keep_stop: bool) -> tuple[list[int], bool]:
    """Cut generated ids at the first stop string. Returns (kept ids, stopped?).

    keep_stop=False (OpenAI semantics) keeps the tokens wholly before the stop string;
    keep_stop=True keeps through the token that completes it (a white-box agent that stops
    on its own call syntax keeps that syntax in the stream it trains on).
    """
    if not stops:
        return ids, False

    def text(k: int) -> str:  # stop strings match the text an agent reads: special tokens skipped
        return decode_continuation(tok, context_ids, ids[:k], skip_special=True)

    full = text(len(ids))
    hits = [(full.find(s), s) for s in stops if s and s in full]
    if not hits:
        return ids, False
    pos, stop = min(hits)
    limit = pos + len(stop) if keep_stop else pos
    k = next(k for k in range(len(ids) + 1) if len(text(k)) >= limit)  # smallest prefix reaching the limit
    if not keep_stop and len(text(k)) > pos:
        k -= 1  # that token straddles the stop string: drop it too
    return ids[:k], True
