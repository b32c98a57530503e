"""The scripted models: real Qwen2ForCausalLMs whose weights are set by hand so that they follow a
script: their layers add nothing, so each next token is a function of the last one alone.

* `SCRIPTED_MODEL` on the project's character tokenizer over printable ASCII, with a few
  whole phrases as single tokens, under the append-only fallback template. A prompt ending
  in "?" makes it think and call the `add` tool, one ending in "5" (the tool's result) makes
  it answer, one ending in "!" makes it think and greet, anything else makes it say "ok".
* `build_qwen_scripted_model` on Qwen's real vocabulary and our Qwen-style template (stages/tasks/qwen_vocab.py),
  which drops earlier turns' reasoning (not append-only). Every prompt ends with the
  generation prompt's newline, after which it writes `<think>plan</think>` and "Hello there";
  after a forced call's opening it completes the `add` call.

So tool calls, reasoning and stop sequences come out of the engine for real, deterministically,
and every recorded token can be compared with what the engine received and produced
(`RecordingClient`). The fixtures here (`model_dir`, `tok`, `server`, `ep`) take the using module's
`engine`; the checks at the end run behind the HF engine (tests/test_proxy_protocols.py) and behind
vLLM (tests/test_vllm_proxy.py).
"""
from __future__ import annotations

import json
import string

import anthropic
import openai
import pytest
import torch

from stages.agentflow.chat import encode
from stages.agentflow.limits import PromptLimit
from stages.agentflow.proxy import Proxy
from stages.model import load_tokenizer
from stages.tasks.models import build_char_tokenizer
from tests.support.proxy import LoopThread, RecordingClient

R_ADD = "<think>\nuse add\n</think>\n\n"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
R_HI = "<think>\ngreet\n</think>\n\n"
HELLO, END, MORE, SUM, OK = "Hello there! ", "END", " of it", "The sum is 5.", "ok"
# last token -> next token (None: eos); any other token -> "ok"
SCRIPTED_MODEL = {"?": R_ADD, R_ADD: CALL, CALL: None, "!": R_HI, R_HI: HELLO, HELLO: END, END: MORE, MORE: None,
                  "5": SUM, SUM: None, OK: None}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0}
