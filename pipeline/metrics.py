"""metrics.jsonl: the source of truth for a run's numbers, one JSON object per line."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: str | Path, t0: float | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.t0 = time.time() if t0 is None else t0
        self._f = self.path.open("a", buffering=1)

    def write(self, step: int, metrics: dict) -> dict:
        line = {"step": int(step), "time_s": round(time.time() - self.t0, 3)}
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                v = None  # JSON has no NaN; None marks "not a number" without breaking readers
            line[k] = v
        self._f.write(json.dumps(line) + "\n")
        return line

    def close(self) -> None:
        self._f.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
