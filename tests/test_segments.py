"""The segment tree over real HTTP: request-kind headers, compaction, subagents, and a chat template
that rewrites history (the new segment starts at the longest run of recorded tokens, none re-tokenised).

A real proxy in front of a real HFEngine actor, called with the real `openai` client. Every check
compares the proxy's records with what the engine itself returned (RecordingClient), token for token.
"""
from __future__ import annotations

import copy

import openai
import pyarrow as pa
import pytest
import ray
import torch

from stages.agentflow.blackbox import openai_agent
from stages.agentflow.chat import encode
from stages.agentflow.engine import HFEngine
from stages.agentflow.harness import AGENT_HEADER, KIND_HEADER
from stages.agentflow.proxy import Proxy
from stages.model import load_tokenizer
from tests.support.proxy import GREEDY, LoopThread, RecordingClient

# the addition model's alphabet is digits, '+' and '='. This template adds an opener ("+=") after the
# last message, as reasoning templates open a <think> block in the generation prompt, and renders an
# earlier assistant turn without it: history is then NOT an extension of what the engine saw.
OPENER_TEMPLATE = (
    "{%- for m in messages -%}{{ m['content'] }}{%- if m['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}+={%- endif -%}"
)
U1, U2 = {"role": "user", "content": "37+48="}, {"role": "user", "content": "12+7="}


@pytest.fixture(scope="module")
def engine(ray_session, tiny_model_dir):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(tiny_model_dir)
    ray.get(eng.info.remote())
    yield eng
    ray.kill(eng)


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.stop()


def _proxy(loop, tok):
    proxy = Proxy(tok)
    loop.run(proxy.start())
    return proxy


@pytest.fixture(scope="module")
def plain(loop, tiny_model_dir):
    proxy = _proxy(loop, load_tokenizer(tiny_model_dir))    # the fallback template: append-only
    yield proxy
    loop.run(proxy.stop())


@pytest.fixture(scope="module")
def opener(loop, tiny_model_dir):
    tok = copy.deepcopy(load_tokenizer(tiny_model_dir))
    tok.chat_template = OPENER_TEMPLATE
    proxy = _proxy(loop, tok)
    yield proxy
    loop.run(proxy.stop())


def _open(loop, proxy, engine, turns=16):
    client = RecordingClient(engine)
    ep = loop.run(proxy.open(client, dict(GREEDY), max_turns=turns))
    ep.client = client
    return ep


def _chat(ep, messages, kind=None, agent=None):
    headers = {**({KIND_HEADER: kind} if kind else {}), **({AGENT_HEADER: agent} if agent else {})}
    oai = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    r = oai.chat.completions.create(model="policy", messages=messages, extra_headers=headers)
    (req,), (out,) = ep.client.calls[-1]
    return r.choices[0].message.content, req, out


def _model_tokens(stream) -> list[int]:
    return [t for t, m in zip(stream.response_ids, stream.loss_mask) if m]


