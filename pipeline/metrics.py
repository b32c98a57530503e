"""metrics.jsonl: the source of truth for a run's numbers, one JSON object per line.

A step table's own figures are stages/schema.py's step_metrics, the window's are Window.metrics;
the engines' are engine_metrics below."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: str | Path):
        self.t0 = time.time()
        self._f = (Path(run_dir) / "metrics.jsonl").open("a", buffering=1)

    def write(self, step: int, metrics: dict) -> dict:
        # JSON has no NaN: None marks "not a number" without breaking readers
        line = {"step": int(step), "time_s": round(time.time() - self.t0, 3)} | {
            k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        self._f.write(json.dumps(line) + "\n")
        return line

    def close(self) -> None:
        self._f.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def engine_metrics(stats: list[dict], wall_s: float) -> dict:
    """The engines' share of a step's wall time, and continuous batching's figures over them: rows
    decoding per decode step (mean, max) and a request's wait before it joined the running batch."""
    m = {"rollout/busy_frac": sum(s["busy_s"] for s in stats) / max(len(stats), 1) / max(wall_s, 1e-9)}
    stats = [s for s in stats if s.get("decode_steps")]
    if not stats:
        return m
    steps = sum(s["decode_steps"] for s in stats)
    return m | {"engine/running_rows_mean": sum(s["running_rows_mean"] * s["decode_steps"] for s in stats) / steps,
                "engine/running_rows_max": max(s["running_rows_max"] for s in stats),
                "engine/queue_wait_s_mean": sum(s["queue_wait_s_mean"] for s in stats) / len(stats),
                "engine/queue_wait_s_max": max(s["queue_wait_s_max"] for s in stats)}
