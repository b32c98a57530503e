"""Held-out evaluation: eval/accuracy (the fraction of samples with reward 1) and friends.

Samples at `eval.temperature` and scores with the run's reward function. A `single_turn` agent
generates straight on the engines; any other runs as in training, through an AgentFlowRollout on
the live engines, so its accuracy is what training moves (pipeline/eval_agent.py: any checkpoint).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import pyarrow as pa
import ray

from pipeline import seeds
from stages.prompts import load_prompts
from stages.schema import table_from_columns


def load_test(cfg, size: int) -> pa.Table | None:
    """`size` held-out prompts: data.test_path, or a built-in task's test split; None without either."""
    c = cfg.data
    path = c.test_path or (c.path if c.path.startswith("builtin:") else "")
    if not path or size == 0:
        return None
    return load_prompts(c, path=path, split="test", size=size).slice(0, size)


class Evaluator:
    """A run's evaluation of `prompts` on its engines. The reward stage is made on first use (a run
    without evaluation makes none), with the driver's tokenizer `tok`."""

    def __init__(self, cfg, model_path: str, tok, tok_class: str, prompts: pa.Table):
        self.cfg, self.model_path, self.tok, self.tok_class, self.prompts = cfg, model_path, tok, tok_class, prompts
        self._rollout = None

    @functools.cached_property
    def reward(self):
        from stages.reward import Reward

        return Reward(self.cfg.reward, self.model_path, tokenizer=self.tok)

    def __call__(self, engines: list) -> dict:
        c = self.cfg
        if c.agent.name == "single_turn":
            return evaluate(c, engines, self.reward, self.prompts, self.tok)
        if self._rollout is None:
            self._rollout = eval_rollout(c, engines, self.model_path, self.tok_class)
        return evaluate_agent(self._rollout, self.reward, self.prompts, c.eval.n_samples)

    def close(self) -> None:
        for stage in (self._rollout, self.__dict__.get("reward")):
            if stage is not None:
                stage.close()       # its agent and reward worker processes


def eval_rollout(cfg, engines: list, model_path: str, tok_class: str = ""):
    """The recipe's agent on `engines` at the evaluation's temperature and seed, no window gate."""
    from stages.agentflow.rollout import AgentFlowRollout

    seed = seeds.derive(cfg.run.seed, "eval")
    sections = {s: getattr(cfg, s) for s in AgentFlowRollout.sections}
    sections["sampling"] = dataclasses.replace(cfg.sampling, temperature=cfg.eval.temperature, seed=seed)
    return AgentFlowRollout(engines, None, model_path, tok_class, **sections)


def evaluate(cfg, engines: list, reward_stage, prompts: pa.Table, tok) -> dict:
    """Single-turn, straight on the engines. Sample k draws with seed + k, whatever engine and batch it
    lands in (every evaluation of a run draws the same numbers: accuracy moves with the weights, not
    with the draws)."""
    t0, n_samples, seed = time.time(), cfg.eval.n_samples, seeds.derive(cfg.run.seed, "eval")
    rows = [r for r in prompts.to_pylist() for _ in range(n_samples)]
    reqs = [{"prompt_ids": tok(r["prompt"], add_special_tokens=False)["input_ids"],
             "max_new_tokens": cfg.sampling.max_new_tokens, "temperature": cfg.eval.temperature, "hold": True,
             "seed": seed + k} for k, r in enumerate(rows)]
    outs = ray.get([e.generate.remote(reqs[i::len(engines)]) for i, e in enumerate(engines)])
    results = [outs[j % len(engines)][j // len(engines)] for j in range(len(reqs))]    # engine i got reqs[i::E]
    table = table_from_columns({   # group and sample: a user reward fn's row["seed"] differs per sample
        "group_id": [i // n_samples for i in range(len(rows))], "sample_idx": [i % n_samples for i in range(len(rows))],
        "prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows],
        "data_source": [r["data_source"] for r in rows], "response_ids": [o["response_ids"] for o in results],
        "status": [o["status"] for o in results], "error": [""] * len(results)})
    scored = reward_stage(table)
    rewards, sources = scored.column("reward").to_pylist(), scored.column("data_source").to_pylist()
    out = {"eval/accuracy": _accuracy(rewards), "eval/reward_mean": sum(rewards) / len(rewards),
           "eval/response_len": sum(len(o["response_ids"]) for o in results) / len(results),
           "eval/seconds": time.time() - t0, "eval/n": len(rewards)}
    if len(set(sources)) > 1:
        for s in sorted(set(sources)):
            out[f"eval/accuracy/{s}"] = _accuracy([r for r, src in zip(rewards, sources) if src == s])
    return out


def evaluate_agent(rollout_stage, reward_stage, prompts: pa.Table, n_samples: int = 1, batch: int = 64) -> dict:
    """Each prompt through `rollout_stage` (an AgentFlowRollout) and `reward_stage`, as training
    trajectories go."""
    t0 = time.time()
    rows = [r for r in prompts.to_pylist() for _ in range(n_samples)]
    rewards, stats, lens = [], [], []
    for lo in range(0, len(rows), batch):
        part = rows[lo: lo + batch]
        table = table_from_columns({
            "prompt_id": [r.get("prompt_id", "") for r in part], "group_id": list(range(lo, lo + len(part))),
            "sample_idx": [0] * len(part), "data_source": [r["data_source"] for r in part],
            "prompt": [r["prompt"] for r in part], "answer": [r["answer"] for r in part]})
        scored = reward_stage(rollout_stage(table))
        rewards += scored.column("reward").to_pylist()
        stats += [s or {} for s in scored.column("agent_stats").to_pylist()]
        lens += [len(x) for x in scored.column("response_ids").to_pylist()]
    n = len(rewards)
    return {"eval/accuracy": _accuracy(rewards), "eval/reward_mean": sum(rewards) / n,
            "eval/response_len": sum(lens) / n, "eval/turns": sum(s.get("turns") or 0 for s in stats) / n,
            "eval/tool_calls": sum(s.get("tool_calls") or 0 for s in stats) / n,
            "eval/failed": sum(bool(s.get("fail")) for s in stats), "eval/seconds": time.time() - t0, "eval/n": n}


def _accuracy(rewards: list[float]) -> float:
    return sum(r >= 1.0 - 1e-6 for r in rewards) / len(rewards)
