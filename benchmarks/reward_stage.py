"""What does a Reward stage call cost? Times the stage on a quickstart-sized batch (64 rows of
2-digit addition, 8 samples per prompt) with the built-in exact_match and with a user
function by dotted path (stages.tasks.rewards:digit_match, run in the worker pool).

    python benchmarks/reward_stage.py                  # this tree
    python benchmarks/reward_stage.py --against HEAD~1 # and stages/reward.py as of a git revision

Prints, per variant, the first call (a pool's workers start there) and the median of the
calls after it, in milliseconds.
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder

from stages.model import ModelConfig, load_tokenizer, resolve_model_path  # noqa: E402
from stages.schema import table_from_columns  # noqa: E402

FNS = ("exact_match", "stages.tasks.rewards:digit_match")


def batch(tok, rows: int, seed: int = 0):
    rnd = random.Random(seed)
    prompts, answers, responses = [], [], []
    for _ in range(rows // 8):
        a, b = rnd.randrange(10, 100), rnd.randrange(10, 100)
        for _ in range(8):      # a group: half right, half off by one
            prompts.append(f"{a}+{b}=")
            answers.append(str(a + b))
            responses.append(str(a + b + rnd.choice((0, 1))))
    ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    return table_from_columns({"prompt": prompts, "answer": answers, "response_ids": ids,
                               "status": ["completed"] * rows, "error": [""] * rows})


def load_at(rev: str):
    """stages/reward.py as of git revision `rev`, as a module of its own."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:stages/reward.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "reward_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("reward_at_rev", path)
    mod = sys.modules["reward_at_rev"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_stage(mod, fn: str, model: str, table, calls: int) -> tuple[float, float]:
    stage = mod.Reward(mod.RewardConfig(fn=fn), model)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        stage(table)
        times.append(1000 * (time.perf_counter() - t0))
    if hasattr(stage, "close"):
        stage.close()
    return times[0], statistics.median(times[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", default=None, help="a git revision to time as well")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--calls", type=int, default=21)
    args = p.parse_args()
    model = resolve_model_path(ModelConfig(), log=lambda *_: None)
    table = batch(load_tokenizer(model), args.rows)
    import stages.reward as current

    variants = [("this tree", current)] + ([(args.against, load_at(args.against))] if args.against else [])
    for label, mod in variants:
        for fn in FNS:
            first, med = time_stage(mod, fn, model, table, args.calls)
            print(f"{label:<12} {fn:<34} {args.rows} rows: first call {first:7.1f} ms, then median {med:6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
