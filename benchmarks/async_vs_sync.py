"""Synchronous vs fully asynchronous, same recipe, same resources, one invocation.

    python benchmarks/async_vs_sync.py [--steps 30] [key=value ...]

Prints trained samples/s (steady state: the first step, which includes start-up, is left
out), the ratio, each resource's busy fraction and the final eval accuracy of both runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.config import load_config  # noqa: E402
from pipeline.controller import run  # noqa: E402
from pipeline.metrics import read_metrics  # noqa: E402


def one(mode: list[str], steps: int, extra: list[str], root: str) -> dict:
    cfg = load_config(ROOT / "configs" / "quickstart_async.yaml", [f"run.steps={steps}", "eval.every=0", *mode, *extra])
    out = f"{root}/{'async' if 'rollout.stale_steps=1' in mode else 'sync'}"
    summary = run(cfg, out, log=lambda *_: None)
    steps_m = [m for m in read_metrics(out) if "train/loss" in m][1:]
    wall = sum(m["step_wall_s"] for m in steps_m)
    return {"samples_per_s": sum(m["rollout/samples"] for m in steps_m) / wall,
            "rollout_busy": statistics.mean(m["rollout/busy_frac"] for m in steps_m),
            "trainer_busy": statistics.mean(m["trainer/busy_frac"] for m in steps_m),
            "staleness_max": max(m["staleness/max"] for m in steps_m),
            "final_accuracy": summary["final"].get("eval/accuracy")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        sync_mode = ["rollout.stale_steps=0", "rollout.window=no-window", "algorithm.tis_cap=0"]
        sync = one(sync_mode, a.steps, a.overrides, root)
        asyn = one(["rollout.stale_steps=1"], a.steps, a.overrides, root)
    head = ("mode", "samples/s", "rollout busy", "trainer busy", "max stale", "final acc")
    print(f"{head[0]:<6} {head[1]:>10} {head[2]:>13} {head[3]:>13} {head[4]:>10} {head[5]:>10}")
    for name, r in (("sync", sync), ("async", asyn)):
        print(f"{name:<6} {r['samples_per_s']:>10.1f} {r['rollout_busy']:>13.2f} {r['trainer_busy']:>13.2f} "
              f"{r['staleness_max']:>10} {r['final_accuracy']:>10.3f}")
    print(f"async/sync throughput ratio: {asyn['samples_per_s'] / sync['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
