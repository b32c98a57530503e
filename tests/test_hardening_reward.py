"""Hardening of rewards and updates (issue 17, items 2 and 4).

* A hung reward fn: its rows fail with the timeout, k hung rows cost ~ceil(k / workers)
  timeouts (not k), and neither a process nor a Ray actor holding the stage is kept alive
  by it (the worker processes are killed on exit, and leave with a killed actor).
* Non-finite rewards (NaN, inf) from a reward fn, a black-box agent's last line, an
  environment or an agent's own reward fail their row with an error saying so.
* A non-finite loss is never applied: the step is skipped and counted (trainer.on_nonfinite
  skip), or stops the run with an error naming the step (stop).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest
import ray
import torch

from stages.agentflow.config import AgentConfig, SamplingConfig
from stages.agentflow.engine import HFEngine
from stages.agentflow.envs import Step
from stages.agentflow.rollout import AgentFlowRollout
from stages.reward import Reward, RewardConfig
from stages.schema import table_from_columns
from stages.update.losses import AlgorithmConfig
from stages.update.step import NonFiniteUpdate
from stages.update.trainer import TorchTrainer, TrainerConfig

ROOT = Path(__file__).resolve().parent.parent


def _traj(tok, responses, answer="2", agent_rewards=None):
    ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    cols = {"prompt": ["1+1="] * len(ids), "answer": [answer] * len(ids), "response_ids": ids,
            "status": ["completed"] * len(ids), "error": [""] * len(ids)}
    if agent_rewards is not None:
        cols |= {"agent_reward": agent_rewards, "agent_info": ["{}"] * len(ids)}
    return table_from_columns(cols)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"     # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_gone(pids, within_s: float) -> list[int]:
    end = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


# ---- a hung reward fn -------------------------------------------------------------------

def test_hung_rows_cost_about_one_timeout_per_worker_round_not_one_each(tiny_model_dir):
    r = Reward(RewardConfig(fn="tests.reward_fns:sleep_forever", timeout_s=1.0, workers=4), tiny_model_dir)
    batch = _traj(r.tok, ["2"] * 8)
    try:
        t0 = time.monotonic()
        out = r(batch)
        took = time.monotonic() - t0
        assert out.column("status").to_pylist() == ["failed"] * 8
        assert all("reward.fn tests.reward_fns:sleep_forever timed out after 1.0s" in e
                   for e in out.column("error").to_pylist())
        assert out.column("reward").to_pylist() == [0.0] * 8
        # 2 rounds of 1s on 4 workers, plus two worker start-ups (~0.3s each on 2 busy cores); not 8s
        assert took < 5.0, f"8 hung rows on 4 workers took {took:.1f}s (2 timeouts of 1s expected, not 8)"
    finally:
        r.close()


def test_a_hung_row_fails_alone_and_the_pool_goes_on(tiny_model_dir):
    # 2 s, not less: on a loaded 2-core CI machine a fresh worker once took over 0.5 s to answer
    # the quick row before the hung one, and that row timed out too
    r = Reward(RewardConfig(fn="tests.reward_fns:hang_on_13", timeout_s=2.0, workers=2), tiny_model_dir)
    try:
        for _ in range(2):      # the killed worker is replaced: a second batch scores as the first
            out = r(_traj(r.tok, ["2", "13", "3", "2", "13", "2"]))
            assert out.column("status").to_pylist() == ["completed", "failed", "completed"] * 2, \
                out.column("error").to_pylist()
            assert out.column("reward").to_pylist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
            assert "timed out after 2.0s" in out.column("error")[1].as_py()
        assert len(r.pool.workers) <= 2      # killed workers were replaced, never added to
    finally:
        r.close()


def test_a_worker_that_dies_fails_its_row_with_the_exit_code(tiny_model_dir):
    r = Reward(RewardConfig(fn="tests.reward_fns:crash_on_13", workers=1), tiny_model_dir)
    try:
        out = r(_traj(r.tok, ["2", "13", "2"]))
        assert out.column("status").to_pylist() == ["completed", "failed", "completed"]
        assert ": its worker process exited with code 7 while scoring this row" in out.column("error")[1].as_py()
    finally:
        r.close()


PROCESS = """
import json, os, sys, time
from stages.reward import Reward, RewardConfig
from stages.schema import table_from_columns
r = Reward(RewardConfig(fn="tests.reward_fns:hang_on_13", timeout_s=0.5), sys.argv[1])
ids = [r.tok(t, add_special_tokens=False)["input_ids"] + [r.tok.eos_token_id] for t in ["2", "13", "2", "13"]]
out = r(table_from_columns({"prompt": ["1+1="] * 4, "answer": ["2"] * 4, "response_ids": ids,
                            "status": ["completed"] * 4, "error": [""] * 4}))
