"""The built-in harness examples (examples/agents/anthropic_tools.py, responses_tools.py) against
the real proxy: real subprocesses, the official `anthropic` and `openai` SDKs, real HFEngine actors.

* compaction and a subagent, on the built-in tiny addition model: the request kinds the agents
  send are the segments the proxy recorded;
* the tool loop (tool_use -> tool_result, function_call -> function_call_output), on a tiny
  character model SFT-trained here to write one `<tool_call>` (the built-in model's vocabulary
  cannot spell one): the call round-trips through the SDK and the chat template into one token
  stream, the tool's result recorded as context; a malformed call is just text;
* the recipes (configs/agent_anthropic.yaml, configs/agent_responses.yaml) end to end (slow tier).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from stages.agentflow.blackbox import agent_env, anthropic_base_url
from stages.agentflow.client import EngineClient
from stages.agentflow.engine import HFEngine
from stages.agentflow.proxy import Proxy
from stages.model import load_tokenizer
from stages.reward import agent_answers
from tests.support.proxy import LoopThread

ROOT = Path(__file__).resolve().parent.parent
AGENTS = {"anthropic": str(ROOT / "examples/agents/anthropic_tools.py"),
          "responses": str(ROOT / "examples/agents/responses_tools.py")}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>'
BROKEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+30"}</tool_call>'   # one brace short


def tool_model(out: Path) -> str:
    """A tiny Qwen2 on a character vocabulary that can spell a tool call, trained (seconds, one thread)
    to answer "37+48=" with CALL, the calculator's "85" after it with "85", and "12+30=" with BROKEN."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stages.tasks.models import build_char_tokenizer
    from stages.tasks.sft import sft

    tok = build_char_tokenizer("0123456789+=" + "".join(sorted(set(CALL))))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # a few 100-token rows: more threads only contend
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id))
    rows = [{"prompt": "37+48=", "answer": CALL}, {"prompt": f"37+48={CALL}{tok.eos_token}85", "answer": "85"},
            {"prompt": "12+30=", "answer": BROKEN}]
    try:
        sft(model, tok, rows, steps=80, lr=1e-2, batch_size=3, warmup=10)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def servers(ray_session, tiny_model_dir, tmp_path_factory):
    """{model name: (loop, proxy, engine)} for the built-in addition model and the tool-calling one."""
    loop, made = LoopThread(), {}
    for name, path in (("tiny", tiny_model_dir), ("tool", tool_model(tmp_path_factory.mktemp("tool_model")))):
        engine = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(path, num_threads=1)
        ray.get(engine.info.remote())
        proxy = Proxy(load_tokenizer(path))
        loop.run(proxy.start())
        made[name] = (proxy, engine)
    yield loop, made
    for proxy, engine in made.values():
        loop.run(proxy.stop())
        ray.kill(engine)
    loop.stop()


def run_agent(servers, model: str, agent: str, args: list[str], sample: dict, max_new_tokens: int = 8):
    """Run one example agent as AgentFlow does (its env, a subprocess) on a fresh endpoint:
    (its report, the last stdout line, with the reward `agent_answers` gives it; the proxy's Session)."""
    loop, made = servers
    proxy, engine = made[model]
    client = EngineClient(engine)
    ep = loop.run(proxy.open(client, GREEDY | {"max_new_tokens": max_new_tokens}, max_turns=12))
    try:
        env = os.environ | agent_env(ep.base_url, ep.api_key, sample)
        proc = subprocess.run([sys.executable, AGENTS[agent], *args], env=env, capture_output=True, text=True,
                              timeout=120)
    finally:
        proxy.close(ep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])     # graded as the recipes' reward.fn grades it
    return report | {"reward": agent_answers("", "", sample["answer"], {"agent_info": json.dumps(report)})}, ep.session


def test_agent_env_serves_both_sdks():
    env = agent_env("http://127.0.0.1:9/t/abc/v1", "sk-x", {"prompt": "1+1=", "answer": "2", "ids": [1]})
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/t/abc/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/t/abc"    # the SDK appends /v1/messages itself
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == "sk-x"
    assert json.loads(env["LOONGSAGE_SAMPLE"]) == {"prompt": "1+1="}     # never the answer, nor non-scalars
    assert anthropic_base_url("http://h/t/r/v1/") == "http://h/t/r"


