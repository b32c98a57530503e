"""Staleness 2 with and without truncated importance sampling (TIS), same recipe, one invocation.

    python benchmarks/stale_tis.py [--steps 80] [key=value ...]

Runs configs/quickstart_async.yaml twice with `rollout.stale_steps=2` (rollout may run two
weight versions ahead of the trainer): once with `algorithm.tis_cap=0` (plain PPO ratio
against the trainer's recomputed log-probs, the engine's stale sampling distribution
ignored) and once with `algorithm.tis_cap=2` (each token's loss weighted by
min(pi_old / pi_engine, 2)). Prints per run: staleness mean/max, the train-inference
mismatch on fresh and stale tokens (|dlogprob| mean, k3 KL, fraction of ratios outside
[0.5, 2]), the mean TIS weight and the fraction truncated, and eval accuracy at the start and end.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)

from pipeline.config import load_config  # noqa: E402
from pipeline.controller import run  # noqa: E402
from pipeline.metrics import read_metrics  # noqa: E402

KEYS = ("staleness/mean", "staleness/max", "mismatch/stale_frac",
        "mismatch/abs_diff_mean/fresh", "mismatch/abs_diff_mean/stale", "mismatch/k3_kl/fresh", "mismatch/k3_kl/stale",
        "mismatch/ratio_outside_frac/stale", "is/weight_mean", "is/truncated_frac")


def one(tis: float, steps: int, extra: list[str], root: str) -> dict:
    cfg = load_config(ROOT / "configs" / "quickstart_async.yaml",
                      [f"run.steps={steps}", "rollout.stale_steps=2", f"algorithm.tis_cap={tis}",
                       f"eval.every={steps}", *extra])
    out = f"{root}/tis{tis}"
    summary = run(cfg, out, log=lambda *_: None)
    lines = [m for m in read_metrics(out) if "train/loss" in m]
    row = {}
    for k in KEYS:
        v = [m[k] for m in lines if k in m]
        row[k] = (max(v) if k.endswith("/max") else statistics.mean(v)) if v else float("nan")
    row["acc_start"] = summary["initial"].get("eval/accuracy", float("nan"))
    row["acc_end"] = summary["final"].get("eval/accuracy", float("nan"))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        rows = {f"tis_cap={t}": one(t, a.steps, a.overrides, root) for t in (0.0, 2.0)}
    width = max(map(len, KEYS)) + 2
    print(f"{'':<{width}}" + "".join(f"{n:>14}" for n in rows))
    for k in (*KEYS, "acc_start", "acc_end"):
        print(f"{k:<{width}}" + "".join(f"{r[k]:>14.4g}" for r in rows.values()))


if __name__ == "__main__":
    main()
