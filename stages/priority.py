"""Process priority for the rollout side: engines and rollout/reward workers step aside for the trainer."""
from __future__ import annotations

import os


def lower_priority(nice: int) -> None:
    """Raise this actor process's niceness to `nice` (once: repeated calls do not add up), so it yields
    the CPU to the trainer, the bottleneck of an async run on few cores. Only inside a Ray actor (a stage
    built in a test's own process keeps its priority); a platform without `os.nice` is left as it is."""
    if nice <= 0 or not hasattr(os, "nice"):
        return
    try:
        import ray

        if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return
    except Exception:  # noqa: BLE001 - not in Ray at all
        return
    os.nice(max(0, nice - os.nice(0)))
