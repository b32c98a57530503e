"""AgentFlow rollout stage on fake Arrow batches, with a real HFEngine actor.

White-box: multi-turn agents with tools and an environment produce the right loss masks.
Black-box: subprocess agents (the shipped example and deliberately broken ones) run
through the real proxy; their rows, rewards and failures are checked, and no agent
process outlives its trajectory.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import textwrap
import time

import openai
import pytest
import ray

from stages.agentflow.blackbox import openai_agent
from stages.agentflow.chat import encode, render
from stages.agentflow.config import AgentConfig, SamplingConfig
from stages.agentflow.engine import HFEngine
from stages.agentflow.rollout import AgentFlowRollout, load_agent
from stages.agentflow.tools import calculate
from stages.reward import Reward, RewardConfig, agent_reported
from stages.schema import table_from_columns
from stages.tasks.agents import RetryEnv

GREEDY = SamplingConfig(max_new_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def engine(ray_session, tiny_model_dir):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(tiny_model_dir)
    ray.get(eng.info.remote())
    yield eng
    ray.kill(eng)


@pytest.fixture
def run_stage(engine, tiny_model_dir):
    """Run AgentFlowRollout (greedy, the agent section's keys given) on prompt rows; the stage's proxy is
    stopped afterwards."""
    stages = []

    def run(rows: list[dict], sampling=GREEDY, **agent):
        stage = AgentFlowRollout([engine], None, tiny_model_dir, sampling=sampling, agent=AgentConfig(**agent))
        stages.append(stage)
        n = len(rows)
        batch = table_from_columns({"prompt_id": [f"p{i}" for i in range(n)], "group_id": list(range(n)),
                                    "sample_idx": [0] * n, "data_source": ["addition"] * n,
                                    "prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})
        return stage, stage(batch)

    yield run
    for s in stages:
        s.close()


def script(tmp_path, body: str) -> str:
    p = tmp_path / "agent.py"
    p.write_text(textwrap.dedent(body))
    return f"cmd:python {p}"


ROWS = [{"prompt": "37+48=", "answer": "85"}, {"prompt": "12+30=", "answer": "42"}]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[(mask value, run length), ...]"""
    out = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


# ---- white-box ----------------------------------------------------------------------------------
class ToolUser:
    """A toy white-box agent: answer, check with the calculator, answer again."""

    async def run(self, ctx, sample):
        await ctx.generate()
        await ctx.call_tool("calculator", {"expression": sample["prompt"].rstrip("=")})
        await ctx.generate()


def test_white_box_tool_turns_have_the_right_masks(run_stage, tiny_model_dir):
    stage, out = run_stage(ROWS[:1], name=f"{__name__}:ToolUser")
    (row,) = out.to_pylist()
    tok = stage.tok
    assert row["status"] in ("completed", "truncated") and row["error"] == ""
    result_ids = encode(tok, "85")
    mask, ids = row["loss_mask"], row["response_ids"]
    (m1, n1), (m0, n0), (m2, n2) = _runs(mask)
    assert (m1, m0, m2) == (1, 0, 1) and ids[n1:n1 + n0] == result_ids
    assert row["token_versions"][n1:n1 + n0] == [-1] * n0 and row["response_logprobs"][n1:n1 + n0] == [0.0] * n0
    assert all(v == 0 for v in row["token_versions"][:n1] + row["token_versions"][n1 + n0:])
    assert row["agent_stats"]["turns"] == 2 and row["agent_stats"]["tool_calls"] == 1
    roles = [m["role"] for m in json.loads(row["transcript"])]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_retry_agent_env_feedback_and_reward(run_stage):
    _, out = run_stage(ROWS, name="retry")
    tok_prompt_len = {r["prompt"]: len(r["prompt"]) for r in ROWS}  # the char tokenizer: a token per character
    for row in out.to_pylist():
        stats, runs = row["agent_stats"], _runs(row["loss_mask"])
        attempts = json.loads(row["agent_info"])["attempts"]
        assert stats["turns"] == attempts and stats["fail"] == ""
        # model turns alternate with the question asked again (loss_mask 0), one per wrong attempt
        assert [m for m, _ in runs] == [1, 0] * (attempts - 1) + [1]
        assert all(n == tok_prompt_len[row["prompt"]] for m, n in runs if m == 0)
        right = json.loads(row["transcript"])[-1]["content"] == row["answer"]
        assert row["agent_reward"] == (0.5 ** (attempts - 1) if right else 0.0)


def test_retry_env_rewards_the_first_right_attempt():
    env = RetryEnv({"prompt": "1+1=", "answer": "2"}, max_attempts=3)
    assert env.step("3").observation == "1+1=" and not env.step("4").done
    last = env.step("2")
    assert last.done and last.reward == 0.25
    assert RetryEnv({"prompt": "1+1=", "answer": "2"}).step(" 2 ").reward == 1.0
    assert calculate("12+34*2") == "80" and calculate("7/2") == "3.5"
    with pytest.raises(ValueError):
        calculate("__import__('os')")


def test_turn_limit_truncates_and_keeps_the_trajectory(run_stage):
    # an answer the model never writes (not a number): every attempt is wrong, so the retry agent (3
    # attempts) asks again until the turn limit, not the model, ends the trajectory
    _, out = run_stage([{"prompt": "37+48=", "answer": "none"}], name="retry", max_turns=2)
    (row,) = out.to_pylist()
    assert row["status"] == "truncated" and "turn limit" in row["error"]
    assert row["agent_stats"]["turns"] == 2 and row["loss_mask"].count(1) > 0
    # both turns kept, each answered by the question again (loss_mask 0)
    assert [m for m, _ in _runs(row["loss_mask"])] == [1, 0, 1, 0]


def test_chat_prompt_rows_use_the_chat_template(run_stage):
    messages = [{"role": "user", "content": "37+48="}]
    stage, out = run_stage([{"prompt": json.dumps(messages), "answer": "85"}])
    (row,) = out.to_pylist()
    assert row["prompt_ids"] == encode(stage.tok, render(stage.tok, messages))


# ---- black-box --------------------------------------------------------------------------------------
@pytest.mark.parametrize("preload", [(), ("json", "urllib.request")], ids=["spawned", "forked"])
def test_subprocess_example_agent_through_the_stage_and_reward(run_stage, tiny_model_dir, preload):
    stage, out = run_stage(ROWS, name="cmd:python examples/agents/addition.py --tries 2", preload=preload)
    rows = out.to_pylist()
    for row in rows:
        assert row["status"] in ("completed", "truncated"), row["error"]
        tries = json.loads(row["agent_info"])["answers"]
        stats = row["agent_stats"]
        assert len(tries) == 2 and stats["turns"] == 2 and stats["segments"] == 1 and stats["fail"] == ""
        assert row["prompt_ids"] == encode(stage.tok, row["prompt"])
        assert [m for m, _ in _runs(row["loss_mask"])] == [1, 0, 1]
        assert row["agent_reward"] is None      # the agent has no answer to grade with: reward.fn grades
        assert json.loads(row["transcript"])[-1] == {"role": "assistant", "content": tries[-1]}
    scored = Reward(RewardConfig(fn="agent_answers"), tiny_model_dir)(out).to_pylist()
    for row, s in zip(rows, scored):
        tries = json.loads(row["agent_info"])["answers"]
        assert s["reward"] == (1.0 if tries[0] == row["answer"] else 0.5 if tries[1] == row["answer"] else 0.0)


def seen(prompt, response, answer, row):
    """A reward fn that reports what it was given."""
    return {"reward": 0.25, "response": response, "roles": [m["role"] for m in row["transcript"]]}


def test_without_a_reported_reward_reward_fn_reads_the_final_turn(run_stage, tmp_path, tiny_model_dir):
    agent = script(tmp_path, """
        import json, os, urllib.request
        req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/completions",
            data=json.dumps({"prompt": json.loads(os.environ["LOONGSAGE_SAMPLE"])["prompt"]}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
        print("the model said", json.load(urllib.request.urlopen(req))["choices"][0]["text"])
    """)
    _, out = run_stage(ROWS[:1], name=agent)
    (row,) = out.to_pylist()
    assert row["agent_reward"] is None and row["status"] in ("completed", "truncated")
    (scored,) = Reward(RewardConfig(fn=f"{__name__}:seen"), tiny_model_dir)(out).to_pylist()
    info = json.loads(scored["reward_info"])
    assert scored["reward"] == 0.25 and info["roles"] == ["prompt", "assistant"]
    assert info["response"] == json.loads(row["transcript"])[-1]["content"]


@pytest.mark.parametrize("preload", [(), ("json", "urllib.request")], ids=["spawned", "forked"])
def test_crashing_agent_fails_only_its_row_with_the_stderr_tail(run_stage, tmp_path, preload):
    agent = script(tmp_path, """
        import json, os, sys
        if json.loads(os.environ["LOONGSAGE_SAMPLE"])["prompt"] == "12+30=":
            print("boom: the agent broke", file=sys.stderr)
            sys.exit(3)
        sys.argv[1:] = ["--tries", "2"]
        import runpy; runpy.run_path(%r, run_name="__main__")
    """ % os.path.abspath("examples/agents/addition.py"))
    _, out = run_stage(ROWS, name=agent, preload=preload, binds=("examples/agents",))
    ok, bad = out.to_pylist()
    assert ok["status"] in ("completed", "truncated") and len(json.loads(ok["agent_info"])["answers"]) == 2
    assert bad["status"] == "failed" and "exited with code 3" in bad["error"]
    assert "boom: the agent broke" in bad["error"]
    assert bad["agent_stats"]["fail"] == "exit" and bad["response_ids"] == []


def _alive(pid: int, grace_s: float = 5.0) -> bool:
    """Still running after `grace_s` (a SIGKILLed process dies when next scheduled: on a loaded
    machine that is not instant)."""
    deadline = time.time() + grace_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                running = f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")   # a zombie is dead, unreaped
        except FileNotFoundError:
            running = False
        if not running or time.time() > deadline:
            return running
        time.sleep(0.05)


@pytest.mark.parametrize("preload", [(), ("json", "urllib.request")], ids=["spawned", "forked"])
def test_hanging_agent_is_killed_at_the_timeout_with_its_children(run_stage, tmp_path, preload):
    marker = f"hang-{os.getpid()}-{len(preload)}"      # found by the host's /proc, jailed or not
    agent = script(tmp_path, f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", {marker!r}])
        print("thinking very hard", file=sys.stderr, flush=True)
        time.sleep(600)
    """)
    _, out = run_stage(ROWS[:1], name=agent, timeout_s=3.0, preload=preload)
    (row,) = out.to_pylist()
    assert row["status"] == "failed" and "timed out after 3.0s" in row["error"]
    assert "thinking very hard" in row["error"] and row["agent_stats"]["fail"] == "timeout"
    children = [int(d) for d in os.listdir("/proc") if d.isdigit() and _cmdline_has(int(d), marker)]
    assert not [p for p in children if _alive(p)]


def _cmdline_has(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except OSError:
        return False


def test_an_agent_cut_off_by_the_turn_limit_is_truncated_not_failed(run_stage):
    _, out = run_stage(ROWS[:1], name="cmd:python examples/agents/addition.py --tries 2", max_turns=1)
    (row,) = out.to_pylist()        # its second try is always past the limit of one call
    assert row["status"] == "truncated" and "turn limit" in row["error"] and "exited with code 1" in row["error"]
    assert row["agent_stats"]["turns"] == 1 and row["loss_mask"].count(1) > 0


@openai_agent
async def solve(base_url, api_key, sample):
    """An in-process black-box agent on the official async client."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": sample["prompt"]}])
    await client.close()
    said = r.choices[0].message.content
    return {"reward": float(said == sample["answer"]), "info": {"said": said}}


