"""The black-box proxy over real HTTP, with the real `openai` client, against a real HFEngine actor.

The proxy runs on its own event-loop thread (as it runs on a rollout worker's loop);
the tests call it synchronously like any agent program would. `RecordingClient`
(tests/support/proxy.py) is the real EngineClient that also keeps what the engine returned, so
the proxy's records can be compared with the engine's own output token for token.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import ray

from stages.agentflow.chat import FALLBACK_TEMPLATE, encode, parse_tool_calls, render
from stages.agentflow.engine import HFEngine
from stages.agentflow.openai_api import finish_reason
from stages.agentflow.protocol import read_generation
from stages.agentflow.proxy import Proxy
from stages.agentflow.session import Choice, assistant_message
from stages.agentflow.stream import TokenStream
from stages.model import load_tokenizer
from tests.support.proxy import GREEDY, LoopThread, RecordingClient


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def engine(ray_session, model_path):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(model_path)
    ray.get(eng.info.remote())
    yield eng
    ray.kill(eng)


@pytest.fixture(scope="module")
def server(engine, model_path):
    loop, proxy = LoopThread(), Proxy(load_tokenizer(model_path), max_body_bytes=64 << 10)
    loop.run(proxy.start())
    yield loop, proxy
    loop.run(proxy.stop())
    loop.stop()


@pytest.fixture
def ep(server, engine):
    """A fresh trajectory endpoint (greedy, 4 calls at most) and the engine client behind it."""
    loop, proxy = server
    client = RecordingClient(engine)
    endpoint = loop.run(proxy.open(client, dict(GREEDY), max_turns=4))
    endpoint.client = client
    yield endpoint
    proxy.close(endpoint)


def oai(ep) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)


def post(url: str, body: bytes | dict, key: str | None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


USER = [{"role": "user", "content": "37+48="}]


# ---- chat ---------------------------------------------------------------------------------
def test_chat_records_exactly_what_the_engine_returned(ep, model_path):
    tok = load_tokenizer(model_path)
    r = oai(ep).chat.completions.create(model="policy", messages=USER, logprobs=True)
    (req,), (out,) = ep.client.calls[-1]
    assert req["prompt_ids"] == tok("37+48=", add_special_tokens=False)["input_ids"]  # fallback template: the text
    s = ep.session.final.stream
    assert s.response_ids == out["response_ids"] and s.logprobs == out["logprobs"] and s.versions == out["versions"]
    assert s.loss_mask == [1] * len(out["response_ids"])
    assert r.choices[0].message.content == tok.decode(out["response_ids"], skip_special_tokens=True)
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(out["logprobs"])
    assert r.choices[0].finish_reason == ("stop" if out["status"] == "completed" else "length")
    assert r.usage.prompt_tokens == len(req["prompt_ids"]) and r.usage.completion_tokens == len(out["response_ids"])


def test_second_turn_reuses_recorded_tokens_and_counts_one_segment(ep):
    client = oai(ep)
    first = client.chat.completions.create(model="policy", messages=USER)
    (_, (out1,)) = ep.client.calls[-1]
    history = USER + [{"role": "assistant", "content": first.choices[0].message.content}] + USER
    client.chat.completions.create(model="policy", messages=history)
    (req2,), (out2,) = ep.client.calls[-1]
    prompt1 = ep.session.final.stream.prompt_ids
    # the second prompt is the first prompt + the engine's own tokens + only the new text's tokens
    assert req2["prompt_ids"][: len(prompt1) + len(out1["response_ids"])] == prompt1 + out1["response_ids"]
    s = ep.session.final.stream
    delta = len(req2["prompt_ids"]) - len(prompt1) - len(out1["response_ids"])
    assert s.response_ids == out1["response_ids"] + req2["prompt_ids"][-delta:] + out2["response_ids"]
    assert s.loss_mask == [1] * len(out1["response_ids"]) + [0] * delta + [1] * len(out2["response_ids"])
    assert s.logprobs == out1["logprobs"] + [0.0] * delta + out2["logprobs"]
    assert s.versions[len(out1["response_ids"]):][:delta] == [-1] * delta
    assert len(ep.session.tree) == 1 and ep.session.calls == 2
    assert [m["role"] for m in ep.session.transcript] == ["user", "assistant", "user", "assistant"]


def test_edited_history_starts_a_new_segment(ep, model_path):
    tok = load_tokenizer(model_path)
    client = oai(ep)
    client.chat.completions.create(model="policy", messages=USER)
    edited = USER + [{"role": "assistant", "content": "99"}] + USER   # not what the model said
    client.chat.completions.create(model="policy", messages=edited)
    (req2,), (out2,) = ep.client.calls[-1]
    assert len(ep.session.tree) == 2
    assert req2["prompt_ids"] == encode(tok, "37+48=99" + tok.eos_token + "37+48=")
    s = ep.session.final.stream   # the row trains on the last segment only
    assert s.prompt_ids == req2["prompt_ids"] and s.response_ids == out2["response_ids"]


def test_streaming_chat_carries_the_same_tokens(ep):
    chunks = list(oai(ep).chat.completions.create(model="policy", messages=USER, stream=True, logprobs=True,
                                                   stream_options={"include_usage": True}))
    (_, (out,)) = ep.client.calls[-1]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    lps = [lp.logprob for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert text == ep.session.final.text
    assert lps == pytest.approx(out["logprobs"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(out["response_ids"])


def test_n_choices_and_stop_strings(ep):
    r = oai(ep).chat.completions.create(model="policy", messages=USER, n=6, temperature=1.0, stop=["1", "2"])
    (reqs, outs) = ep.client.calls[-1]
    assert len(reqs) == 6 and len(r.choices) == 6 and all(q["temperature"] == 1.0 for q in reqs)
    tok = ep.session.tok
    for choice, out, rec in zip(r.choices, outs, ep.session.tips[-6:]):
        raw = tok.decode(out["response_ids"], skip_special_tokens=True)
        assert "1" not in choice.message.content and "2" not in choice.message.content
        kept = rec.response_ids
        assert kept == out["response_ids"][: len(kept)]          # a cut, never a re-tokenisation
        if "1" in raw or "2" in raw:
            assert choice.finish_reason == "stop" and len(kept) < len(out["response_ids"])
        else:
            assert kept == out["response_ids"]


def test_seed_makes_sampling_reproducible(ep):
    def sample():
        oai(ep).completions.create(model="m", prompt="37+48=", n=3, temperature=1.0, seed=123, max_tokens=6)
        return [o["response_ids"] for o in ep.client.calls[-1][1]]

    first = sample()
    assert sample() == first
    assert [q["seed"] for q in ep.client.calls[-1][0]] == [123, 124, 125]


def test_a_seeded_trajectory_gives_every_call_and_choice_its_own_stream(server, engine):
    loop, proxy = server
    client = RecordingClient(engine)
    ep = loop.run(proxy.open(client, dict(GREEDY, temperature=1.0, seed=5)))
    try:
        for _ in range(2):
            oai(ep).completions.create(model="m", prompt="37+48=", n=2, max_tokens=2)
    finally:
        proxy.close(ep)
    seeds = [q["seed"] for reqs, _ in client.calls for q in reqs]
    assert seeds[0] == 5 and len(set(seeds)) == 4


def test_forced_sampling_takes_the_rollouts_seeds_over_an_agents_own(server, engine, model_path):
    """proxy.force_sampling: an agent's fixed seed (and temperature) would give every sample of a group the
    same answer and ignore run.seed; the trajectory's own per-call seeds are used instead."""
    from stages.agentflow.session import turn_seed

    loop, _ = server
    proxy = Proxy(load_tokenizer(model_path), force_sampling=True)
    loop.run(proxy.start())
    client = RecordingClient(engine)
    ep = loop.run(proxy.open(client, dict(GREEDY, temperature=1.0, seed=5)))
    try:
        oai(ep).completions.create(model="m", prompt="37+48=", n=2, max_tokens=2, seed=123, temperature=0.0)
    finally:
        proxy.close(ep)
        loop.run(proxy.stop())
    ((reqs, _),) = client.calls
    assert [q["seed"] for q in reqs] == [turn_seed(5, 0, 0), turn_seed(5, 0, 1)]
    assert [q["temperature"] for q in reqs] == [1.0, 1.0]


