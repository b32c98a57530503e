"""Where does a quickstart step's time go? Runs configs/quickstart.yaml once, then prints
throughput (samples/s, tokens/s) and the split of the step loop between rollout, reward,
update and weight sync.

From metrics.jsonl, per step: time/rollout_wait_s (the driver waiting for the next batch:
generation and reward, which run inside the Ray Data stream), time/update_s, time/sync_s,
rollout/samples, rollout/tokens. Reward time is measured afterwards by running the Reward
stage, in this process, on the trajectories recorded under RUN_DIR/rollouts/; it is shown
as its own share and taken out of the rollout share (on this synchronous recipe the reward
of a step runs while the driver waits, so it is part of the wait).

    python benchmarks/quickstart.py                       # the recipe as it is
    python benchmarks/quickstart.py run.steps=20          # overrides pass through
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)

import pyarrow.parquet as pq  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.controller import run  # noqa: E402
from pipeline.metrics import read_metrics  # noqa: E402
from stages.model import resolve_model_path  # noqa: E402
from stages.reward import Reward  # noqa: E402


def reward_seconds(cfg, run_dir: Path) -> float:
    """Re-score every recorded step with the run's reward stage; total seconds."""
    stage = Reward(cfg.reward, resolve_model_path(cfg.model))
    total = 0.0
    for part in sorted((run_dir / "rollouts").glob("step=*/*.parquet")):
        table = pq.read_table(part).drop_columns(["reward", "reward_info"])
        t0 = time.perf_counter()
        stage(table)
        total += time.perf_counter() - t0
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    p.add_argument("--run-dir", default=None)
    p.add_argument("overrides", nargs="*", help="section.key=value")
    args = p.parse_intermixed_args(argv)     # options and overrides in any order
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="quickstart-"))
    t0 = time.time()
    summary = run(cfg, run_dir, log=lambda *_: None)
    wall = time.time() - t0

    steps = [m for m in read_metrics(run_dir) if "train/loss" in m]
    evals = [m for m in read_metrics(run_dir) if "eval/accuracy" in m]
    tot = {k: sum(m.get(k, 0.0) for m in steps) for k in
           ("time/rollout_wait_s", "time/update_s", "time/sync_s", "rollout/samples", "rollout/tokens")}
    loop = tot["time/rollout_wait_s"] + tot["time/update_s"] + tot["time/sync_s"]
    reward = min(reward_seconds(cfg, run_dir), tot["time/rollout_wait_s"])
    split = {"rollout (generate + wait)": tot["time/rollout_wait_s"] - reward, "reward": reward,
             "update": tot["time/update_s"], "weight sync": tot["time/sync_s"]}
    eval_s = sum(m["eval/seconds"] for m in evals)

    print(f"quickstart: {len(steps)} steps of {cfg.batcher.groups_per_step} groups x {cfg.rollout.n_samples} samples; "
          f"run dir {run_dir}")
    print(f"whole run {wall:.1f} s (step loop {loop:.1f} s, {len(evals)} evals {eval_s:.1f} s, "
          f"the rest start-up and checkpoint)")
    print(f"throughput over the step loop: {tot['rollout/samples'] / loop:.1f} samples/s, "
          f"{tot['rollout/tokens'] / loop:.1f} tokens/s")
    for name, secs in split.items():
        print(f"  {name:<26} {secs:7.2f} s  {100 * secs / loop:5.1f} %   {1000 * secs / len(steps):7.1f} ms/step")
    init, final = summary["initial"].get("eval/accuracy"), summary["final"].get("eval/accuracy")
    if init is not None and final is not None:
        print(f"eval/accuracy {init:.3f} -> {final:.3f} ({final - init:+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
