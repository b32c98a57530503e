"""Reward stage: trajectories -> scalar rewards, built-in rules or a user function.

User reward functions plug in by dotted path (`reward.fn: mypkg.rewards:score`):

    def score(prompt: str, response: str, answer: str, row: dict) -> float | dict
        # dict form: {"reward": float, ...anything else goes to reward_info}; `async def` works too

A function that draws random numbers seeds them from `row["seed"]` (run.seed, the row's group and
sample). It runs in worker processes (stages/reward_pool.py), each row within `reward.timeout_s`: an
exception, a non-finite reward or a timeout marks only that row `failed` (reward 0), and a hung call
has its worker killed and replaced. The built-in rules are pure and run in this process.

When agent code set a finite reward itself (an environment's, an in-process agent's return value),
the row's `agent_reward` is the reward and reward.fn is not called. A subprocess agent never sets one:
its last stdout line is a report in `row["agent_info"]` for reward.fn to grade (`agent_answers`).
For rows with a transcript, `response` is the final model turn's text and `row["transcript"]` the
whole final transcript as a list of {role, content}.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pyarrow as pa

from stages.keys import import_object
from stages.reward_config import RewardConfig
from stages.reward_pool import RewardPool, score
from stages.schema import with_columns

_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(prompt: str, response: str, answer: str, row: dict) -> float:
    """1 iff the model ended its answer (eos) and the text before it equals the answer."""
    return float(row.get("status") == "completed" and response.strip() == answer.strip())


def numeric(prompt: str, response: str, answer: str, row: dict) -> float:
    """1 iff the last number in the response equals the answer numerically."""
    found = _NUM.findall(response)
    try:
        return float(bool(found) and abs(float(found[-1]) - float(answer)) < 1e-6)
    except ValueError:
        return 0.0


def agent_answers(prompt: str, response: str, answer: str, row: dict) -> float:
    """A black-box agent's report graded: 1, 0.5, 0.25... for the first of its `answers` (its tries, in order)
    that equals the answer and that its `accepted` list (if any) does not reject; 0 if none. The agent never
    sees the answer (stages/agentflow/blackbox.py): it reports what it did, this grades it."""
    try:
        report = json.loads(row.get("agent_info") or "{}")
    except ValueError:
        return 0.0
    answers, accepted = report.get("answers") or [], report.get("accepted") or []
    for i, got in enumerate(answers if isinstance(answers, list) else []):
        if str(got).strip() == answer.strip() and (i >= len(accepted) or accepted[i]):
            return 0.5 ** i
    return 0.0


def agent_reported(prompt: str, response: str, answer: str, row: dict) -> dict:
    """The reward a black-box agent's report states ({"reward": x, ...}): for an agent that is its own
    environment and runs nothing the model wrote (examples/agents/guess_number.py). Never for a harness with
    a shell tool: the model could make it print any report."""
    report = json.loads(row.get("agent_info") or "{}")
    if not isinstance(report, dict) or "reward" not in report:
        raise ValueError("the agent's report (its last stdout line) has no reward")
    return {"reward": report["reward"], "source": "agent"}


BUILTIN = {f.__name__: f for f in (exact_match, numeric, agent_answers, agent_reported)}


def load_reward_fn(name: str):
    if name in BUILTIN:
        return BUILTIN[name]
    if not name.replace(":", ".").rpartition(".")[0]:
        raise ValueError(f"reward.fn {name!r}: not a built-in ({', '.join(BUILTIN)}) nor a dotted path")
    try:
        fn = import_object(name)
    except Exception as e:      # the user's module may raise anything while it imports
        raise ValueError(f"reward.fn {name!r} does not import: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward.fn {name!r} is not callable")
    return fn


def _has_agent_reward(row: dict) -> bool:
    return row.get("agent_reward") is not None and row["status"] not in ("failed", "aborted")


def _agent_reward(row: dict) -> tuple[bool, object]:
    """(True, (reward, info JSON)) for the agent's own reward, (False, error) if it is not finite:
    whoever set it (an environment, a black-box agent, custom agent code), NaN must not reach training."""
    reward = float(row["agent_reward"])
    if not math.isfinite(reward):
        return False, f"the agent reported a non-finite reward {reward}"
    return True, (reward, json.dumps({"source": "agent", **json.loads(row.get("agent_info") or "{}")}))


class Reward:
    inputs = ("prompt", "answer", "response_ids", "status")
    outputs = ("reward", "reward_info", "status", "error")

    def __init__(self, cfg: RewardConfig, model_path: str = "", nice: int = 0, tokenizer_class: str = "",
                 tokenizer=None):
        """tokenizer_class: the class AutoTokenizer picks for model_path, loaded without importing torch;
        tokenizer: model_path's, already loaded in this process."""
        from stages.priority import lower_priority
        from stages.tokenizer import load_tokenizer

        lower_priority(nice)        # the pool's workers inherit it
        self.cfg = cfg
        self.fn = load_reward_fn(cfg.fn)    # imported here too: a bad path fails at construction, not per row
        self.tok = tokenizer if tokenizer is not None else load_tokenizer(model_path, tokenizer_class)
        self.pool = None if cfg.fn in BUILTIN else RewardPool(cfg.fn, cfg.workers, cfg.timeout_s)

    def close(self) -> None:
        """Kill the worker processes (garbage collection and interpreter exit do it too)."""
        if self.pool is not None:
            self.pool.close()

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        todo = [i for i, r in enumerate(rows) if r["status"] not in ("failed", "aborted") and not _has_agent_reward(r)]
        calls = [self._args(rows[i]) for i in todo]
        scored = dict(zip(todo, self.pool.map(calls) if self.pool is not None else
                          [score(self.fn, self.cfg.fn, args) for args in calls]))
        out = []        # per row: reward, reward_info, status, error
        for i, r in enumerate(rows):
            ok, value = _agent_reward(r) if _has_agent_reward(r) else scored.get(i, (True, (0.0, "{}")))
            out.append((*value, r["status"], r.get("error") or "") if ok else (0.0, "{}", "failed", value))
        return with_columns(batch, {k: [o[j] for o in out] for j, k in enumerate(self.outputs)})

    def _args(self, row: dict) -> tuple:
        """The reward fn's arguments for a row: (prompt, response text, answer, row)."""
        transcript = json.loads(row.get("transcript") or "[]")
        if transcript:  # an agent's trajectory: the final model turn is the answer
            row = row | {"transcript": transcript}
            text = next((m["content"] or "" for m in reversed(transcript) if m["role"] == "assistant"), "")
        else:
            ids, eos = row["response_ids"], self.tok.eos_token_id
            text = self.tok.decode(ids[: ids.index(eos)] if eos in ids else ids, skip_special_tokens=True)
        if self.pool is not None:       # a user fn; the built-in rules draw nothing
            row = row | {"seed": self._seed(row)}
        return row["prompt"], text, row.get("answer") or "", row

    def _seed(self, row: dict) -> int:
        """The row's own seed: independent across groups and samples, the same for the same run.seed."""
        key = (int(row.get("group_id") or 0), int(row.get("sample_idx") or 0))
        return int(np.random.SeedSequence(self.cfg.seed, spawn_key=key).generate_state(1)[0] >> 1)
