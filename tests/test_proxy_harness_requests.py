"""What the real harnesses send, against the real proxy: requests captured from Claude Code, Codex CLI,
opencode and pi (tests/fixtures/harness_requests/, sanitized: no keys, zeroed device ids), replayed
unmodified over HTTP in front of a real HFEngine actor; and the protocol fields they use, each checked
with the official `anthropic` and `openai` clients.

The fixtures were captured by pointing each CLI (installed from npm) at a loopback server that logged
what it received: `claude -p` (ANTHROPIC_BASE_URL), `codex exec` (a config.toml model_provider),
`opencode run` (an opencode.json provider), `pi -p` (~/.pi/agent/models.json). The `_turn2` files are
each harness's second call, after a tool call the server answered with. The full-size requests
(Claude Code's 19k-token prompt, Codex's 9k) are parsed, rendered and tokenized here; those a tiny
CPU engine can prefill quickly (under ~2k tokens) are also served end to end.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
import ray

from stages.agentflow.chat import render
from stages.agentflow.engine import HFEngine
from stages.agentflow.limits import PromptLimit
from stages.agentflow.proxy import PROTOCOLS, Proxy
from stages.model import load_tokenizer
from tests.support.proxy import LoopThread, RecordingClient
from tests.support.scripted import ADD_TOOL_ANT, ADD_TOOL_OAI, GREEDY, build_qwen_scripted_model, build_scripted_model

FIXTURES = Path(__file__).parent / "fixtures" / "harness_requests"
SERVED = ["claude_code_small_messages.json", "claude_code_small_messages_turn2.json", "pi_chat.json",
          "pi_chat_turn2.json", "opencode_title_chat.json"]
DROP_HEADERS = {"content-type", "accept", "user-agent", "content-length", "host", "x-api-key", "authorization"}


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def parse_fixture(fx: dict):
    """The fixture's body as the proxy's adapter reads it: (messages, tools, notes)."""
    call = PROTOCOLS[fx["path"].split("/v1/", 1)[-1]].parse(fx["body"])
    return call.messages, call.tools, call.notes


# ---- every captured request: parsed, rendered and tokenized with Qwen's vocabulary -------------------------
@pytest.fixture(scope="module")
def qwen_tok():
    qwen_vocab = pytest.importorskip("stages.tasks.qwen_vocab")
    try:
        return qwen_vocab.build_qwen_tokenizer()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_every_captured_request_is_accepted_and_rendered(name, qwen_tok):
    messages, tools, notes = parse_fixture(fixture(name))
    text = render(qwen_tok, messages, tools)
    assert text.endswith("<|im_start|>assistant\n") and messages[-1]["role"] in ("user", "tool", "system")
    if name.startswith("claude_code_messages"):
        # Claude Code's mid-conversation system message is a system turn where it stands, after the user's
        assert [m["role"] for m in messages[:3]] == ["system", "user", "system"]
        assert "<|im_start|>system\nAvailable agent types" in text
        assert any(n.startswith("output_config") for n in notes)
        assert any(n.startswith("context_management") for n in notes)
    if name.startswith("codex"):
        assert "ignored unknown field 'client_metadata'" in notes
        assert any("'web_search' cannot be served" in n for n in notes)
        names = {t["function"]["name"] for t in tools}
        assert {"exec_command", "close_agent"} <= names          # a namespace's tools, flattened
    if name.endswith("turn2.json"):
        assert any(m.get("tool_calls") for m in messages) and any(m["role"] == "tool" for m in messages)


# ---- the small ones, served end to end ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_server(ray_session, tmp_path_factory, qwen_tok):
    from stages.agentflow.chat import tool_call_opening
    from stages.tasks import qwen_vocab

    path = build_qwen_scripted_model(tmp_path_factory.mktemp("qwen"), qwen_tok, tool_call_opening(qwen_tok))
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(path)
    ray.get(eng.info.remote())
    loop = LoopThread()
    proxy = Proxy(qwen_tok, limit=PromptLimit(context=qwen_vocab.CONTEXT))
    loop.run(proxy.start())
    yield loop, proxy, eng
    loop.run(proxy.stop())
    loop.stop()
    ray.kill(eng)


def replay(ep, fx: dict) -> tuple[int, bytes]:
    """POST the fixture's body as its harness sent it (its own headers, this endpoint's key)."""
    headers = {k: v for k, v in fx["headers"].items() if k.lower() not in DROP_HEADERS}
    headers |= {"Content-Type": "application/json", "Authorization": f"Bearer {ep.api_key}",
                "x-api-key": ep.api_key}
    path = fx["path"].removeprefix("/v1")
    req = urllib.request.Request(ep.base_url + path, data=json.dumps(fx["body"]).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("name", SERVED)
def test_captured_requests_replay_with_200(name, qwen_server):
    loop, proxy, eng = qwen_server
    client = RecordingClient(eng)
    ep = loop.run(proxy.open(client, dict(GREEDY, max_new_tokens=12), max_turns=8))
    try:
        fx = fixture(name)
        status, raw = replay(ep, fx)
        assert status == 200, raw[:500]
        text = raw.decode()
        assert text.rstrip().endswith("message_stop\"}" if "messages" in fx["path"] else "data: [DONE]")
        (req,), (out,) = client.calls[-1]
        assert ep.session.final.stream.ids == req["prompt_ids"] + out["response_ids"]   # recorded = the engine's
        # a harness asking for 16k-64k tokens is served what the rollout allows, as a reply it can carry on from
        body = fx["body"]
        assert body.get("max_tokens", body.get("max_completion_tokens")) > 12
        assert '"stop_reason":"max_tokens"' not in text and '"finish_reason":"length"' not in text
        kinds = [s.kind for s in ep.session.tree]
        assert kinds == (["side"] if name.startswith("opencode_title") else ["main"])
    finally:
        proxy.close(ep)


def test_a_forced_tool_choice_on_chat_makes_the_model_call_it(qwen_server):
    loop, proxy, eng = qwen_server
    client = RecordingClient(eng)
    ep = loop.run(proxy.open(client, dict(GREEDY, max_new_tokens=12), max_turns=8))
    try:
        tools = [{"type": "function", "function": {"name": "add", "parameters": ADD_TOOL_OAI["parameters"]}}]
        r = oai(ep).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                            tool_choice={"type": "function", "function": {"name": "add"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add" and call.function.arguments == "{}"
        assert r.choices[0].finish_reason == "tool_calls" and ep.session.notes == []
    finally:
        proxy.close(ep)


# ---- fields the real programs send, with the official clients ------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_scripted_model(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def server(ray_session, model_dir):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(model_dir)
    ray.get(eng.info.remote())
    loop = LoopThread()
    tok = load_tokenizer(model_dir)
    proxy = Proxy(tok, limit=PromptLimit.for_model(model_dir, tok))
    loop.run(proxy.start())
    yield loop, proxy, eng
    loop.run(proxy.stop())
    loop.stop()
    ray.kill(eng)


@pytest.fixture
def ep(server):
    loop, proxy, eng = server
    client = RecordingClient(eng)
    endpoint = loop.run(proxy.open(client, dict(GREEDY, max_new_tokens=32), max_turns=8))
    endpoint.client = client
    yield endpoint
    proxy.close(endpoint)


def ant(ep) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=ep.api_key, max_retries=0, timeout=60)


def oai(ep) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=60)


def prompt_text(ep) -> str:
    """The text of the last call's stream (its prompt as rendered, then the completion)."""
    return ep.session.final.stream.text


