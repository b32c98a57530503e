"""Held-out accuracy of a policy *through its agent*: every test prompt runs the recipe's
`rollout.agent` (tool calls, environment turns, subprocess agents) and is scored by its
reward, exactly as in training.

Why: the controller's periodic eval (pipeline/evaluate.py) samples one plain completion per
prompt, which measures a multi-turn tool-use policy on a task it was never asked to do
alone. This measures the same policy the way the rollout runs it:

    python -m stages.agentflow.eval_agent configs/agent_tool.yaml [--model DIR] [--prompts 200] [key=value ...]

--model is an HF directory (a run's checkpoints/step_N); without it, the recipe's own
model (the cached built-in one when model.path is ""). Prints one JSON line:
{"accuracy": fraction of samples with reward 1, "reward_mean", "turns", "tool_calls", "failed", "n"}.
"""
from __future__ import annotations

import argparse
import json
import sys

import ray

from pipeline.schema import table_from_columns


def evaluate_agent(cfg, model_path: str, num_prompts: int, n_samples: int = 1, batch: int = 64) -> dict:
    from dataclasses import replace

    from stages.agentflow.engine import HFEngine
    from stages.agentflow.rollout import AgentFlowRollout
    from stages.prompts import load_prompts
    from stages.reward import Reward

    c = cfg.data
    path = c.test_path or (c.path if c.path.startswith("builtin:") else "")
    if not path:
        raise ValueError("eval_agent needs held-out prompts: set data.test_path (or use a builtin: data.path)")
    rows = load_prompts(c, path=path, split="test", size=num_prompts).slice(0, num_prompts).to_pylist()
    rows = [r for r in rows for _ in range(n_samples)]
    engine = ray.remote(HFEngine).options(num_cpus=0, max_concurrency=64).remote(model_path, cfg.model.dtype,
                                                                                 cfg.run.seed)
    rollout_cfg = replace(cfg.rollout, temperature=cfg.eval.temperature, seed=cfg.run.seed + 1)
    stage = AgentFlowRollout(rollout_cfg, [engine], None, model_path)
    reward = Reward(cfg.reward, model_path)
    rewards, stats = [], []
    try:
        for lo in range(0, len(rows), batch):
            part = rows[lo: lo + batch]
            table = table_from_columns({
                "prompt_id": [r["prompt_id"] for r in part], "group_id": list(range(lo, lo + len(part))),
                "sample_idx": [0] * len(part), "data_source": [r["data_source"] for r in part],
                "prompt": [r["prompt"] for r in part], "answer": [r["answer"] for r in part]})
            scored = reward(stage(table))
            rewards += scored.column("reward").to_pylist()
            stats += scored.column("agent_stats").to_pylist()
    finally:
        stage.close()
        ray.kill(engine)
    n = len(rewards)
    return {"accuracy": sum(r >= 1 - 1e-6 for r in rewards) / n, "reward_mean": sum(rewards) / n,
            "turns": sum(s["turns"] for s in stats) / n, "tool_calls": sum(s["tool_calls"] for s in stats) / n,
            "failed": sum(bool(s["fail"]) for s in stats), "n": n}


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import ConfigError, load_config
    from pipeline.controller import init_ray
    from stages.model import resolve_model_path

    p = argparse.ArgumentParser(prog="python -m stages.agentflow.eval_agent", description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for `loongsage run`")
    p.add_argument("--model", default="", help="HF model directory (default: the recipe's model)")
    p.add_argument("--prompts", type=int, default=200, help="held-out prompts (default 200)")
    p.add_argument("--samples", type=int, default=1, help="samples per prompt (default 1)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        model = args.model or resolve_model_path(cfg.model, log=lambda m: print(m, file=sys.stderr))
        if args.model:
            from stages.model import validate_model_dir

            validate_model_dir(args.model)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_ray(cfg, 2)
    print(json.dumps(evaluate_agent(cfg, model, args.prompts, args.samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
