"""Ray for a run: start local Ray or join a cluster, once per process, with Ray Data's
settings for a run (no progress bars, no stats logs, no memory-issue detector)."""
from __future__ import annotations

import os
from pathlib import Path

import ray


def init_ray(cfg, num_cpus: int) -> None:
    if ray.is_initialized():
        return
    if cfg.run.ray_address:
        ray.init(address=cfg.run.ray_address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(_code_roots())}})
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.verbose_stats_logs = False
    ctx.issue_detectors_config.high_memory_detector_config.detection_time_interval_s = -1


def _code_roots() -> list[str]:
    """Make the project importable in workers even when it is run from a source checkout."""
    root = str(Path(__file__).resolve().parent.parent)
    return [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