me = str(os.getpid())
children = [int(p) for p in os.listdir("/proc") if p.isdigit() and
            open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == me]
print(json.dumps({"status": out.column("status").to_pylist(), "children": children}), flush=True)
print("done:", flush=True)
"""


def test_a_process_with_a_hung_reward_exits_promptly_and_leaves_no_process(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-c", PROCESS, tiny_model_dir], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    try:
        report = json.loads(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "done:"
        t0 = time.monotonic()
        rc = proc.wait(timeout=15)
        exit_s = time.monotonic() - t0
    finally:
        proc.kill()
    assert rc == 0 and report["status"] == ["completed", "failed"] * 2
    # interpreter teardown (torch, transformers) takes 1.4-2.6s here on 2 busy cores with or without a
    # pool; a stuck reward thread made it never exit
    assert exit_s < 6.0, f"the process took {exit_s:.1f}s to exit after its last line"
    assert report["children"], "the stage had no worker processes left (the hung ones were killed)"
    assert _wait_gone(report["children"], 2.0) == [], "worker processes outlived their process"


def test_in_a_ray_actor_the_stage_scores_and_its_workers_die_with_the_actor(ray_session, tiny_model_dir):
    actor = ray.remote(Reward).options(num_cpus=0, max_concurrency=2).remote(
        RewardConfig(fn="tests.reward_fns:hang_on_13", timeout_s=60), tiny_model_dir)
    tok = Reward(RewardConfig(), tiny_model_dir).tok
    out = ray.get(actor.__call__.remote(_traj(tok, ["2", "3"])))
    assert out.column("reward").to_pylist() == [1.0, 0.0]
    hung = actor.__call__.remote(_traj(tok, ["13"]))        # its worker hangs for a minute
    time.sleep(0.5)
    pids = ray.get(actor.__ray_call__.remote(lambda self: [w.proc.pid for w in self.pool.workers]))
    assert pids and all(_alive(p) for p in pids)
    ray.kill(actor)                                         # SIGKILL: no atexit runs in the actor
    assert _wait_gone(pids, 3.0) == [], "reward workers outlived their Ray actor"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(hung)


# ---- non-finite rewards -----------------------------------------------------------------

def test_non_finite_rewards_from_a_reward_fn_fail_their_rows(tiny_model_dir):
    r = Reward(RewardConfig(fn="tests.reward_fns:non_finite", workers=1), tiny_model_dir)
    try:
        out = r(_traj(r.tok, ["11", "12", "13", "14", "2"])).to_pylist()
    finally:
        r.close()
    assert [row["status"] for row in out] == ["failed"] * 4 + ["completed"]
    assert [row["reward"] for row in out] == [0.0] * 4 + [1.0]
    fn = "reward.fn tests.reward_fns:non_finite returned"
    assert out[0]["error"] == f"{fn} a non-finite reward nan"
    assert out[1]["error"] == f"{fn} a non-finite reward inf"
    assert out[2]["error"] == f"{fn} a non-finite reward -inf"
    assert out[3]["error"] == f"{fn} a reward that is not a number: '1.5'"


def test_a_non_finite_agent_reward_fails_its_row_whoever_set_it(tiny_model_dir):
    r = Reward(RewardConfig(fn="exact_match"), tiny_model_dir)
    out = r(_traj(r.tok, ["2", "2", "2"], agent_rewards=[0.5, float("nan"), float("inf")])).to_pylist()
    assert [row["status"] for row in out] == ["completed", "failed", "failed"]
    assert [row["reward"] for row in out] == [0.5, 0.0, 0.0]
    assert out[1]["error"] == "the agent reported a non-finite reward nan"


@pytest.fixture(scope="module")
def engine(ray_session, tiny_model_dir):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=8).remote(tiny_model_dir)
    ray.get(eng.info.remote())
    yield eng
    ray.kill(eng)


def _rollout(engine, model_dir, agent: str, n: int = 2) -> list[dict]:
    stage = AgentFlowRollout([engine], None, model_dir, sampling=SamplingConfig(max_new_tokens=4, temperature=0.0),
                             agent=AgentConfig(name=agent))
    batch = table_from_columns({"prompt_id": [f"p{i}" for i in range(n)], "group_id": list(range(n)),
                                "sample_idx": [0] * n, "data_source": ["addition"] * n,
                                "prompt": ["37+48="] * n, "answer": ["85"] * n})
    return stage(batch).to_pylist()


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_black_box_agent_reporting_a_non_finite_reward_fails_its_row_when_used(engine, tiny_model_dir, tmp_path,
                                                                                  literal):
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(f"""
        import json, os, urllib.request
        req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/completions",
            data=json.dumps({{"prompt": json.loads(os.environ["LOONGSAGE_SAMPLE"])["prompt"]}}).encode(),
            headers={{"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}})
        urllib.request.urlopen(req).read()
        print('{{"reward": {literal}}}')
    """))
    rows = _rollout(engine, tiny_model_dir, f"cmd:python {agent}")
    assert rows[0]["status"] in ("completed", "truncated") and rows[0]["agent_reward"] is None   # only a report
    (row, _) = Reward(RewardConfig(fn="agent_reported"), tiny_model_dir)(pa.Table.from_pylist(rows)).to_pylist()
    assert row["status"] == "failed" and row["reward"] == 0.0 and "non-finite reward" in row["error"], row["error"]


class NaNEnv:
    def step(self, action: str) -> Step:
        return Step(reward=float("nan"), done=True)


class NaNEnvAgent:
    async def run(self, ctx, sample: dict) -> None:
        gen = await ctx.generate()
        await ctx.step(NaNEnv(), gen.text)


def test_an_environment_returning_a_non_finite_reward_fails_its_row(engine, tiny_model_dir):
    (row, _) = _rollout(engine, tiny_model_dir, f"{__name__}:NaNEnvAgent")
    assert row["status"] == "failed" and row["agent_reward"] is None
    assert "environment NaNEnv returned a non-finite reward nan" in row["error"]


# ---- non-finite updates -----------------------------------------------------------------

def _step_rows(eng: HFEngine, rewards: list[float]) -> pa.Table:
    tok = eng.tok
    reqs = [{"prompt_ids": tok(p, add_special_tokens=False)["input_ids"], "max_new_tokens": 3, "temperature": 1.0}
            for p in ["12+7=", "3+45=", "99+9=", "8+8="]]
    return pa.Table.from_pylist([
        {"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
         "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": rw,
         "group_id": i // 2, "status": "completed"}
        for i, (r, o, rw) in enumerate(zip(reqs, eng.generate(reqs), rewards))])


def test_a_non_finite_loss_is_skipped_counted_and_never_applied(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=1)
    bad = _step_rows(eng, [1.0, float("nan"), 0.0, 1.0])     # the NaN row's group: NaN advantages
    good = _step_rows(eng, [1.0, 0.0, 0.0, 1.0])
    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, ppo_epochs=2), AlgorithmConfig())
    before = tr.state_dict()
    m = tr.train_step(bad)
    after = tr.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before), "a NaN step moved the weights"
    assert all(not s for s in tr.opt.state.values()), "a skipped step touched Adam's state"
    assert m["train/nonfinite_skipped"] == 2 and m["version"] == 1     # one mini-batch, two epochs
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in m.values()), m
    assert "train/loss" not in m
    m = tr.train_step(good)         # and the next finite step trains as usual
    assert m["train/nonfinite_skipped"] == 0 and math.isfinite(m["train/loss"])
    assert any(not torch.equal(before[n], t) for n, t in tr.state_dict().items())
    stop = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, on_nonfinite="stop"), AlgorithmConfig())
    with pytest.raises(NonFiniteUpdate, match=r"training step 0 .*mini-batch 1: non-finite loss nan"):
        stop.train_step(bad)
    assert all(torch.equal(before[n], t) for n, t in stop.state_dict().items())


def test_on_nonfinite_is_validated():
    with pytest.raises(ValueError, match="trainer.on_nonfinite must be one of skip, stop, got 'ignore'"):
        TrainerConfig(on_nonfinite="ignore")