def test_messages_fields_claude_code_sends(ep):
    msg = ant(ep).messages.create(
        model="claude-x", max_tokens=64000, system=[{"type": "text", "text": "Be brief. "}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi "},
                                               {"type": "image", "source": {"type": "base64", "media_type":
                                                                            "image/png", "data": "AAAA"}}]},
                  {"role": "system", "content": "mid-conversation note. "},
                  {"role": "user", "content": "what is 2+3?"}],
        tools=[ADD_TOOL_ANT, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        extra_body={"output_config": {"effort": "high"}, "thinking": {"type": "adaptive"},
                    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                    "top_k": 5, "speed": "fast", "a_field_from_next_year": [1, 2]})
    assert msg.stop_reason == "tool_use" and msg.content[-1].name == "add"
    # system turns where they stand (the fallback template concatenates contents)
    assert prompt_text(ep).startswith("Be brief. hi mid-conversation note. what is 2+3?")
    notes = ep.session.notes
    for fragment in ("output_config", "context_management", "'top_k'=5", "'image' block dropped",
                     "'web_search_20250305' tool", "ignored unknown field 'a_field_from_next_year'"):
        assert any(fragment in n for n in notes), (fragment, notes)


def test_head_on_the_base_url_is_a_keyless_200(ep):
    """Claude Code opens its connection with `HEAD $ANTHROPIC_BASE_URL`, no key: a 200 that serves nothing."""
    base = ep.base_url.removesuffix("/v1")
    for url in (base, base + "/", ep.base_url, base.rsplit("/t/", 1)[0] + "/t/no-such-route"):
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10) as r:
            assert r.status == 200 and r.read() == b""
    with pytest.raises(urllib.error.HTTPError) as e:      # anything else still needs the key
        urllib.request.urlopen(urllib.request.Request(ep.base_url + "/models"), timeout=10)
    assert e.value.code == 401
    assert ep.client.calls == []


