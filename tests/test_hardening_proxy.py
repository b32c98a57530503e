"""Hardening (issue 17, items 3 and 6): no request can stall an engine, bad input never leaks internals.

The real proxy over real HTTP with the real `openai` client, in front of a real HFEngine actor
(the tiny model: a 64-token context, a character tokenizer whose longest token, <|endoftext|>,
is 13 characters).
An over-long prompt is refused at every entry point: the proxy (400 context_length_exceeded),
a white-box ctx.generate (the trajectory fails, the batch goes on) and the engine itself (the
row fails, the other rows are served). Invalid input is a 400 naming the field; an unexpected
error is a generic 500 with a request id, its detail only in the log.
"""
from __future__ import annotations

import logging
import threading
import time

import openai
import pytest
import ray

from stages.agentflow.client import EngineClient
from stages.agentflow.config import AgentConfig, SamplingConfig
from stages.agentflow.engine import HFEngine
from stages.agentflow.engine_contract import plan_rows
from stages.agentflow.limits import PromptLimit
from stages.agentflow.proxy import Proxy
from stages.agentflow.rollout import AgentFlowRollout
from stages.model import load_tokenizer
from stages.schema import table_from_columns
from tests.support.proxy import GREEDY, CrashingEngine, LoopThread

USER = [{"role": "user", "content": "37+48="}]


@pytest.fixture(scope="module")
def engine(ray_session, tiny_model_dir):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(tiny_model_dir)
    ray.get(eng.info.remote())
    yield eng
    ray.kill(eng)


@pytest.fixture(scope="module")
def server(engine, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    loop = LoopThread()
    proxy = Proxy(tok, limit=PromptLimit.for_model(tiny_model_dir, tok))
    loop.run(proxy.start())
    yield loop, proxy
    loop.run(proxy.stop())
    loop.stop()


def endpoint(server, engine_or_client, max_turns: int = 8):
    loop, proxy = server
    client = engine_or_client if isinstance(engine_or_client, EngineClient) else EngineClient(engine_or_client)
    return loop.run(proxy.open(client, dict(GREEDY), max_turns=max_turns))


@pytest.fixture
def ep(server, engine):
    e = endpoint(server, engine)
    yield e
    server[1].close(e)


def oai(ep, timeout: float = 20.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=timeout)


# ---- item 3: prompt length ----------------------------------------------------------------------------
def test_the_model_context_is_read_from_its_config(server):
    limit = server[1].limit
    assert (limit.context, limit.prompt_cap, limit.longest) == (64, 63, 13)


def test_a_2mb_message_gets_400_context_length_exceeded_fast_and_the_next_request_is_served(ep):
    client = oai(ep)
    t0 = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1" * (2 << 20)}])
    refused_s = time.perf_counter() - t0
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert "64 tokens" in err.value.message and "at most 63" in err.value.message
    assert refused_s < 2.0, f"refusing took {refused_s:.2f}s"
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="m", messages=USER)
    assert r.choices[0].finish_reason in ("stop", "length") and time.perf_counter() - t0 < 10
    assert ep.session.calls == 1        # the refused request was not a model call


def test_a_long_prompt_is_counted_off_the_loop_while_other_trajectories_are_served(server, engine, tiny_model_dir):
    """With no cheap bound (longest=0) 1.5M characters must be tokenized to be counted (seconds with
    this tokenizer): that runs on a thread, and another trajectory's call is answered meanwhile."""
    loop, _ = server
    proxy = Proxy(load_tokenizer(tiny_model_dir), limit=PromptLimit(context=64))
    slow, quick = (loop.run(proxy.open(EngineClient(engine), dict(GREEDY))) for _ in range(2))
    done: dict[str, float] = {}

    def long_call():
        try:
            oai(slow, timeout=60).chat.completions.create(model="m", messages=[{"role": "user",
                                                                                "content": "1" * 1_500_000}])
        except openai.BadRequestError as e:
            done["long"], done["code"] = time.perf_counter(), e.code

    try:
        worker = threading.Thread(target=long_call)
        worker.start()
        time.sleep(0.3)                     # the long prompt is being tokenized
        assert oai(quick).chat.completions.create(model="m", messages=USER).choices
        done["quick"] = time.perf_counter()
        worker.join(60)
    finally:
        for e in (slow, quick):
            proxy.close(e)
        loop.run(proxy.stop())
    assert done["code"] == "context_length_exceeded" and done["quick"] < done["long"]


