"""Resources, decided in one place: logical CPUs per actor and torch threads per actor.

Ray's CPU counts are bookkeeping; torch threads are the cores used. Engines and the trainer each
get a fraction of the Ray CPUs so the light stage actors always fit. In synchronous mode rollout and
training alternate, so each may use every core; in async mode they split the cores.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Resources:
    ray_num_cpus: int
    engine_cpus: float
    trainer_cpus: float
    worker_cpus: float
    engine_threads: int
    trainer_threads: int


def plan_resources(cfg) -> Resources:
    cores = os.cpu_count() or 1
    ray_cpus = cfg.run.ray_num_cpus or cores
    n_eng = cfg.engine.count
    # engines + trainer take 40% of the logical CPUs: Ray Data's own helper tasks (block metadata,
    # reads) ask for one whole CPU, and the pipeline's light stage actors need room too
    heavy = 0.4 * ray_cpus / (n_eng + 1)
    if cfg.rollout.stale_steps == 0:
        eng_threads = tr_threads = cores
    else:
        tr_threads = max(1, cores // 2)
        eng_threads = max(1, (cores - tr_threads) // n_eng)
    return Resources(
        ray_num_cpus=ray_cpus, engine_cpus=round(heavy, 3), trainer_cpus=round(heavy, 3),
        worker_cpus=round(0.1 * ray_cpus / 4, 3),
        engine_threads=cfg.engine.threads or eng_threads,
        trainer_threads=cfg.trainer.num_threads or tr_threads,
    )
