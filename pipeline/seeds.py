"""Every seed of a run, derived from `run.seed` as named streams: the one place seeds come from.

A stream is a name in STREAMS plus integer indices (an engine's number, a row's group and sample);
its seed is numpy's SeedSequence of (run_seed; crc32(name), *indices), so streams of different
names or indices are independent. Seeds are 31-bit: every library here takes them.

Sections keep a `seed` field because a stage receives only its own sections; those fields
(DERIVED) are not recipe keys: load_config rejects them and fills them from run.seed, and
dump_config leaves them out of RUN/config.yaml. docs/seeds.md says what is reproducible.
"""
from __future__ import annotations

import dataclasses
import zlib

STREAMS = {     # name -> what draws from it
    "data": "the prompt order of every epoch and a built-in task's train subset (stages/prompts.py)",
    "rollout": "the per-sample sampling seeds of training trajectories (stages/agentflow/rollout.py)",
    "eval": "the sampling seeds of held-out evaluation (pipeline/evaluate.py, pipeline/eval_agent.py)",
    "engine": "an engine's own stream, for requests without a seed (index: the engine's number)",
    "trainer": "the trainer's torch RNG (LoRA initialisation, dropout) and its mini-batch order",
    "tool_service": "the local tool service's latency and error draws (stages/agentflow/sandbox/tool_service.py)",
    "reward": "row['seed'] handed to a user reward function (stages/reward.py)",
}
_KEYS = {name: zlib.crc32(name.encode()) for name in STREAMS}
assert len(set(_KEYS.values())) == len(_KEYS), "two stream names hash alike: rename one"

# (the section holding a stage's seed field, the stream it takes)
DERIVED = (("data", "data"), ("sampling", "rollout"), ("tool_service", "tool_service"),
           ("trainer", "trainer"), ("reward", "reward"))


def derive(run_seed: int, stream: str, *index: int) -> int:
    """The seed of `stream` (indices: which one of its kind) in a run seeded `run_seed`."""
    if stream not in STREAMS:
        raise ValueError(f"unknown seed stream {stream!r}; register it in pipeline/seeds.py STREAMS "
                         f"(known: {', '.join(STREAMS)})")
    if run_seed < 0 or any(i < 0 for i in index):
        raise ValueError(f"seeds and stream indices must be >= 0, got {run_seed}, {index}")
    import numpy as np  # here, not at the top: a recipe is checked (and refused) without numpy

    seq = np.random.SeedSequence(int(run_seed), spawn_key=(_KEYS[stream], *map(int, index)))
    return int(seq.generate_state(1)[0] >> 1)


def resolve(cfg):
    """`cfg` with every DERIVED seed set from cfg.run.seed (idempotent)."""
    for section, stream in DERIVED:
        seed = derive(cfg.run.seed, stream)
        if getattr(cfg, section).seed != seed:
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), seed=seed)})
    return cfg


def strip(tree: dict) -> dict:
    """The config tree without the derived seeds (what RUN/config.yaml holds)."""
    for path, _ in DERIVED:
        (tree[path] if isinstance(tree.get(path), dict) else {}).pop("seed", None)
    return tree