def test_a_prompt_over_the_context_by_exact_count_gets_400(ep):
    """100 characters pass the cheap bound (13 characters a token at most: 819) but are 100 tokens."""
    client = oai(ep)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1" * 100}])
    assert err.value.code == "context_length_exceeded" and "The prompt has 100 tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt=[5] * 64)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert ep.session.calls == 0


def test_max_tokens_is_clamped_to_the_room_left(ep):
    """60 prompt tokens leave 4: an explicit max_tokens of 6 (or of a million) is clamped to them, never a 400;
    a completion cut there ran out of context, and says so (finish_reason length)."""
    client = oai(ep)
    prompt = "1" * 60
    for asked in (6, 10 ** 6):
        r = client.completions.create(model="m", prompt=prompt, max_tokens=asked)
        assert r.usage.prompt_tokens == 60 and r.usage.completion_tokens <= 4
        assert len(ep.session.final.stream.ids) <= 64
        assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 4 else "stop")
    r = client.completions.create(model="m", prompt=prompt)
    assert r.usage.prompt_tokens == 60 and r.usage.completion_tokens <= 4
    assert len(ep.session.final.stream.ids) <= 64      # prompt + completion inside the context


def test_rollout_max_prompt_tokens_bounds_proxy_prompts(server, engine, tiny_model_dir):
    loop, _ = server
    tok = load_tokenizer(tiny_model_dir)
    proxy = Proxy(tok, limit=PromptLimit.for_model(tiny_model_dir, tok, max_prompt=5))
    e = loop.run(proxy.open(EngineClient(engine), dict(GREEDY)))
    try:
        client = oai(e)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=USER)     # 6 tokens
        assert err.value.code == "context_length_exceeded" and "sampling.max_prompt_tokens" in err.value.message
        assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}]).choices
    finally:
        proxy.close(e)
        loop.run(proxy.stop())


def test_the_engine_refuses_an_over_long_row_and_serves_the_others(engine):
    ok = {"prompt_ids": [6, 10, 13, 7, 11, 14], "max_new_tokens": 6, "temperature": 0.0}
    rows = [ok | {"prompt_ids": [5] * 5000}, ok, ok | {"prompt_ids": [6, 10, 10 ** 9]},
            ok | {"prompt_ids": [5] * 60, "max_new_tokens": 48}, ok | {"max_new_tokens": "many"}]
    t0 = time.perf_counter()
    long, good, oov, clipped, bad = ray.get(engine.generate.remote(rows), timeout=30)
    assert time.perf_counter() - t0 < 10
    assert long["status"] == "failed" and long["code"] == "context_length_exceeded"
    assert "5000 tokens" in long["error"] and "64" in long["error"] and long["response_ids"] == []
    assert oov["status"] == "failed" and "'prompt_ids' must be token ids" in oov["error"]
    assert bad["status"] == "failed" and "'max_new_tokens'" in bad["error"]
    assert good["status"] in ("completed", "truncated") and len(good["response_ids"]) >= 1
    assert len(clipped["response_ids"]) <= 4 and clipped["status"] in ("completed", "truncated")


def test_sglang_rows_are_checked_and_clipped_before_the_server_sees_them():
    """SGLang refuses a whole batch when one row's input + max_new_tokens reaches its context."""
    ok = {"prompt_ids": [6, 10, 13], "max_new_tokens": 8}
    rows = [ok | {"prompt_ids": [5] * 63}, ok, ok | {"prompt_ids": [5] * 60}, ok | {"prompt_ids": [-1]}]
    out, todo = plan_rows(rows, context=64, vocab=20, eos_id=1, reserve=1)     # SGLang's reserve
    assert out[0]["status"] == "failed" and out[0]["code"] == "context_length_exceeded"
    assert out[3]["status"] == "failed" and "prompt_ids" in out[3]["error"]
    assert [(i, budget) for i, _, budget in todo] == [(1, 8), (2, 3)]   # 60 + 3 < 64


# ---- item 6: invalid input -------------------------------------------------------------------------------
def test_content_null_is_a_400_naming_the_message(ep):
    client = oai(ep)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "system", "content": "be brief"},
                                                            {"role": "user", "content": None}])
    assert err.value.param == "messages[1].content" and "null" in err.value.message
    # an assistant turn that only calls tools may have null content
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    r = client.chat.completions.create(model="m", messages=USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "85"}])
    assert r.choices


