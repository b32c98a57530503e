"""The quickstart's rollout on the embedded engine, this tree against another checkout, alternating.

Workload: HFEngine (1 torch thread, continuous batching) on a built-in addition model; one call
= 16 prompts x 8 samples, 6 new tokens, T=1, seeded (the quickstart's rollout unit); --calls
calls per process. Each round runs the other tree then this one, each in a fresh process whose
imports come from that tree (PYTHONPATH); prints each process's median seconds per call and the
ratio this/other of the medians over rounds (a drift in machine load hits both sides alike).

    python benchmarks/engine_vs_tree.py --other /tmp/before --model ~/.cache/loongsage/models/tiny-addition-XXXX
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CALLS = """\
import json, random, sys, time
from stages.agentflow.engine import HFEngine
eng = HFEngine(sys.argv[1], seed=0, num_threads=1)
rnd, times = random.Random(0), []
for r in range(int(sys.argv[2])):
    prompts = [f"{rnd.randint(10, 99)}+{rnd.randint(10, 99)}=" for _ in range(16)]
    reqs = [{"prompt_ids": eng.tok(p, add_special_tokens=False)["input_ids"], "max_new_tokens": 6,
             "temperature": 1.0, "seed": 100 * r + k} for p in prompts for k in range(8)]
    t = time.perf_counter()
    eng.generate(reqs)
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def median_call(tree: Path, model: str, calls: int) -> float:
    env = os.environ | {"PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CALLS, model, str(calls)], env=env, cwd=tree, check=True,
                         capture_output=True, text=True).stdout
    return statistics.median(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--other", type=Path, required=True, help="the checkout to compare with")
    p.add_argument("--model", required=True, help="an HF model directory (a built-in addition model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=60)
    args = p.parse_args(argv)
    ratios = []
    for i in range(args.rounds):
        other, this = (median_call(t, args.model, args.calls) for t in (args.other.resolve(), ROOT))
        ratios.append(this / other)
        print(f"round {i + 1}: other {other * 1000:.0f} ms/call, this {this * 1000:.0f} ms/call, "
              f"this/other {ratios[-1]:.2f}", flush=True)
    print(f"median this/other over {args.rounds} rounds: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
