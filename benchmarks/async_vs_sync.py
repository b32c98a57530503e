"""Synchronous vs fully asynchronous, same recipe, same resources, one invocation.

    python benchmarks/async_vs_sync.py [--steps 40] [--rounds 3] [key=value ...]

Each round runs the recipe (configs/quickstart_async.yaml) twice: synchronous
(`stale_steps=0`, no window) and fully asynchronous (`stale_steps=1`, window-gated).
Rounds alternate which mode goes first, so a drift in the machine's speed (a shared VM)
hits both modes alike. Prints per run the trained samples/s (steady state: the first
step, which includes start-up, is left out), each resource's busy fraction and the final
eval accuracy; then each round's async/sync ratio and their median.
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

MODES = {"sync": ["rollout.stale_steps=0", "rollout.window=no-window"],
         "async": ["rollout.stale_steps=1"]}


def one(mode: str, steps: int, extra: list[str], out: str) -> dict:
    cfg = load_config(ROOT / "configs" / "quickstart_async.yaml", [f"run.steps={steps}", "eval.every=0",
                                                                   *MODES[mode], *extra])
    summary = run(cfg, out, log=lambda *_: None)
    steps_m = [m for m in read_metrics(out) if "train/loss" in m][1:]
    wall = sum(m["step_wall_s"] for m in steps_m)
    return {"samples_per_s": sum(m["rollout/samples"] for m in steps_m) / wall,
            "rollout_busy": statistics.mean(m["rollout/busy_frac"] for m in steps_m),
            "trainer_busy": statistics.mean(m["trainer/busy_frac"] for m in steps_m),
            "staleness_max": max(m["staleness/max"] for m in steps_m),
            "final_accuracy": summary["final"].get("eval/accuracy"), "threads": summary["threads"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    head = ("round", "mode", "samples/s", "rollout busy", "trainer busy", "max stale", "final acc")
    print(f"{head[0]:<6} {head[1]:<6} {head[2]:>10} {head[3]:>13} {head[4]:>13} {head[5]:>10} {head[6]:>10}")
    ratios, async_busy = [], []
    with tempfile.TemporaryDirectory() as root:
        for k in range(a.rounds):
            res = {}
            for mode in (("sync", "async") if k % 2 == 0 else ("async", "sync")):
                r = res[mode] = one(mode, a.steps, a.overrides, f"{root}/{k}-{mode}")
                acc = r["final_accuracy"]
                print(f"{k + 1:<6} {mode:<6} {r['samples_per_s']:>10.1f} {r['rollout_busy']:>13.2f} "
                      f"{r['trainer_busy']:>13.2f} {r['staleness_max']:>10} "
                      f"{'-' if acc is None else f'{acc:.3f}':>10}", flush=True)
            if k == 0:
                print("torch threads: " + "; ".join(
                    f"{m}: engine {res[m]['threads']['engines']}, trainer {res[m]['threads']['trainer']}"
                    for m in ("sync", "async")), flush=True)
            ratios.append(res["async"]["samples_per_s"] / res["sync"]["samples_per_s"])
            async_busy.append(max(res["async"]["rollout_busy"], res["async"]["trainer_busy"]))
    print("async/sync throughput ratio per round: " + ", ".join(f"{x:.2f}x" for x in ratios))
    print(f"median ratio: {statistics.median(ratios):.2f}x; busier resource in async: "
          f"{min(async_busy):.2f}-{max(async_busy):.2f}")


if __name__ == "__main__":
    main()
