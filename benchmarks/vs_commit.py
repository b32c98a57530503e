"""This checkout against an older commit, same recipes, one invocation, alternating rounds.

    python benchmarks/vs_commit.py --ref 39c17c6 [--rounds 3] [--steps 40] [--recipes quickstart,quickstart_async]
    python benchmarks/vs_commit.py --ref 39c17c6 --recipes quickstart,add_tiny \
        --set add_tiny:model.path=B --set add_tiny:data.path=B/train.parquet \
        --set add_tiny:data.test_path=B/test.parquet

The older commit is checked out into a temporary git worktree; each round runs every recipe
once in each tree (`loongsage run RECIPE run.steps=N eval.num_prompts=0`, each in its own
process, the order of the two trees swapped every round, so a drift in a shared machine's
speed hits both alike). Per run it reads metrics.jsonl and prints the median step wall time
(`step_wall_s`, the first two steps left out: start-up), trained samples/s and the trainer's
busy fraction, when the first step was trained (its `time_s`: start-up, from the run's start to its
first step) and the whole process's wall time (start-up, Ray, the steps, the final checkpoint);
then per recipe the median over rounds and the ratios new / old. `--set RECIPE:key=value` adds an
override to one recipe's runs in both trees (add_tiny needs its benchmark folder); `--set-new` and
`--set-old` to one tree's only, so `--ref HEAD --set-old RECIPE:key=value` measures a switch against
itself in one invocation:

    python benchmarks/vs_commit.py --ref HEAD --recipes quickstart_async --set-old quickstart_async:run.data_wake=ray
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(tree: Path, recipe: str, steps: int, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(tree / "configs" / f"{recipe}.yaml"),
           f"run.steps={steps}", "eval.num_prompts=0", *extra, "--run-dir", str(out)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in lines if "train/loss" in m]
    steps_m = trained[2:]
    return {"step_s": statistics.median(m["step_wall_s"] for m in steps_m), "first_s": trained[0]["time_s"],
            "samples_per_s": statistics.median(m["samples_per_s"] for m in steps_m),
            "trainer_busy": statistics.median(m["trainer/busy_frac"] for m in steps_m), "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", required=True, help="the older commit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--recipes", default="quickstart,quickstart_async")
    p.add_argument("--set", action="append", default=[], metavar="RECIPE:KEY=VALUE",
                   help="an override for one recipe's runs, in both trees (repeatable)")
    p.add_argument("--set-new", action="append", default=[], metavar="RECIPE:KEY=VALUE",
                   help="an override for one recipe's runs in this checkout only (repeatable)")
    p.add_argument("--set-old", action="append", default=[], metavar="RECIPE:KEY=VALUE",
                   help="an override for one recipe's runs in the older commit only (repeatable)")
    a = p.parse_args()
    extra: dict[tuple[str, str], list[str]] = {}
    for flag, trees_of in (("set", ("new", "old")), ("set_new", ("new",)), ("set_old", ("old",))):
        for item in getattr(a, flag):
            recipe, sep, override = item.partition(":")
            if not sep or "=" not in override:
                p.error(f"--{flag.replace('_', '-')} {item!r}: expected RECIPE:key=value")
            for name in trees_of:
                extra.setdefault((recipe, name), []).append(override)
    work = Path(tempfile.mkdtemp(prefix="vs_commit_"))
    old = work / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), a.ref], check=True,
                   stdout=subprocess.DEVNULL)
    trees = {"new": ROOT, "old": old}
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        for r in range(a.rounds):
            order = ["new", "old"] if r % 2 == 0 else ["old", "new"]
            for recipe in a.recipes.split(","):
                for name in order:
                    m = run_once(trees[name], recipe, a.steps, work / f"{name}-{recipe}-{r}",
                                 extra.get((recipe, name), []))
                    results.setdefault((recipe, name), []).append(m)
                    print(f"round {r + 1} {recipe:18s} {name}: step {m['step_s'] * 1000:6.1f} ms, "
                          f"{m['samples_per_s']:6.1f} samples/s, trainer busy {m['trainer_busy']:.2f}, "
                          f"first step at {m['first_s']:.1f} s, whole run {m['wall_s']:.1f} s", flush=True)
        for recipe in a.recipes.split(","):
            new = statistics.median(m["step_s"] for m in results[(recipe, "new")])
            old_s = statistics.median(m["step_s"] for m in results[(recipe, "old")])
            ratios = [n["step_s"] / o["step_s"] for n, o in zip(results[(recipe, "new")], results[(recipe, "old")])]
            print(f"{recipe}: median step new {new * 1000:.1f} ms vs old {old_s * 1000:.1f} ms; "
                  f"new/old per round {', '.join(f'{x:.3f}' for x in ratios)}, median {statistics.median(ratios):.3f}")
            for key, name in (("first_s", "first step at"), ("wall_s", "whole-run wall")):
                r = [n[key] / o[key] for n, o in zip(results[(recipe, "new")], results[(recipe, "old")])]
                print(f"{recipe}: {name} new/old per round {', '.join(f'{x:.3f}' for x in r)}, "
                      f"median {statistics.median(r):.3f}")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