# ---- completions ----------------------------------------------------------------------------
def test_completions_text_then_token_ids_extend_one_segment(ep):
    client = oai(ep)
    r1 = client.completions.create(model="policy", prompt="12+13=", max_tokens=4, logprobs=0)
    (_, (out1,)) = ep.client.calls[-1]
    assert r1.choices[0].logprobs.token_logprobs == pytest.approx(out1["logprobs"])
    ids = ep.session.final.stream.ids + encode(ep.session.tok, "12+13=")
    chunks = list(client.completions.create(model="policy", prompt=ids, max_tokens=4, stream=True))
    (req2,), (out2,) = ep.client.calls[-1]
    assert req2["prompt_ids"] == ids and len(ep.session.tree) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ep.session.final.text
    assert ep.session.final.stream.loss_mask.count(1) == len(out1["response_ids"]) + len(out2["response_ids"])


# ---- tool calls ------------------------------------------------------------------------------
def test_tool_call_format_and_history_render(ep, model_path):
    text = 'let me compute<tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "let me compute" and calls[0]["function"]["name"] == "calculator"
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "37+48"}
    msg = assistant_message(read_generation(text, parse_calls=True, reasoning=False))
    finish = finish_reason(Choice(TokenStream([]), [], [], text, "stop", "completed", 0.0, message=msg))
    assert finish == "tool_calls" and msg["content"] == "let me compute"
    assert [c["function"] for c in msg["tool_calls"]] == [c["function"] for c in calls]
    # the fallback template writes a call back the way it was read, so a tool turn round-trips
    tok = load_tokenizer(model_path)
    tok.chat_template = FALLBACK_TEMPLATE
    turn = [{"role": "assistant", "content": "let me compute", "tool_calls": calls}]
    assert render(tok, turn) == text + tok.eos_token
    # over HTTP: a tool-calling history with a tool result is accepted and rendered
    history = USER + [{"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "tool", "tool_call_id": calls[0]["id"], "content": "85"}]
    r = oai(ep).chat.completions.create(model="policy", messages=history,
                                        tools=[{"type": "function", "function": {"name": "calculator",
                                                                                 "parameters": {"type": "object"}}}])
    (req2,), _ = ep.client.calls[-1]
    assert req2["prompt_ids"] == encode(tok, render(tok, history))
    assert r.choices[0].finish_reason in ("stop", "length")   # the tiny model writes no <tool_call>


# ---- bad input ---------------------------------------------------------------------------------
def test_auth_routes_and_limits(ep):
    url = ep.base_url + "/chat/completions"
    body = {"model": "m", "messages": USER}
    status, err = post(url, body, None)
    assert status == 401 and "missing API key" in err["error"]["message"]
    assert post(url, body, "sk-wrong")[0] == 401
    assert post(url.replace(ep.route, "x" * len(ep.route)), body, ep.api_key)[0] == 404
    assert post(ep.base_url + "/embeddings", body, ep.api_key)[0] == 404
    status, err = post(url, json.dumps({"messages": [{"role": "user", "content": "1" * (65 << 10)}]}).encode(),
                       ep.api_key)
    assert status == 413 and err["error"]["type"] == "invalid_request_error"
    assert ep.client.calls == []   # nothing reached the engine


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    ({"messages": USER, "seed": 1.5}, "'seed'"),
    ({"messages": USER, "n": 0}, "'n' must be an integer"),
    ({"messages": USER, "temperature": "hot"}, "'temperature'"),
    ({"messages": USER, "max_tokens": 0}, "'max_tokens'"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"messages": USER, "stop": ["a", ""]}, "'stop'"),
])
def test_malformed_requests_get_400_with_a_message(ep, body, fragment):
    status, err = post(ep.base_url + "/chat/completions", body, ep.api_key)
    assert status == 400 and fragment in err["error"]["message"]
    assert ep.client.calls == []
    # the trajectory records the status its program saw (a harness's error statuses show in a run's rows)
    assert ep.session.notes == ["answered HTTP 400 to POST /chat/completions"]


