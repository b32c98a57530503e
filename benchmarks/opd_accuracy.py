"""Per-source sampled accuracy of HF model directories on a prompts file, several samples
per prompt: a paired before/after comparison for on-policy distillation (issue 6).

    python benchmarks/opd_accuracy.py runs/opd/data/test.jsonl runs/opd/student \\
        runs/opd/teacher-addition runs/opd/teacher-multiplication RUN/checkpoints/step_000400

The same prompts are scored for every model, so the comparison between them is paired;
with --samples 8 and 100 prompts per source the sampling standard error is ~0.016."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)

import torch  # noqa: E402

from stages.model import load_model, load_tokenizer  # noqa: E402
from stages.tasks.make_teacher import accuracy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompts", help="jsonl with prompt, answer, data_source")
    p.add_argument("models", nargs="+", help="HF model directories")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (temperature 1)")
    a = p.parse_args()
    torch.set_num_threads(1)
    by_source: dict[str, list[dict]] = {}
    for line in Path(a.prompts).read_text().splitlines():
        row = json.loads(line)
        by_source.setdefault(row.get("data_source", "default"), []).append(row)
    print(f"{'model':<48} " + " ".join(f"{s:>15}" for s in by_source))
    for d in a.models:
        model, tok = load_model(d, "float32").eval(), load_tokenizer(d)
        accs = [sum(accuracy(model, tok, rows, temperature=1.0, seed=k) for k in range(a.samples)) / a.samples
                for rows in by_source.values()]
        print(f"{d[-48:]:<48} " + " ".join(f"{x:>15.3f}" for x in accs), flush=True)
    print(f"({a.samples} samples per prompt; prompts per source: "
          + ", ".join(f"{s} {len(r)}" for s, r in by_source.items()) + ")")


if __name__ == "__main__":
    main()
