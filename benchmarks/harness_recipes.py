"""Does a harness recipe learn? Warm-up (optional), then the recipe's run, both watched; per-step reward series.

    python benchmarks/harness_recipes.py claude-code|codex|opencode [--warm-steps 300] [--run-dir DIR] [key=value ...]

Runs the recipe's documented commands, as a user does:

    python examples/agents/warm_harness.py HARNESS runs/warm/HARNESS --tasks 1 --temperature 0.5 --steps N
                                                                                    (unless --no-warm)
    python -m pipeline.cli run configs/agent_X.yaml [key=value ...] --run-dir DIR

and prints: the warm-up's time and its probabilities line; per step, the rollout's mean reward (the task
checker's, reported by the agent), the step's wall time and the trained token count; the mean reward of
the first two steps against the last two; and the peak over the run of the summed RSS (and PSS) of every
process under the CLI (the driver, Ray's GCS and raylet, engine, trainer and rollout workers, the jails,
the harnesses' node processes), sampled every 2 s with psutil (benchmarks/long_context.py's TreeWatch).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.long_context import TreeWatch  # noqa: E402

RECIPES = {"claude-code": ("agent_claude_code", "claude-code"), "codex": ("agent_codex", "codex"),
           "opencode": ("agent_opencode", "opencode-chat")}


def gb(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GB"


def watched(cmd: list[str]) -> tuple[int, float, TreeWatch, str]:
    """Run `cmd` from the repository root, its process tree watched; (exit code, seconds, watch, output tail)."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    watch, tail = TreeWatch(proc.pid, every=2.0), []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if "warm step" in line or "P(" in line or "captured" in line or "written" in line:
            print("   ", line.rstrip(), flush=True)
    rc = proc.wait()
    watch.stop()
    return rc, time.time() - t0, watch, "".join(tail)


def series(run_dir: Path) -> list[dict]:
    """One line per training step of metrics.jsonl (those with a rollout reward)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m for m in lines if "rollout/reward_mean" in m]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", choices=sorted(RECIPES))
    p.add_argument("--warm-steps", type=int, default=300)
    p.add_argument("--no-warm", action="store_true", help="use the model already at the recipe's model.path")
    p.add_argument("--run-dir", default="")
    p.add_argument("overrides", nargs="*", help="key=value for the run")
    a = p.parse_intermixed_args()
    config, harness = RECIPES[a.recipe]
    model = f"runs/warm/{harness}"
    if not a.no_warm:
        rc, secs, w, tail = watched([sys.executable, "examples/agents/warm_harness.py", harness, model,
                                     "--tasks", "1", "--temperature", "0.5", "--steps", str(a.warm_steps)])
        print(f"warm-up: exit {rc}, {secs:.0f} s, peak RSS {gb(w.rss)} (PSS {gb(w.pss)})", flush=True)
        if rc:
            sys.exit(tail)
    run_dir = Path(a.run_dir or f"runs/bench-{a.recipe}-{time.strftime('%H%M%S')}")
    cmd = [sys.executable, "-m", "pipeline.cli", "run", f"configs/{config}.yaml", *a.overrides, "--run-dir",
           str(run_dir)]
    print("run:", " ".join(cmd[1:]), flush=True)
    rc, secs, w, tail = watched(cmd)
    steps = series(ROOT / run_dir) if (ROOT / run_dir / "metrics.jsonl").is_file() else []
    prev = 0.0
    for m in steps:
        wall = m["time_s"] - prev
        prev = m["time_s"]
        print(f"  step {m['step']}: reward {m['rollout/reward_mean']:.3f}  wall {wall:.1f} s  "
              f"trained tokens {m.get('train/tokens', '-')}", flush=True)
    rewards = [m["rollout/reward_mean"] for m in steps]
    print(f"run: exit {rc}, {secs:.0f} s, {len(steps)} steps; rewards {[round(r, 3) for r in rewards]}", flush=True)
    if len(rewards) >= 4:
        print(f"mean reward, first 2 steps {sum(rewards[:2]) / 2:.3f} -> last 2 steps {sum(rewards[-2:]) / 2:.3f}")
    if len(steps) >= 2:
        later = [b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:])]
        print(f"s/step after the first: {sum(later) / len(later):.1f} (min {min(later):.1f}, max {max(later):.1f})")
    print(f"peak RSS of all the run's processes {gb(w.rss)} (PSS {gb(w.pss)}), largest process "
          f"{w.largest[1].strip()} {gb(w.largest[0])}", flush=True)
    if rc:
        sys.exit(tail)


if __name__ == "__main__":
    main()