def test_in_process_openai_agent(run_stage):
    assert load_agent(f"{__name__}:solve") is solve
    _, out = run_stage(ROWS, name=f"{__name__}:solve")
    for row in out.to_pylist():
        said = json.loads(row["agent_info"])["said"]
        assert row["status"] in ("completed", "truncated") and row["agent_reward"] == float(said == row["answer"])
        assert row["agent_stats"]["turns"] == 1 and row["loss_mask"] == [1] * len(row["response_ids"])


@pytest.mark.parametrize("name, fragment", [
    ("no.such.module:Agent", "does not import"),
    (f"{__name__}:ROWS", "is not an Agent"),
    ("cmd:python no/such/agent.py", "not found"),
    ("cmd:no-such-binary-xyz", "is not an executable"),
    ("cmd:", "needs a command line"),
])
def test_bad_agent_settings_fail_at_start(name, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_agent(name)


@pytest.mark.parametrize("agent, preload, fragment", [
    ("single_turn", ("json",), "is for 'cmd:python SCRIPT.py' agents"),
    ("cmd:/bin/echo hi", ("json",), "needs a 'cmd:python SCRIPT.py ...' agent"),
    ("cmd:python examples/agents/addition.py", ("no_such_module_xyz",), "module 'no_such_module_xyz' is not installed"),
    ("cmd:python examples/agents/addition.py", ("json; rm",), "is not a module name"),
])
def test_bad_agent_preload_fails_at_start(agent, preload, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_agent(agent, AgentConfig(name=agent, preload=preload).preload)


def test_a_preload_that_fails_to_import_fails_the_rows_with_its_error(run_stage, tmp_path, monkeypatch):
    (tmp_path / "broken_sdk.py").write_text("raise RuntimeError('this SDK is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    _, out = run_stage(ROWS, name="cmd:python examples/agents/addition.py", preload=("broken_sdk",),
                       env=("PYTHONPATH",), binds=(str(tmp_path),))   # the jail sees and passes no more
    for row in out.to_pylist():
        assert row["status"] == "failed", row
        assert "module 'broken_sdk' does not import: RuntimeError: this SDK is broken" in row["error"]


def test_forked_agents_are_separate_processes_with_their_own_env_and_seed(run_stage, tmp_path):
    """Each trajectory forked from the zygote is its own process (pid, session), sees its own
    LOONGSAGE_SAMPLE, LOONGSAGE_SEED and endpoint, and draws its own random numbers (the zygote reseeds them)."""
    agent = script(tmp_path, """
        import json, os, random, sys, urllib.request
        sample = json.loads(os.environ["LOONGSAGE_SAMPLE"])
        req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/completions",
            data=json.dumps({"prompt": sample["prompt"]}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
        urllib.request.urlopen(req).read()
        info = {"pid": os.getpid(), "sid": os.getsid(0), "prompt": sample["prompt"], "r": random.random(),
                "url": os.environ["OPENAI_BASE_URL"], "argv": sys.argv[1:], "json_loaded": "json" in sys.modules,
                "seed": os.environ["LOONGSAGE_SEED"], "pidns": os.readlink("/proc/self/ns/pid"),
                "answer": "answer" in sample}
        print(json.dumps(info))
    """)
    stage, out = run_stage(ROWS * 2, name=agent + " --flag x", preload=("json",))
    infos = [json.loads(r["agent_info"]) for r in out.to_pylist()]
    assert [i["seed"] for i in infos] == [str(stage._seed({"group_id": g, "sample_idx": 0})) for g in range(4)]
    assert [i["prompt"] for i in infos] == [r["prompt"] for r in ROWS * 2]
    assert len({i["pidns"] for i in infos}) == 4 and all(i["pid"] == i["sid"] for i in infos)
    assert not any(i["answer"] for i in infos)
    assert len({i["r"] for i in infos}) == 4 and len({i["url"] for i in infos}) == 4
    assert all(i["argv"] == ["--flag", "x"] and i["json_loaded"] for i in infos)


def test_agent_commands_run_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the shipped example is found in the project root; python is this interpreter
    agent = load_agent("cmd:python examples/agents/addition.py")
    assert agent.argv[0] == sys.executable and os.path.isfile(agent.argv[1]) and os.path.isabs(agent.argv[1])


def test_requests_arriving_while_a_batch_is_at_the_engine_are_served(engine):
    """A multi-turn agent's next call often arrives while other agents' batch is generating."""
    from stages.agentflow.client import EngineClient

    async def main():
        client = EngineClient(engine)
        busy = [{"prompt_ids": [6, 10, 13], "max_new_tokens": 48, "temperature": 1.0}] * 64
        first = asyncio.ensure_future(client.generate(busy))
        await asyncio.sleep(0.05)              # the first batch has left for the engine
        assert not first.done()
        late = await asyncio.wait_for(client.generate([{"prompt_ids": [6], "max_new_tokens": 1}]), 30)
        return await first, late

    first, (late,) = asyncio.run(main())
    assert len(first) == 64 and len(late["response_ids"]) == 1


# ---- the tool-use recipe and the SDK game agent -------------------------------------------------
# ~30 s; the default tier covers the tool agent's masks (test_white_box_tool_turns_have_the_right_masks) and
# agents through the pipeline
@pytest.mark.slow
def test_tool_recipe_run_masks_tool_results_and_trains_model_turns(ray_session, tmp_path):
    """configs/agent_tool.yaml through the real pipeline (a smaller, briefly warmed model): every
    trajectory is prompt | model | tool | model ..., tool results loss_mask 0, model turns 1."""
    import pyarrow.parquet as pq

    from pipeline.config import load_config
    from pipeline.controller import Controller
    from stages.tasks import get_task

    cfg = load_config("configs/agent_tool.yaml", [
        "run.steps=1", "batcher.groups_per_step=4", "rollout.n_samples=4", "trainer.mini_batch_size=0",
        "eval.num_prompts=8", "data.train_size=64", "model.hidden_size=32", "model.num_layers=1",
        "model.warmup_steps=30", "model.warmup_rows=256", "model.warmup_lr=0.01", "model.warmup_label_smoothing=0.0",
        f"model.cache_dir={tmp_path / 'models'}"])
    ctl = Controller(cfg, tmp_path / "run", log=lambda *_: None)
    try:
        assert ctl.run()["steps"] == 1
        tok = ctl.tok
    finally:
        ctl.stop()
    from pipeline.metrics import read_metrics

    evals = [m for m in read_metrics(tmp_path / "run") if "eval/accuracy" in m]
    assert len(evals) == 2 and all(m["eval/n"] == 8 and "eval/tool_calls" in m for m in evals)  # through the agent
    assert max(m["eval/turns"] for m in evals) > 1
    rows = pq.read_table(tmp_path / "run" / "rollouts" / "step=000001").to_pylist()
    assert len(rows) == 16
    calls = 0
    for row in rows:
        assert row["status"] in ("completed", "truncated"), row["error"]
        transcript = json.loads(row["transcript"])[1:]
        runs = _runs(row["loss_mask"])
        assert [m for m, _ in runs] == [1 if m["role"] == "assistant" else 0 for m in transcript]
        at = 0
        for (mask, n), msg in zip(runs, transcript):
            ids = row["response_ids"][at: at + n]
            if mask == 0:   # a tool result: the calculator's text, no logprob, no version
                assert ids == encode(tok, msg["content"])
                assert row["response_logprobs"][at: at + n] == [0.0] * n
                assert row["token_versions"][at: at + n] == [-1] * n
            else:           # a model turn: sampled under version 0
                assert tok.decode(ids, skip_special_tokens=True) == msg["content"]
                assert set(row["token_versions"][at: at + n]) == {0}
            at += n
        assert row["agent_stats"]["tool_calls"] == sum(m == 0 for m, _ in runs)
        calls += row["agent_stats"]["tool_calls"]
    assert calls > 0, "no trajectory called the calculator: the warm-up demonstrations did not reach the policy"
    # the demonstrations the warm-up trained on are the agent's own stream format
    row = get_task("addition3", digits=2).row(123456)
    assert row == {"prompt": "12+34+56=", "answer": "102"}
    assert get_task("addition3").demonstration(row) == [("12+34=", True), ("46", False), ("+56=", True),
                                                         ("102", False), ("102", True)]


def test_sdk_guess_number_agent_plays_through_the_real_proxy(run_stage):
    """examples/agents/guess_number.py: the official openai SDK in a subprocess, several turns
    through the recording proxy, the game's feedback recorded as loss_mask 0 context."""
    rows = [{"prompt": "37+48=", "answer": ""}, {"prompt": "12+30=", "answer": ""}, {"prompt": "5+5=", "answer": ""}]
    stage, out = run_stage(rows, name="cmd:python examples/agents/guess_number.py --turns 3 --max 9",
                           sampling=SamplingConfig(max_new_tokens=4, temperature=1.0), max_turns=3)
    rows = out.to_pylist()
    assert any(r["agent_stats"]["turns"] > 1 for r in rows)   # multi-turn: the game went on after a miss
    for row in rows:
        assert row["status"] in ("completed", "truncated"), row["error"]
        info = json.loads(row["agent_info"])
        guesses, feedback = info["guesses"], info["feedback"]
        stats = row["agent_stats"]
        assert stats["turns"] == len(guesses) and stats["fail"] == "" and 1 <= len(guesses) <= 3
        found = any(g.strip().isdigit() and int(g) == info["target"] for g in guesses)
        assert row["agent_reward"] is None      # a cmd: agent's report is graded by reward.fn (agent_reported)
        assert agent_reported("", "", "", row)["reward"] == info["reward"] == ((0.5 ** (len(guesses) - 1)) if found
                                                                               else 0.0)
        assert feedback == ["higher" if not g.strip().isdigit() or int(g) < info["target"] else "lower"
                            for g in guesses[: len(guesses) - found]]
        transcript = json.loads(row["transcript"])
        assert [m["role"] for m in transcript] == ["user"] + ["assistant", "user"] * (len(guesses) - 1) + ["assistant"]
        assert [m["content"] for m in transcript if m["role"] == "assistant"] == guesses
        assert [m["content"] for m in transcript[2::2]] == [{"higher": "+", "lower": "="}[f] for f in feedback][
            : len(guesses) - 1]
        if stats["segments"] == 1:   # one token stream: model turns 1, game feedback 0
            assert row["prompt_ids"] == encode(stage.tok, "=")
            assert [m for m, _ in _runs(row["loss_mask"])] == [1, 0] * (len(guesses) - 1) + [1]
        assert all(v == 0 for v, m in zip(row["token_versions"], row["loss_mask"]) if m)
