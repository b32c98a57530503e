"""A process's memory after it loads a 151k-token tokenizer, with stages/tokenizer.py's release of
transformers' build copies (`_vocab`, `_merges`) on and off, in one invocation.

Each round starts two fresh processes (on, then off) that import AutoTokenizer, load the tokenizer
of `builtin:qwen-vocab-tiny` (Qwen's vocabulary) with `load_tokenizer`, and report their RSS; the
switch is transfer.compat.transformers_api.BUILD_COPIES (() keeps them). Prints each round and the medians: the
resident memory of every run process that holds the tokenizer (rollout and reward workers, the driver).

    python benchmarks/tokenizer_memory.py [--rounds 3]
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

PROBE = """\
import json, sys
import psutil
import transfer.compat.transformers_api as C
import stages.tokenizer as T
from transformers import AutoTokenizer  # noqa: F401 - what a loading process imports
if sys.argv[2] == "off":
    C.BUILD_COPIES = ()
tok = T.load_tokenizer(sys.argv[1])          # held, as a worker holds it
print(json.dumps(psutil.Process().memory_info().rss / 2 ** 20))
"""


def rss_mb(model: str, mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, model, mode], cwd=ROOT, check=True, capture_output=True,
                         text=True, env=os.environ | {"PYTHONPATH": str(ROOT)}).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from stages.tasks.qwen_vocab import qwen_tiny_model_dir

    model = qwen_tiny_model_dir(log=lambda *_: None)
    on, off = [], []
    for i in range(args.rounds):
        on.append(rss_mb(model, "on"))
        off.append(rss_mb(model, "off"))
        print(f"round {i + 1}: RSS with the release {on[-1]:.0f} MB, without {off[-1]:.0f} MB", flush=True)
    a, b = statistics.median(on), statistics.median(off)
    print(f"median RSS: with {a:.0f} MB, without {b:.0f} MB: {100 * (b - a) / b:.0f}% less with the release")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
