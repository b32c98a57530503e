"""The torch trainer's update in this checkout against an older commit's: same rows, same config,
one invocation, alternating rounds.

    python benchmarks/trainer_vs_commit.py --ref main [--bench-dir ../shared/bench/add-tiny]
        [--rollouts RUN/rollouts] [--rounds 5] [--steps 4] [--recipe add_tiny] [key=value ...]

The rows are a real run's (trainer_floor.py records one of `--recipe` first, or reads `--rollouts`).
The older commit is checked out into a temporary git worktree. Each round runs one process per
tree (the order swapped every round, so a drift in a shared machine's speed hits both alike);
the process builds TorchTrainer from its own tree, takes one untimed warm-up update, then times
one train_step per recorded step. Printed: per round the median seconds per update of each tree,
then the median over rounds and the ratio new / old.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run inside each tree's process: its own stages.update.trainer, the same rows and settings.
WORKER = r"""
import json, sys, time
import pyarrow.parquet as pq
import torch
from pipeline.config import load_config
from stages.update.trainer import TorchTrainer
import dataclasses
args = json.loads(sys.argv[1])
cfg = load_config(args["recipe"], args["overrides"])
tables = [pq.read_table(p) for p in args["steps"]]
tr = TorchTrainer(args["model"], dataclasses.replace(cfg.trainer, num_threads=args["threads"]), cfg.algorithm,
                  cfg.sampling.temperature, cfg.sampling.max_new_tokens, cfg.model.dtype)
tr.train_step(tables[0])                 # warm-up: allocator, kernels, optimizer state
times = []
for t in tables:
    t0 = time.perf_counter()
    tr.train_step(t)
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""


def run_tree(tree: Path, payload: dict) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", WORKER, json.dumps(payload)], cwd=tree, env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", required=True, help="the older commit (or branch)")
    p.add_argument("--bench-dir", default=str(ROOT.parent / "shared/bench/add-tiny"))
    p.add_argument("--rollouts", default="", help="a recorded RUN/rollouts directory (else one is recorded)")
    p.add_argument("--recipe", default="add_tiny")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from trainer_floor import record

    bench = Path(a.bench_dir).resolve()
    rollouts = Path(a.rollouts) if a.rollouts else record(bench, a.steps, a.overrides)
    steps = sorted(str(s) for s in rollouts.glob("step=*"))[: a.steps]
    overrides = [f"model.path={bench}", *a.overrides]
    old = Path(tempfile.mkdtemp(prefix="trainer-ref-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(old), a.ref], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        medians: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(a.rounds):
            order = [("old", old), ("new", ROOT)] if r % 2 == 0 else [("new", ROOT), ("old", old)]
            for name, tree in order:
                payload = {"recipe": str(tree / "configs" / f"{a.recipe}.yaml"), "overrides": overrides,
                           "steps": steps, "model": str(bench), "threads": a.threads}
                medians[name].append(statistics.median(run_tree(tree, payload)))
            print(f"round {r + 1}: old {medians['old'][-1]:.4f} s/update  new {medians['new'][-1]:.4f} s/update",
                  flush=True)
        o, n = statistics.median(medians["old"]), statistics.median(medians["new"])
        print(f"{a.recipe} update, median of {a.rounds} rounds: old ({a.ref}) {o:.4f} s, new {n:.4f} s, "
              f"new/old {n / o:.3f}")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