def test_a_tool_choice_whose_function_is_not_an_object_is_a_400_naming_it(ep):
    with pytest.raises(openai.BadRequestError) as err:
        oai(ep).chat.completions.create(model="m", messages=USER, tool_choice={"type": "function", "function": "x"},
                                        tools=[{"type": "function", "function": {"name": "x", "parameters": {}}}])
    assert err.value.param == "tool_choice"


def test_out_of_vocabulary_token_ids_are_a_400_naming_the_prompt(ep):
    client = oai(ep)
    for ids, fragment in [([6, 10, 10 ** 6], "prompt[2] = 1000000 is not a token id"), ([6, True], "'prompt'")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="m", prompt=ids)
        assert err.value.param == "prompt" and fragment in err.value.message
    assert client.completions.create(model="m", prompt=[6, 10, 13, 7, 11, 14]).choices   # the engine is fine
    assert ep.session.calls == 1


def test_an_unexpected_error_is_a_generic_500_with_a_request_id_and_the_detail_only_in_the_log(
        server, ray_session, caplog):
    e = endpoint(server, CrashingEngine.remote())
    try:
        with caplog.at_level(logging.ERROR, logger="loongsage.proxy"):
            with pytest.raises(openai.InternalServerError) as err:
                oai(e).chat.completions.create(model="m", messages=USER)
    finally:
        server[1].close(e)
    body = err.value.response.text
    rid = err.value.request_id
    assert err.value.status_code == 500 and rid and rid.startswith("req_") and rid in body
    assert err.value.body["type"] == "server_error"
    for leak in ("RayTaskError", "pid=", "\x1b[", "boom", "Traceback", "actor"):
        assert leak not in body, f"{leak!r} leaked into the response: {body}"
    logged = [r for r in caplog.records if r.name == "loongsage.proxy" and rid in r.getMessage()]
    assert logged and "boom" in logged[0].exc_text


# ---- the white-box path ----------------------------------------------------------------------------------
class ObserveAlot:
    """A white-box agent whose environment returns far more text than the context holds."""

    async def run(self, ctx, sample):
        await ctx.generate()
        ctx.add_text("1" * 100_000)
        await ctx.generate()


def _rollout(engine, model_dir, prompts: list[str], max_prompt_tokens: int = 0, **agent):
    stage = AgentFlowRollout([engine], None, model_dir, agent=AgentConfig(**agent),
                             sampling=SamplingConfig(max_new_tokens=4, temperature=0.0,
                                                     max_prompt_tokens=max_prompt_tokens))
    n = len(prompts)
    batch = table_from_columns({"prompt_id": [f"p{i}" for i in range(n)], "group_id": list(range(n)),
                                "sample_idx": [0] * n, "data_source": ["addition"] * n, "prompt": prompts,
                                "answer": [""] * n})
    try:
        return stage(batch).to_pylist()
    finally:
        stage.close()


def test_a_white_box_turn_over_the_context_fails_its_trajectory_and_the_batch_goes_on(engine, tiny_model_dir):
    rows = _rollout(engine, tiny_model_dir, ["1" * 100, "37+48=", "1" * 1000, "1" * 61])
    long, good, hopeless, near = rows
    for row in (long, hopeless):
        assert row["status"] == "failed" and row["agent_stats"]["fail"] == "error"
        assert "ContextLengthExceeded" in row["error"] and "maximum context length is 64" in row["error"]
    assert "(1000 characters) has at least 77 tokens" in hopeless["error"]    # refused before tokenizing
    assert good["status"] in ("completed", "truncated") and good["response_ids"]
    # 61 prompt tokens leave 3: the turn is clipped to the context, not failed
    assert near["status"] in ("completed", "truncated") and 1 <= len(near["response_ids"]) <= 3


def test_white_box_limits_follow_rollout_max_prompt_tokens_and_cover_added_text(engine, tiny_model_dir):
    short, long = _rollout(engine, tiny_model_dir, ["1+1=", "37+48="], max_prompt_tokens=5)
    assert short["status"] in ("completed", "truncated")
    assert long["status"] == "failed" and "sampling.max_prompt_tokens" in long["error"]
    (row,) = _rollout(engine, tiny_model_dir, ["1+1="], name=f"{__name__}.ObserveAlot")
    assert row["status"] == "failed" and "ContextLengthExceeded" in row["error"]