@pytest.mark.parametrize("agent", ["anthropic", "responses"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_agent_compacts_and_asks_a_subagent(servers, agent, stream):
    """Two tries (the answer "-1" is never right, so both happen), a context of 8 characters, a
    verifier: main, subagent, compaction (the history "37+48=" + answer + "37+48=" is over 8
    characters), main again from [task, summary, task], subagent. The kinds the agent sent are
    the segments the proxy recorded, the compaction's child of the main segment it summarised."""
    args = ["--tries", "2", "--context-chars", "8", "--verify"] + ([] if stream else ["--no-stream"])
    last, session = run_agent(servers, "tiny", agent, args, {"prompt": "37+48=", "answer": "-1"})
    info = last
    assert last["reward"] == 0.0 and len(info["answers"]) == 2
    assert info["compactions"] == 1 and info["tool_calls"] == 0
    assert session.calls == 5     # main, verifier, compaction, main, verifier
    tree = session.tree
    kinds = [s.kind for s in tree]
    assert kinds.count("compaction") == 1 and set(kinds) == {"main", "compaction", "subagent"}, kinds
    assert all(s.agent == "verifier" for s in tree if s.kind == "subagent")
    assert all(s.agent == "" for s in tree if s.kind != "subagent")
    compaction = next(s for s in tree if s.kind == "compaction")
    assert tree[compaction.parent].kind == "main"   # it summarised the main history
    # the main segment after it starts from the summary: [task, summary, task] as the template renders it
    after = [s for s in tree if s.kind == "main" and s.id > compaction.id]
    assert after, kinds
    tok = session.tok
    summary_ids = compaction.stream.response_ids[-_runs(compaction.stream.loss_mask)[-1][1]:]   # its model turn
    summary = tok.decode(summary_ids, skip_special_tokens=True)
    prompt = tok.decode(after[0].stream.prompt_ids, skip_special_tokens=False)
    assert prompt == f"37+48={summary}{tok.eos_token}37+48=", (prompt, summary)


@pytest.mark.parametrize("agent", ["anthropic", "responses"])
def test_tool_loop_round_trips_into_one_token_stream(servers, agent):
    """The model writes a tool call; the SDK hands the agent a tool_use block / function_call item;
    the agent runs the calculator and sends the result back; the model answers "85". Both calls
    are one segment: the second prompt extends the first call's recorded stream (the model's call
    tokens trained, loss_mask 1; the tool result "85" context, loss_mask 0)."""
    last, session = run_agent(servers, "tool", agent, ["--max-tokens", "96"], {"prompt": "37+48=", "answer": "85"},
                              max_new_tokens=96)
    assert last["tool_calls"] == 1 and last["answers"] == ["85"] and last["reward"] == 1.0
    assert session.calls == 2 and [s.kind for s in session.tree] == ["main"]
    stream, tok = session.final.stream, session.tok
    assert tok.decode(stream.prompt_ids) == "37+48="
    pieces, at = [], 0
    for mask, n in _runs(stream.loss_mask):
        pieces.append((mask, tok.decode(stream.response_ids[at: at + n], skip_special_tokens=False)))
        at += n
    assert pieces == [(1, CALL + tok.eos_token), (0, "85"), (1, "85" + tok.eos_token)], pieces


@pytest.mark.parametrize("agent", ["anthropic", "responses"])
def test_a_malformed_tool_call_is_just_text(servers, agent):
    """The model's markup does not parse as a call: no tool_use reaches the agent, the text is its answer."""
    last, session = run_agent(servers, "tool", agent, ["--max-tokens", "96"], {"prompt": "12+30=", "answer": "42"},
                              max_new_tokens=96)
    assert last == {"answers": [BROKEN], "accepted": [True], "tool_calls": 0, "compactions": 0, "reward": 0.0}
    assert session.calls == 1


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    out = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


# ---- the recipes ------------------------------------------------------------------------------------------
# ~1-2 min each (every trajectory is a subprocess importing its SDK); the default tier covers the agents
# against the real proxy above, and black-box recipes through the pipeline in tests/test_agentflow.py
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["configs/agent_anthropic.yaml", "configs/agent_responses.yaml"])
def test_recipe_runs_end_to_end_with_compaction_rows(ray_session, tmp_path, recipe):
    """The recipe through the real pipeline (a smaller, briefly warmed model, 2 steps), with the retry
    and context limit that make its agent compact: the compactions are training rows of their own,
    each sample's rows share its reward, and the evaluation runs the agent."""
    import pyarrow.parquet as pq

    from pipeline.config import load_config
    from pipeline.controller import Controller
    from pipeline.metrics import read_metrics

    agent = load_config(recipe, []).agent.name
    cfg = load_config(recipe, [
        f"agent.name={agent.replace('--tries 1', '--tries 2 --context-chars 8')}",
        "run.steps=2", "batcher.groups_per_step=2", "rollout.n_samples=4", "trainer.mini_batch_size=0",
        "eval.num_prompts=4", "model.hidden_size=32", "model.num_layers=1", "model.warmup_steps=30",
        "model.warmup_rows=256", "model.warmup_lr=0.01", f"model.cache_dir={tmp_path / 'models'}"])
    ctl = Controller(cfg, tmp_path / "run", log=lambda *_: None)
    try:
        assert ctl.run()["steps"] == 2
    finally:
        ctl.stop()
    evals = [m for m in read_metrics(tmp_path / "run") if "eval/accuracy" in m]
    assert len(evals) == 2 and all(m["eval/failed"] == 0 and m["eval/turns"] >= 1 for m in evals)
    rows = pq.read_table(tmp_path / "run" / "rollouts").to_pylist()
    assert rows and all(r["status"] in ("completed", "truncated") for r in rows), [r["error"] for r in rows]
    by_sample: dict[tuple, list[dict]] = {}
    for r in rows:
        by_sample.setdefault((r["group_id"], r["sample_idx"]), []).append(r)
    assert len(by_sample) == 2 * 2 * 4     # steps x groups x samples
    kinds = [r["segment"]["kind"] for r in rows]
    assert "compaction" in kinds and "subagent" not in kinds      # a wrong first answer was compacted
    for sample in by_sample.values():
        assert len({r["reward"] for r in sample}) == 1 and sample[0]["reward"] in (0.0, 0.5, 1.0)
        info = json.loads(sample[0]["agent_info"])
        assert sum(r["segment"]["kind"] == "compaction" for r in sample) == info["compactions"]
        answer = sample[0]["answer"]
        assert sample[0]["reward"] == (1.0 if info["answers"][0] == answer else
                                       0.5 if info["answers"][-1] == answer else 0.0)
