"""A long run's stream in chunks (pipeline/controller.py's chunk_groups) against one stream for the
whole run: how long the first stream takes to open (its prompt blocks cut into Ray's object store,
before the first rollout can start) and how many bytes of prompt blocks it holds.

    python benchmarks/stream_chunks.py                          # add-tiny's shape, 20,000 steps
    python benchmarks/stream_chunks.py run.steps=5000 data.train_size=50000

No engines or trainer run: the recipe's source is cut as the run cuts it. Prints both figures for
each way, alternated over --rounds, and the ratios whole / chunked.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)

import ray  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.controller import chunk_groups  # noqa: E402
from pipeline.window import capacity  # noqa: E402
from stages.prompts import PromptSource  # noqa: E402

ADD_TINY = ["run.steps=20000", "data.path=builtin:addition", "data.builtin_digits=3", "data.train_size=20000",
            "rollout.n_samples=4", "batcher.groups_per_step=32", "rollout.groups_per_batch=32",
            "rollout.stale_steps=1"]


def open_stream(source: PromptSource, groups: int, gpb: int) -> tuple[float, int]:
    """Seconds to build the stream's source dataset, and the bytes of its blocks."""
    t = time.perf_counter()
    ds = source.dataset(0, groups, gpb)
    took = time.perf_counter() - t
    size = sum(ray.get(ref).nbytes for ref in ds.to_arrow_refs())
    return took, size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="section.key=value, after add-tiny's shape")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    cfg = load_config(None, ADD_TINY + args.overrides)
    source = PromptSource(cfg.data, cfg.rollout.n_samples)
    B, gpb = cfg.batcher.groups_per_step, cfg.rollout.groups_per_batch or cfg.batcher.groups_per_step
    ways = {"chunked": chunk_groups(cfg, source.table, cfg.run.steps),
            "whole": cfg.run.steps * B + capacity(B, cfg.rollout.stale_steps)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    got: dict[str, list] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in (ways if r % 2 == 0 else reversed(list(ways))):
            took, size = open_stream(source, ways[way], gpb)
            got[way].append((took, size))
            print(f"round {r + 1} {way:8s}: {ways[way]:7d} groups, opened in {took:6.2f} s, "
                  f"{size / 2**20:8.1f} MiB of prompt blocks", flush=True)
    (ct, cs), (wt, ws) = ((statistics.median(t for t, _ in got[w]), statistics.median(s for _, s in got[w]))
                          for w in ways)
    print(f"whole / chunked: stream opens in {wt / ct:.2f}x the time ({wt:.2f} s vs {ct:.2f} s), "
          f"holds {ws / cs:.2f}x the bytes ({ws / 2**20:.1f} vs {cs / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
