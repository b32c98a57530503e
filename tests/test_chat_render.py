"""stages/agentflow/chat.py's fast paths give exactly what transformers gives: the chat template compiled
once against `apply_chat_template`, the Rust tokenizer called directly against `tok()` / `tok.decode()`,
on the character tokenizer (fallback template) and the Qwen vocabulary (its reasoning-dropping template)."""
from __future__ import annotations

import random

import pytest

from stages.agentflow.chat import FALLBACK_TEMPLATE, _backend, decode, encode, render
from stages.tasks.models import build_char_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
HISTORIES = [
    [{"role": "user", "content": "37+48="}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
     {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"}, {"role": "user", "content": "and 2+2?"}],
    [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "content": "5", "tool_call_id": "call_1"}, {"role": "assistant", "content": "5 ünï 😀"}],
    # None values are dropped before the template sees them (as apply_chat_template drops them)
    [{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
    # not plain: a reasoning field (transformers aliases it) and a tuple: both take apply_chat_template itself
    [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2", "reasoning_content": "add"}],
    [{"role": "user", "content": "x", "extra": ("a", "b")}],
]


@pytest.fixture(scope="module", params=["char", "qwen"])
def tok(request):
    if request.param == "char":
        t = build_char_tokenizer("0123456789+=<>/ abcdefghijklmnopqrstuvwxyz_{}\":,.\n")
        t.chat_template = FALLBACK_TEMPLATE
        return t
    from stages.tasks.qwen_vocab import build_qwen_tokenizer
    return build_qwen_tokenizer()


@pytest.mark.parametrize("h", range(len(HISTORIES)))
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("gen", [True, False])
def test_render_equals_apply_chat_template(tok, h, tools, gen):
    msgs = HISTORIES[h]
    kw = {"tools": tools} if tools else {}
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)
    assert render(tok, msgs, tools, gen) == want


def test_a_new_template_is_compiled_again(tok):
    msgs = HISTORIES[0]
    before, template = render(tok, msgs), tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        assert render(tok, msgs) == "[user]37+48="
    finally:
        tok.chat_template = template
    assert render(tok, msgs) == before


def _texts(tok) -> list[str]:
    rnd = random.Random(0)
    pool = "abcdefghij0123456789+=  \n.,{}\"" + ("éß中文🙂" if tok.vocab_size > 1000 else "")
    texts = ["".join(rnd.choice(pool) for _ in range(rnd.randint(1, 60))) for _ in range(200)]
    texts += [render(tok, h, TOOLS) for h in HISTORIES[:4]] + [tok.eos_token + "12" + tok.eos_token]
    if tok.vocab_size > 1000:
        return texts
    known = set("".join(t for t in tok.get_vocab() if len(t) == 1))   # a character tokenizer has no fallback
    return [t for t in texts if set(t.replace(tok.eos_token, "")) <= known]


def test_encode_and_decode_equal_the_tokenizer(tok):
    for text in _texts(tok):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert encode(tok, text) == ids, text
        for skip in (False, True):
            assert decode(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip,
                                                        clean_up_tokenization_spaces=False), text
    assert encode(tok, "") == []


def test_state_left_on_the_backend_falls_back_to_the_tokenizer(tok):
    """A padded or truncated call elsewhere in the process leaves that setting on the Rust tokenizer;
    calling it directly then would pad or cut: the fast path steps aside until transformers resets it."""
    text = "12+34=46" + tok.eos_token + "1+1=2"
    want = tok(text, add_special_tokens=False)["input_ids"]
    tok(["a", "a b c d e f"], padding="max_length", max_length=40)
    assert _backend(tok) is None
    assert encode(tok, text) == want
    assert _backend(tok) is not None        # transformers' unpadded call took the padding off again
    tok(text, truncation=True, max_length=3)
    assert encode(tok, text) == want