def test_headers_build_the_tree_and_each_segment_row_trains_its_own_tokens(loop, plain, engine):
    ep = _open(loop, plain, engine)
    a1, req1, out1 = _chat(ep, [U1])
    a2, req2, out2 = _chat(ep, [U1, {"role": "assistant", "content": a1}, U2])        # extends: same segment
    hist = [U1, {"role": "assistant", "content": a1}, U2, {"role": "assistant", "content": a2}, U1]
    summary, req3, out3 = _chat(ep, hist, kind="compaction")                            # summary of the history
    _, req4, out4 = _chat(ep, [U2, {"role": "user", "content": summary + "="}])        # main, after it
    sub_a, req5, out5 = _chat(ep, [{"role": "user", "content": "99+1="}], kind="subagent", agent="a")
    _, req6, out6 = _chat(ep, [{"role": "user", "content": "99+1="}, {"role": "assistant", "content": sub_a}, U2],
                          kind="subagent", agent="a")
    s = ep.session
    assert [(g.kind, g.agent, g.parent, g.calls) for g in s.tree] == [
        ("main", "", -1, 2), ("compaction", "", 0, 1), ("main", "", 1, 1), ("subagent", "a", 2, 2)]
    main, comp, main2, sub = s.tree
    # each row: its first call's prompt, then only tokens the engine produced (trained) or new context
    assert main.stream.prompt_ids == req1["prompt_ids"]
    assert _model_tokens(main.stream) == out1["response_ids"] + out2["response_ids"]
    assert main.stream.ids == req2["prompt_ids"] + out2["response_ids"]
    assert comp.stream.prompt_ids == req3["prompt_ids"] and comp.stream.response_ids == out3["response_ids"]
    assert comp.start == len(req3["prompt_ids"]) - len(encode(plain.tok, U1["content"]))   # all of main's stream
    assert req3["prompt_ids"][:comp.start] == main.stream.ids                               # reused as recorded
    assert main2.stream.prompt_ids == req4["prompt_ids"] and main2.stream.response_ids == out4["response_ids"]
    assert _model_tokens(sub.stream) == out5["response_ids"] + out6["response_ids"]
    assert sub.stream.prompt_ids == req5["prompt_ids"] and sub.start == 0
    assert s.kind_counts() == {"main": 2, "compaction": 1, "subagent": 1, "side": 0} and s.calls == 6
    assert [g.id for g in s.rows()] == [0, 1, 2, 3]
    plain.close(ep)


def test_a_template_that_rewrites_history_starts_a_segment_at_the_longest_recorded_prefix(loop, opener, engine):
    ep = _open(loop, opener, engine)
    a1, req1, out1 = _chat(ep, [U1])
    tip = ep.session.tree[0].stream
    assert req1["prompt_ids"] == encode(opener.tok, "37+48=+=")
    _, req2, out2 = _chat(ep, [U1, {"role": "assistant", "content": a1}, U2])
    text2 = "37+48=" + a1 + opener.tok.eos_token + "12+7=+="
    shared = len(encode(opener.tok, "37+48="))      # the rendered history drops the opener after "37+48="
    s = ep.session
    assert len(s.tree) == 2 and [(g.kind, g.parent, g.start) for g in s.tree] == [("main", -1, 0), ("main", 0, shared)]
    # the new prompt: the recorded tokens up to where the texts part, then the rest tokenized, nothing else
    assert req2["prompt_ids"][:shared] == tip.ids[:shared]
    assert req2["prompt_ids"] == tip.ids[:shared] + encode(opener.tok, text2[len("37+48="):])
    first, second = s.rows()
    n1 = len(out1["response_ids"])
    assert first.stream.response_ids == out1["response_ids"] and first.stream.loss_mask == [1] * n1
    assert second.stream.prompt_ids == req2["prompt_ids"] and second.stream.response_ids == out2["response_ids"]
    assert s.reused_tokens == shared and s.resent_bytes == len("37+48=")
    opener.close(ep)


def test_a_bad_request_kind_is_a_400_naming_the_header(loop, plain, engine):
    ep = _open(loop, plain, engine)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(ep, [U1], kind="sidecar")
    assert e.value.body["param"] == "headers" and KIND_HEADER in e.value.body["message"]
    assert ep.session.calls == 0
    plain.close(ep)


