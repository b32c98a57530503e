"""Held-out accuracy of any checkpoint *through its agent*, offline, as the controller's periodic eval
measures it on the live engines: every test prompt runs the recipe's `agent.name` and is scored by
its reward, exactly as in training.

    python -m pipeline.eval_agent configs/agent_tool.yaml [--model DIR] [--prompts 200] [key=value ...]

Prints one JSON line: accuracy (the fraction of samples with reward 1) and the agent's figures.
"""
from __future__ import annotations

import argparse
import json
import sys

import ray


def evaluate_agent(cfg, model_path: str, num_prompts: int, n_samples: int = 1) -> dict:
    """pipeline.evaluate's agent evaluation on an engine of its own, loaded from `model_path`."""
    from pipeline import evaluate
    from pipeline.seeds import derive
    from stages.agentflow.engine import HFEngine
    from stages.reward import Reward

    prompts = evaluate.load_test(cfg, num_prompts)
    if prompts is None:
        raise ValueError("eval_agent needs held-out prompts: set data.test_path (or use a builtin: data.path)")
    engine = ray.remote(HFEngine).options(num_cpus=0, max_concurrency=64).remote(
        model_path, cfg.model.dtype, derive(cfg.run.seed, "engine", 0), kv_cache_mb=cfg.engine.kv_cache_mb)
    stage = evaluate.eval_rollout(cfg, [engine], model_path)
    try:
        m = evaluate.evaluate_agent(stage, Reward(cfg.reward, model_path), prompts, n_samples)
    finally:
        stage.close()
        ray.kill(engine)
    return {k: m[f"eval/{k}"] for k in ("accuracy", "reward_mean", "turns", "tool_calls", "failed", "n")}


def main(argv: list[str] | None = None) -> int:
    from pipeline.cluster import init_ray
    from pipeline.config import ConfigError, load_config
    from stages.model import resolve_model_path, validate_model_dir

    p = argparse.ArgumentParser(prog="python -m pipeline.eval_agent", description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for `loongsage run`")
    p.add_argument("--model", default="", help="HF model directory (default: the recipe's model)")
    p.add_argument("--prompts", type=int, default=200, help="held-out prompts (default 200)")
    p.add_argument("--samples", type=int, default=1, help="samples per prompt (default 1)")
    args = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        model = args.model or resolve_model_path(cfg.model, log=lambda m: print(m, file=sys.stderr))
        if args.model:
            validate_model_dir(args.model)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_ray(cfg, 2)
    print(json.dumps(evaluate_agent(cfg, model, args.prompts, args.samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
