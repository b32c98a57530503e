"""Synchronous vs asynchronous on an agentic workload, same recipe, same resources, one invocation.

    python benchmarks/agentic_async.py [--steps 10] [--rounds 3] [--modes sync,async1,...] [key=value ...]

Workload: configs/agent_sandbox_async.yaml as written: the code-sandbox task (three-factor
products), its snippets run by a remote sandbox service whose service time per call is a seeded
lognormal (p50 0.2 s, p99 1.5 s), a wrong answer retried up to 12 attempts (1 to 24 model turns
a trajectory), 8 rollout workers one group each, 4 groups of 8 trajectories a step, the embedded
engine with continuous batching. Modes (rollout.* overrides):

    sync         stale_steps=0, window=no-window    (a step's groups are dispatched after the last update)
    async1       stale_steps=1, window-gated, partial=interrupt
    async2       stale_steps=2, window-gated, partial=interrupt
    async1-wait  stale_steps=1, window-gated, partial=wait (a row keeps one version; static engine loop)

Each round runs every mode once; rounds rotate which mode goes first, so a drift in the
machine's speed (a shared VM) hits all alike. Per run, over the steady-state steps (the first
step, with start-up, is left out): trained samples/s, the trainer's and the engines' busy
fractions (metrics), the bubble (the trainer's idle share of the step windows, from the
profiler's spans), staleness mean/max, trajectory wall time p50/p99 (from the recorded rows),
the mean rollout reward of the last 3 steps. Then per round each async mode's samples/s over
sync's, and the median over rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)

from pipeline.config import load_config  # noqa: E402
from pipeline.controller import run  # noqa: E402
from pipeline.metrics import read_metrics  # noqa: E402

RECIPE = ROOT / "configs" / "agent_sandbox_async.yaml"
MODES = {"sync": ["rollout.stale_steps=0", "rollout.window=no-window"],
         "async1": ["rollout.stale_steps=1", "rollout.partial=interrupt"],
         "async2": ["rollout.stale_steps=2", "rollout.partial=interrupt"],
         "async1-wait": ["rollout.stale_steps=1", "rollout.partial=wait"]}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def trajectory_walls(out: str) -> list[float]:
    """Per trained trajectory (group, sample): last row done - first dispatched, from the recording."""
    from pipeline.recorder import Recording

    t = Recording.open(Path(out) / "rollouts").read(columns=["group_id", "sample_idx", "t_dispatch", "t_done"])
    span: dict[tuple, list[float]] = {}
    for g, s, a, b in zip(*(t.column(c).to_pylist() for c in ("group_id", "sample_idx", "t_dispatch", "t_done"))):
        lo, hi = span.setdefault((g, s), [a, b])
        span[(g, s)] = [min(lo, a), max(hi, b)]
    return [b - a for a, b in span.values()]


def bubble(out: str) -> float:
    from pipeline.planner.spans import bubbles, load_spans

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = bubbles(load_spans(out))
    b = b[b["step"] > 1]
    return float(b["trainer_idle_s"].sum() / max(b["wall_s"].sum(), 1e-9)) if len(b) else float("nan")


def one(mode: str, steps: int, extra: list[str], out: str) -> dict:
    cfg = load_config(RECIPE, [f"run.steps={steps}", *MODES[mode], *extra])
    run(cfg, out, log=lambda *_: None)
    steps_m = [m for m in read_metrics(out) if "train/loss" in m][1:]
    wall = sum(m["step_wall_s"] for m in steps_m)
    walls = trajectory_walls(out)
    return {"samples_per_s": sum(m["rollout/samples"] for m in steps_m) / wall,
            "wall_per_step": wall / len(steps_m),
            "trainer_busy": statistics.mean(m["trainer/busy_frac"] for m in steps_m),
            "rollout_busy": statistics.mean(m["rollout/busy_frac"] for m in steps_m),
            "bubble": bubble(out),
            "stale_mean": statistics.mean(m["staleness/mean"] for m in steps_m),
            "stale_max": max(m["staleness/max"] for m in steps_m),
            "traj_p50": _pct(walls, 0.5), "traj_p99": _pct(walls, 0.99),
            "reward_last3": statistics.mean(m["rollout/reward_mean"] for m in steps_m[-3:]),
            "rows_max": max((m.get("engine/running_rows_max", 0) for m in steps_m), default=0)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "sync" not in modes:
        sys.exit(f"--modes: choose from {', '.join(MODES)} (sync included), got {a.modes!r}")
    cols = ("round", "mode", "samples/s", "s/step", "trainer busy", "engine busy", "bubble", "stale mean/max",
            "traj p50/p99 s", "reward last3", "rows max")
    print(" ".join(f"{c:>14}" for c in cols), flush=True)
    ratios: dict[str, list[float]] = {m: [] for m in modes if m != "sync"}
    with tempfile.TemporaryDirectory() as root:
        for k in range(a.rounds):
            order = modes[k % len(modes):] + modes[:k % len(modes)]
            res = {}
            for mode in order:
                r = res[mode] = one(mode, a.steps, a.overrides, f"{root}/{k}-{mode}")
                vals = (k + 1, mode, f"{r['samples_per_s']:.2f}", f"{r['wall_per_step']:.2f}",
                        f"{r['trainer_busy']:.2f}", f"{r['rollout_busy']:.2f}", f"{r['bubble']:.2f}",
                        f"{r['stale_mean']:.2f}/{r['stale_max']}", f"{r['traj_p50']:.1f}/{r['traj_p99']:.1f}",
                        f"{r['reward_last3']:.3f}", r["rows_max"])
                print(" ".join(f"{v:>14}" for v in vals), flush=True)
            for m in ratios:
                ratios[m].append(res[m]["samples_per_s"] / res["sync"]["samples_per_s"])
    for m, rs in ratios.items():
        print(f"{m}/sync samples/s per round: " + ", ".join(f"{x:.2f}x" for x in rs)
              + f"; median {statistics.median(rs):.2f}x")


if __name__ == "__main__":
    main()