CONTEXT = 512
ADD_TOOL_OAI = {"type": "function", "name": "add", "description": "a + b",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
ADD_TOOL_ANT = {"name": "add", "description": "a + b", "input_schema": ADD_TOOL_OAI["parameters"]}


def build_scripted_model(out) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_char_tokenizer(string.printable)
    tok.add_tokens([t for t in SCRIPTED_MODEL if len(t) > 1])      # whole phrases as single (non-special) tokens
    vocab, hidden = len(tok), 128
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=CONTEXT,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id)
    model = Qwen2ForCausalLM(cfg)
    ids = tok.get_vocab()
    with torch.no_grad():
        for p in model.parameters():       # attention and MLP write nothing: the residual is the embedding
            p.zero_()
        for norm in [model.model.norm] + [m for layer in model.model.layers
                                          for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[torch.arange(vocab), torch.arange(vocab)] = 1.0    # one-hot
        for t in range(vocab):
            nxt = SCRIPTED_MODEL.get(tok.convert_ids_to_tokens(t), OK)
            model.lm_head.weight[tok.eos_token_id if nxt is None else ids[nxt], t] = 20.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


QWEN_THINK = "<think>plan</think>\n\nHello there"      # after the generation prompt's "\n"
QWEN_CALL = ', "arguments": {}}\n</tool_call>'          # after a forced call's opening, '... "add"'


def build_qwen_scripted_model(out, tok, opening: str) -> str:
    """Qwen's vocabulary (151,669 ids); the scripted tokens get their own embedding slot, all
    others share slot 0, whose next token is "ok"."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from stages.tasks.qwen_vocab import CONTEXT as QWEN_CONTEXT
    from stages.tasks.qwen_vocab import TOKEN_IDS, VOCAB_SIZE

    eos, ok = tok.eos_token_id, encode(tok, "ok")
    nxt: dict[int, int] = {ok[0]: eos}
    for start, text in ((encode(tok, "\n")[-1], QWEN_THINK), (encode(tok, opening + '"add"')[-1], QWEN_CALL)):
        seq = [start] + encode(tok, text) + [eos]
        for a, b in zip(seq, seq[1:]):
            assert nxt.setdefault(a, b) == b, f"the script needs token {a} to have one successor"
    hidden = 32     # slots for the scripted tokens (about 16) and the rest
    cfg = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=QWEN_CONTEXT,
                      tie_word_embeddings=False, bos_token_id=TOKEN_IDS["<|endoftext|>"], eos_token_id=eos,
                      pad_token_id=TOKEN_IDS["<|endoftext|>"])
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in [model.model.norm] + [m for layer in model.model.layers
                                          for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[ok[0], 0] = 20.0
        for slot, (t, n) in enumerate(nxt.items(), start=1):
            model.model.embed_tokens.weight[t] = 0.0
            model.model.embed_tokens.weight[t, slot] = 1.0
            model.lm_head.weight[n, slot] = 20.0
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=cfg.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_scripted_model(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def server(engine, model_dir, tok):
    loop = LoopThread()
    proxy = Proxy(load_tokenizer(model_dir), max_body_bytes=64 << 10, limit=PromptLimit.for_model(model_dir, tok))
    loop.run(proxy.start())
    yield loop, proxy
    loop.run(proxy.stop())
    loop.stop()


@pytest.fixture
def ep(server, engine):
    loop, proxy = server
    client = RecordingClient(engine)
    endpoint = loop.run(proxy.open(client, dict(GREEDY), max_turns=8))
    endpoint.client = client
    yield endpoint
    proxy.close(endpoint)


def oai(ep) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=30)


def ant(ep, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=ep.api_key, max_retries=0,
                               timeout=30, **kw)


def engine_call(ep, k: int = -1) -> tuple[list[int], list[int], dict]:
    (req,), (out,) = ep.client.calls[k]
    return req["prompt_ids"], out["response_ids"], out


def assert_recorded_exactly(ep, kept: int | None = None):
    """The session's stream after the last call is the engine's prompt + the engine's own tokens
    (all of them, or the first `kept` where a stop sequence cut them), with its logprobs and versions."""
    prompt, resp, out = engine_call(ep)
    kept = len(resp) if kept is None else kept
    s = ep.session.final.stream
    assert s.ids == prompt + resp[:kept]
    assert s.loss_mask[len(s.ids) - len(s.prompt_ids) - kept:] == [1] * kept
    assert s.logprobs[len(s.response_ids) - kept:] == out["logprobs"][:kept]
    assert s.versions[len(s.response_ids) - kept:] == out["versions"][:kept]


# ---- checks every engine passes behind the proxy ---------------------------------------------------
def responses_reasoning_and_text_are_recorded_exactly(ep, tok):
    r = oai(ep).responses.create(model="m", instructions="Be kind. ", input="say hi!",
                                 include=["message.output_text.logprobs"])
    prompt, resp, out = engine_call(ep)
    assert prompt == encode(tok, "Be kind. say hi!")      # the fallback template: contents, concatenated
    assert_recorded_exactly(ep)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "greet"
    assert message.type == "message" and r.output_text == HELLO + END + MORE
    lps = message.content[0].logprobs       # the text's tokens: after the reasoning token, before eos
    assert [lp.token for lp in lps] == [HELLO, END, MORE] and [lp.logprob for lp in lps] == out["logprobs"][1:4]
    assert r.status == "completed" and r.id.startswith("resp_")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), len(resp))
    assert r.usage.output_tokens_details.reasoning_tokens == 1 and r.usage.total_tokens == len(prompt) + len(resp)


def responses_function_call_loop_extends_the_recorded_stream(ep, tok):
    client = oai(ep)
    first = client.responses.create(model="m", input="add 2 and 3?", tools=[ADD_TOOL_OAI])
    assert_recorded_exactly(ep)
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3} and call.call_id
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    # the client's own loop: every item back, then the tool's output
    history = [{"role": "user", "content": "add 2 and 3?"}] + [o.model_dump(exclude_none=True) for o in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
    second = client.responses.create(model="m", input=history, tools=[ADD_TOOL_OAI])
    assert second.output_text == SUM
    p1, r1, _ = engine_call(ep, 0)
    p2, r2, _ = engine_call(ep, 1)
    assert p2 == p1 + r1 + encode(tok, "5")      # the model's tokens reused as they were, only "5" is new
    assert len(ep.session.tree) == 1
    assert_recorded_exactly(ep)
    assert ep.session.final.stream.loss_mask.count(1) == len(r1) + len(r2)


def messages_thinking_text_and_stop_sequences(ep, tok):
    m = ant(ep).messages.create(model="m", max_tokens=8, system=[{"type": "text", "text": "Be kind. "}],
                                messages=[{"role": "user", "content": "say hi!"}], stop_sequences=[" of", END])
    prompt, resp, _ = engine_call(ep)
    assert prompt == encode(tok, "Be kind. say hi!")
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "greet" and m.content[0].signature and m.content[1].text == HELLO
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", END)       # the earliest in the text
    assert_recorded_exactly(ep, kept=2)                                      # cut before END, never retokenised
    assert (m.usage.input_tokens, m.usage.output_tokens) == (len(prompt), 2) and m.id.startswith("msg_")
    plain = ant(ep).messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hmm"}])
    assert plain.stop_reason == "end_turn" and plain.content[0].text == OK and plain.stop_sequence is None


def messages_stream_tool_use_and_tool_result_round_trip(ep, tok):
    client = ant(ep)
    with client.messages.stream(model="m", max_tokens=8, tools=[ADD_TOOL_ANT],
                                messages=[{"role": "user", "content": "add 2 and 3?"}]) as stream:
        events = list(stream)
        first = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert {"thinking_delta", "signature_delta", "input_json_delta"} <= deltas
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "tool_use"]
    use = first.content[1]
    assert use.name == "add" and use.input == {"a": 2, "b": 3} and use.id.startswith("toolu_")
    assert_recorded_exactly(ep)
    history = [{"role": "user", "content": "add 2 and 3?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    second = client.messages.create(model="m", max_tokens=8, tools=[ADD_TOOL_ANT], messages=history)
    assert second.content[0].text == SUM and second.stop_reason == "end_turn"
    p1, r1, _ = engine_call(ep, 0)
    assert engine_call(ep, 1)[0] == p1 + r1 + encode(tok, "5") and len(ep.session.tree) == 1
    assert_recorded_exactly(ep)
    # a failed tool tells the model so; its content may be text blocks
    history[-1]["content"] = [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                               "content": [{"type": "text", "text": "no such number: 5"}]}]
    client.messages.create(model="m", max_tokens=2, tools=[ADD_TOOL_ANT], messages=history)
    assert engine_call(ep)[0] == p1 + r1 + encode(tok, "Error: no such number: 5")
