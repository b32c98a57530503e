"""The proxy's four endpoints (Chat Completions, Completions, Responses, Messages) served by vLLM.

The proxy tests' scripted model (tests/support/scripted.py: a real Qwen2 whose weights follow a
script, 2 heads of 64) behind a VLLMEngine actor instead of the HF engine: the same fixtures and the
checks tests/test_proxy_protocols.py runs on the HF engine, here with this module's `engine`, plus a
Chat Completions and a Completions call. Every recorded token, log-prob and version must be the
engine's own.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import ray  # noqa: E402

from stages.agentflow.vllm_engine import VLLMConfig, VLLMEngine  # noqa: E402
from tests.support import scripted  # noqa: E402
from tests.support.scripted import END, HELLO, MORE, R_HI, assert_recorded_exactly, engine_call, oai  # noqa: E402

# the scripted model and its proxy, in front of this module's `engine`
model_dir, tok, server, ep = scripted.model_dir, scripted.tok, scripted.server, scripted.ep


def test_responses_reasoning_and_text_are_recorded_exactly(ep, tok):
    scripted.responses_reasoning_and_text_are_recorded_exactly(ep, tok)


def test_responses_function_call_loop_extends_the_recorded_stream(ep, tok):
    scripted.responses_function_call_loop_extends_the_recorded_stream(ep, tok)


def test_messages_thinking_text_and_stop_sequences(ep, tok):
    scripted.messages_thinking_text_and_stop_sequences(ep, tok)


def test_messages_stream_tool_use_and_tool_result_round_trip(ep, tok):
    scripted.messages_stream_tool_use_and_tool_result_round_trip(ep, tok)


@pytest.fixture(scope="module")
def engine(ray_session, model_dir):
    e = ray.remote(VLLMEngine).options(num_cpus=0.1, max_concurrency=16).remote(
        model_dir, "float32", 0, 1, "engine0", VLLMConfig(kv_cache_mb=64))
    assert ray.get(e.info.remote())["engine"] == "vllm"
    ray.get(e.generate.remote([{"prompt_ids": [5, 6, 7], "max_new_tokens": 8}] * 4))   # first calls build kernels
    yield e
    ray.kill(e)


def test_chat_completions_record_the_engines_tokens(ep, tok):
    r = oai(ep).chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi!"}],
                                        logprobs=True)
    _, resp, out = engine_call(ep)
    assert_recorded_exactly(ep)
    assert tok.decode(resp[:2]) == R_HI + HELLO and r.choices[0].message.content.endswith(HELLO + END + MORE)
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(out["logprobs"])


def test_completions_record_the_engines_tokens(ep, tok):
    r = oai(ep).completions.create(model="policy", prompt="hi!", max_tokens=8, logprobs=0)
    _, resp, out = engine_call(ep)
    assert_recorded_exactly(ep)
    assert r.choices[0].text == tok.decode(resp, skip_special_tokens=True)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(out["logprobs"])