@pytest.mark.parametrize("extra, note", [
    ({"frequency_penalty": 0.5}, "'frequency_penalty'=0.5 accepted but not honoured"),
    ({"top_logprobs": 3}, "'top_logprobs'=3 accepted but not honoured"),
    ({"tool_choice": "required"}, "'tool_choice'='required' names no tool of the request: served as auto"),
    ({"stop": ["a", "b", "c", "d", "e"]}, None),
    ({"max_tokens": 10 ** 6}, None),
    ({"reasoning_effort": "high", "x_vendor_knob": {"a": 1}}, "ignored unknown field 'x_vendor_knob'"),
])
def test_fields_that_cannot_be_honoured_are_accepted_and_recorded(ep, extra, note):
    status, body = post(ep.base_url + "/chat/completions", {"messages": USER} | extra, ep.api_key)
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
    assert any(note in n for n in ep.session.notes) if note else ep.session.notes == []
    assert len(ep.client.calls) == 1


def test_turn_limit_and_closed_endpoint(ep, server):
    client = oai(ep)
    for _ in range(4):
        client.completions.create(model="m", prompt="1+1=", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="turn limit"):
        client.completions.create(model="m", prompt="1+1=", max_tokens=2)
    assert ep.session.truncated and ep.session.status == "truncated"
    server[1].close(ep)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="m", prompt="1+1=", max_tokens=2)