def test_messages_malformed_known_fields_are_anthropic_400s(ep):
    for bad in ({"max_tokens": 0}, {"max_tokens": "many"}, {"output_config": "high"}, {"stop_sequences": [""]}):
        body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]} | bad
        with pytest.raises(anthropic.BadRequestError) as e:
            ant(ep).messages.create(**body)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert ep.client.calls == []


def test_responses_codex_tools_and_items(ep):
    namespace = {"type": "namespace", "name": "calc", "description": "arithmetic", "tools": [ADD_TOOL_OAI]}
    tools = [namespace, {"type": "web_search", "external_web_access": False}]
    head = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "x"}]},
            {"type": "additional_tools", "role": "developer",
             "tools": [{"type": "function", "name": "echo", "parameters": {"type": "object"}}]},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            {"type": "message", "role": "user", "content": "2+3?"}]
    extra = {"client_metadata": {"x-codex-turn-metadata": "{}"}, "prompt_cache_key": "k"}
    r = oai(ep).responses.create(model="m", input=head, tools=tools, extra_body=extra, store=False,
                                 include=["reasoning.encrypted_content"])
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "add" and call.namespace == "calc" and json.loads(call.arguments) == {"a": 2, "b": 3}
    assert r.status == "completed"
    notes = ep.session.notes
    assert "ignored unknown field 'client_metadata'" in notes
    assert any("'web_search' cannot be served" in n for n in notes)
    assert any("'web_search_call' item dropped" in n for n in notes)
    assert prompt_text(ep).startswith("x2+3?")        # the dropped item left nothing in the prompt
    # the call comes back with its namespace and its arguments re-serialised, as Codex sends it: the
    # history still extends the recorded tokens (one segment, two calls)
    (reasoning,) = [o.model_dump(exclude_none=True) for o in r.output if o.type == "reasoning"]
    history = head + [reasoning, {"type": "function_call", "call_id": call.call_id, "name": "add", "namespace": "calc",
                                  "arguments": json.dumps(json.loads(call.arguments), separators=(",", ":"))},
                      {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    r2 = oai(ep).responses.create(model="m", input=history, tools=tools, extra_body=extra, store=False)
    assert r2.output_text == "The sum is 5."
    assert len(ep.session.tree) == 1 and ep.session.tree[0].calls == 2


def test_responses_custom_tool_gets_the_models_text_and_extends(ep):
    custom = {"type": "custom", "name": "add", "description": "free-form",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
    r = oai(ep).responses.create(model="m", input="2+3?", tools=[custom], store=False)
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert call.name == "add" and call.input == '{"a": 2, "b": 3}'      # the model's own text of the call
    (reasoning,) = [o.model_dump(exclude_none=True) for o in r.output if o.type == "reasoning"]
    history = [{"type": "message", "role": "user", "content": "2+3?"}, reasoning,
               {"type": "custom_tool_call", "call_id": call.call_id, "name": "add", "input": call.input},
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "5"}]
    r2 = oai(ep).responses.create(model="m", input=history, tools=[custom], store=False)
    assert r2.output_text == "The sum is 5."
    assert len(ep.session.tree) == 1 and ep.session.tree[0].calls == 2        # the history extended the tokens


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/responses", {"input": "hi"}),
    ("/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_json_nested_100000_deep_is_a_400_in_the_protocols_format(ep, path, body):
    deep = b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for raw in (deep, json.dumps(body | {"x": json.loads("[" * 70 + "]" * 70)}).encode()):
        req = urllib.request.Request(ep.base_url + path, data=raw, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {ep.api_key}", "x-api-key": ep.api_key})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400
        err = json.loads(e.value.read())
        message = err["error"]["message"]
        assert "levels deep" in message
        assert (err["type"] == "error") if path == "/messages" else (err["error"]["type"] == "invalid_request_error")
    assert ep.client.calls == []
    # 20 levels (a JSON schema in a tool nests about 10) is fine
    ok = urllib.request.Request(ep.base_url + path, data=json.dumps(body | {"x": json.loads("[" * 20 + "]" * 20)})
                                .encode(), headers={"Content-Type": "application/json",
                                                    "Authorization": f"Bearer {ep.api_key}",
                                                    "x-api-key": ep.api_key})
    with urllib.request.urlopen(ok, timeout=60) as r:
        assert r.status == 200



# ---- one rule for token limits -------------------------------------------------------------------------------
def _open(server, max_new_tokens: int, max_tokens: int = 0):
    loop, proxy, eng = server
    client = RecordingClient(eng)
    endpoint = loop.run(proxy.open(client, dict(GREEDY, max_new_tokens=max_new_tokens), 8, max_tokens))
    endpoint.client = client
    return endpoint


HI = [{"role": "user", "content": "hi!"}]      # the scripted model thinks, then writes "Hello there! END of it"


def test_a_completion_cut_by_the_rollout_cap_reads_as_finished_and_is_recorded_truncated(server):
    ep = _open(server, max_new_tokens=2)
    try:
        msg = ant(ep).messages.create(model="m", max_tokens=64000, messages=HI)
        assert msg.stop_reason == "end_turn" and msg.content[-1].text == "Hello there! "
        r = oai(ep).responses.create(model="m", input="hi!", max_output_tokens=128000)
        assert r.status == "completed" and r.incomplete_details is None
        c = oai(ep).chat.completions.create(model="m", messages=HI, max_tokens=32000)
        assert c.choices[0].finish_reason == "stop"
        for (req,), (out,) in ep.client.calls:
            assert req["max_new_tokens"] == 2 and out["status"] == "truncated"
        assert ep.session.status == "truncated"          # the truth stays with the trajectory
        assert any("cut at 2 tokens by sampling.max_new_tokens" in n for n in ep.session.notes)
        # the harness's own limit: its cut is reported as such
        c = oai(ep).chat.completions.create(model="m", messages=HI, max_tokens=1)
        assert c.choices[0].finish_reason == "length"
        msg = ant(ep).messages.create(model="m", max_tokens=1, messages=HI)
        assert msg.stop_reason == "max_tokens"
    finally:
        server[1].close(ep)


def test_the_trajectory_token_budget_ends_it_cleanly(server):
    ep = _open(server, max_new_tokens=32, max_tokens=3)
    try:
        c = oai(ep).chat.completions.create(model="m", messages=HI, max_tokens=1000)
        assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError) as e:
            oai(ep).chat.completions.create(model="m", messages=HI)
        assert e.value.code == "trajectory_budget_spent"
        assert ep.session.truncated and ep.session.status == "truncated" and ep.session.calls == 1
        assert any("agent.max_trajectory_tokens" in n for n in ep.session.notes)
    finally:
        server[1].close(ep)


# ---- segments from the harnesses' own signals ---------------------------------------------------------------
@pytest.mark.parametrize("headers, system, kind, agent", [
    ({"x-claude-code-agent-id": "agent-7"}, None, "subagent", "agent-7"),
    ({"x-codex-turn-metadata": json.dumps({"request_kind": "compaction", "agent_name": "/root"})}, None,
     "compaction", ""),
    ({"x-codex-turn-metadata": json.dumps({"request_kind": "turn", "agent_name": "/root/explorer"})}, None,
     "subagent", "/root/explorer"),
    ({"x-codex-turn-metadata": json.dumps({"request_kind": "turn", "agent_name": "/root"})}, None, "main", ""),
    ({}, "You are a title generator. You output ONLY a thread title.", "side", ""),
    ({}, "You are a context summarization assistant. Summarize.", "compaction", ""),
    ({"x-claude-code-agent-id": "agent-7", "x-loongsage-request-kind": "main"}, None, "main", ""),
])
def test_harness_signals_name_the_segment_kind(server, headers, system, kind, agent):
    ep = _open(server, max_new_tokens=4)
    try:
        main = oai(ep).chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "x"}]
        oai(ep).chat.completions.create(model="m", messages=messages, extra_headers=headers)
        seg = ep.session.tree[-1]
        assert (seg.kind, seg.agent) == (kind, agent) and len(ep.session.tree) == 2
        if kind == "side":      # a title call is not where the trajectory ends
            assert ep.session.final.text == main.choices[0].message.content
    finally:
        server[1].close(ep)


def test_a_re_serialised_history_extends_the_recorded_tokens_on_chat(ep):
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD_TOOL_OAI["parameters"]}}]
    user = [{"role": "user", "content": "2+3?"}]
    r = oai(ep).chat.completions.create(model="m", messages=user, tools=tools)
    msg = r.choices[0].message
    assert msg.content == "<think>\nuse add\n</think>\n\n"                 # the model's text, byte for byte
    assert msg.tool_calls[0].function.arguments == '{"a": 2, "b": 3}'      # as the model wrote it
    # as JS harnesses and litellm send it back: reasoning apart, arguments re-serialised
    back = {"role": "assistant", "content": "", "reasoning_content": "use add",
            "tool_calls": [{"id": msg.tool_calls[0].id, "type": "function",
                            "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]}
    tool = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"}
    r2 = oai(ep).chat.completions.create(model="m", messages=user + [back, tool], tools=tools)
    assert r2.choices[0].message.content == "The sum is 5."
    assert len(ep.session.tree) == 1 and ep.session.tree[0].calls == 2
    (req1,), (out1,) = ep.client.calls[0]
    (req2,), _ = ep.client.calls[1]
    assert req2["prompt_ids"][:len(req1["prompt_ids"]) + len(out1["response_ids"])] == \
        req1["prompt_ids"] + out1["response_ids"]                              # the model's tokens, as recorded

def test_a_tool_use_input_sent_back_as_an_object_extends_the_recorded_tokens(server):
    ep = _open(server, max_new_tokens=32)       # Claude Code sends a tool_use's input back as an object
    user = [{"role": "user", "content": "2+3?"}]
    r = ant(ep).messages.create(model="m", max_tokens=100, messages=user, tools=[ADD_TOOL_ANT])
    use = r.content[-1]
    blocks = [b.model_dump(exclude_none=True) for b in r.content]
    blocks[-1]["input"] = {"b": 3, "a": 2}      # the same object, re-serialised in another order
    history = user + [{"role": "assistant", "content": blocks},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    try:
        r2 = ant(ep).messages.create(model="m", max_tokens=100, messages=history, tools=[ADD_TOOL_ANT])
        assert r2.content[-1].text == "The sum is 5." and len(ep.session.tree) == 1 and ep.session.tree[0].calls == 2
    finally:
        server[1].close(ep)


# ---- bad input: the trajectory records what happened, the run goes on ----------------------------------------
def test_a_history_that_drops_or_reorders_turns_starts_a_segment(ep):
    a1 = oai(ep).chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
    turn = {"role": "assistant", "content": a1.choices[0].message.content}
    for history in ([{"role": "user", "content": "hi!"}, turn, {"role": "user", "content": "go"}],   # reordered
                    [{"role": "user", "content": "hi!"}]):                                            # dropped
        assert oai(ep).chat.completions.create(model="m", messages=history).choices
    assert ep.session.calls == 3 and len(ep.session.tree) == 3
    assert all(s.stream is not None for s in ep.session.tree)


def test_a_client_that_dies_mid_stream_leaves_the_call_recorded(ep, caplog):
    import socket

    body = json.dumps({"model": "m", "stream": True, "messages": HI}).encode()
    port = int(ep.base_url.split(":")[2].split("/")[0])
    path = ep.base_url.split(str(port))[1] + "/chat/completions"
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ep.api_key}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        s.recv(64)                  # the reply has begun
    r = oai(ep).chat.completions.create(model="m", messages=HI)     # the trajectory goes on
    assert r.choices[0].message.content and ep.session.calls == 2
    assert "failed" not in caplog.text