# ---- the rollout and the trainer: a row per segment, a sample counted once ------------------------
@openai_agent
async def compacting(base_url, api_key, sample):
    """One main call, then a compaction call over the history (an in-process black-box agent)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    user = {"role": "user", "content": sample["prompt"]}
    r = await client.chat.completions.create(model="policy", messages=[user])
    history = [user, {"role": "assistant", "content": r.choices[0].message.content}, U1]
    await client.chat.completions.create(model="policy", messages=history, extra_headers={KIND_HEADER: "compaction"})


def test_the_rollout_makes_a_row_per_trained_segment(ray_session, engine, tiny_model_dir):
    from stages.agentflow.config import AgentConfig, SamplingConfig
    from stages.agentflow.rollout import AgentFlowRollout
    from stages.schema import table_from_columns

    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    agent = AgentConfig(name="tests.test_segments.compacting")
    rollout = AgentFlowRollout([engine], model_path=tiny_model_dir, sampling=sampling, agent=agent)
    batch = table_from_columns({"prompt_id": ["p", "p"], "group_id": [0, 0], "sample_idx": [0, 1],
                                "prompt": ["37+48=", "37+48="]})
    out = rollout(batch)
    segs = out.column("segment").to_pylist()
    assert out.num_rows == 4 and out.column("sample_idx").to_pylist() == [0, 0, 1, 1]
    assert [(g["id"], g["kind"], g["parent"]) for g in segs] == [(0, "main", -1), (1, "compaction", 0)] * 2
    stats = out.column("segment_stats").to_pylist()[0]
    assert stats["main"] == 1 and stats["compaction"] == 1 and stats["reused_tokens"] > 0
    assert set(out.column("status").to_pylist()) == {"completed"}

    only_main = AgentFlowRollout([engine], model_path=tiny_model_dir, sampling=sampling,
                                 agent=AgentConfig(name=agent.name, train_segments=("main",)))
    out = only_main(batch)
    assert out.num_rows == 2 and [g["kind"] for g in out.column("segment").to_pylist()] == ["main", "main"]
    rollout.close()
    only_main.close()


@openai_agent
async def until_refused(base_url, api_key, sample):
    """Calls the model until the proxy refuses (the trajectory token budget), then exits with an error."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    history = [{"role": "user", "content": sample["prompt"]}]
    while True:
        r = await client.chat.completions.create(model="policy", messages=history, max_tokens=1000)
        history += [{"role": "assistant", "content": r.choices[0].message.content}, U1]


def test_the_trajectory_token_budget_ends_a_trajectory_cleanly(ray_session, engine, tiny_model_dir):
    from stages.agentflow.config import AgentConfig, SamplingConfig
    from stages.agentflow.rollout import AgentFlowRollout
    from stages.schema import table_from_columns

    agent = AgentConfig(name="tests.test_segments.until_refused", max_turns=0, max_trajectory_tokens=5)
    rollout = AgentFlowRollout([engine], model_path=tiny_model_dir,
                               sampling=SamplingConfig(max_new_tokens=4, temperature=0.0), agent=agent)
    out = rollout(table_from_columns({"prompt_id": ["p"], "group_id": [0], "sample_idx": [0], "prompt": ["37+48="]}))
    rollout.close()
    (row,) = out.to_pylist()
    assert row["status"] == "truncated" and "token budget spent" in row["error"]
    assert sum(row["loss_mask"]) <= 5 and row["agent_stats"]["turns"] >= 2       # up to 4, then what was left
    assert any("agent.max_trajectory_tokens" in n for n in row["proxy_notes"])


def test_a_sample_of_several_rows_counts_once_in_its_group():
    from pipeline.window import Window
    from stages.batcher_config import BatcherConfig
    from stages.update.advantages import compute_advantages
    from stages.update.step import sample_weights

    t = pa.table({"group_id": [0, 0, 0, 0], "sample_idx": [0, 0, 0, 1], "status": ["completed"] * 4,
                  "reward": [1.0, 1.0, 1.0, 0.0], "token_versions": [[0]] * 4})
    b = Window(BatcherConfig(groups_per_step=1), n_samples=2)
    assert b.feed(t.slice(0, 3)) == [] and b.feed(t.slice(3)) == [0]    # complete when sample 1 arrives
    w = sample_weights(t)
    assert w.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0])
    adv = compute_advantages("grpo", torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.zeros(4), torch.ones(4, 1), weights=w)
    two = compute_advantages("grpo", torch.tensor([1.0, 0.0]), torch.zeros(2), torch.ones(2, 1))
    assert adv[:, 0].tolist() == pytest.approx([two[0, 0].item()] * 3 + [two[1, 0].item()], abs=1e-5)
    rloo = compute_advantages("rloo", torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.zeros(4), torch.ones(4, 1), weights=w)
    assert rloo[:, 0].tolist() == pytest.approx([1.0, 1.0, 1.0, -1.0])
    assert sample_weights(t.slice(2)) is None      # one row per sample: no weights
