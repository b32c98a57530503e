"""Metrics to the tools people use: TensorBoard, Weights & Biases, MLflow.

metrics.jsonl stays the source of truth: `open_metrics` writes each line there first, then hands
its finite numbers to every enabled sink; a sink that fails mid-run is warned about once and
dropped. A sink's package is imported only when it is enabled; an enabled W&B or MLflow that does
not import is an error at start, while TensorBoard (on by default) that is missing is said once.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from pipeline.metrics import MetricsWriter
from stages.keys import key, one_of


class TrackerError(ValueError):
    pass


@dataclass(frozen=True)
class TrackerConfig:
    tensorboard: bool = key(True, "write TensorBoard event files under RUN_DIR")
    wandb: bool = key(False, "log to Weights & Biases")
    wandb_project: str = key("loongsage", "W&B project name")
    wandb_mode: str = key("offline", "offline | online | disabled", one_of("offline", "online", "disabled"))
    mlflow: bool = key(False, "log to MLflow")
    mlflow_uri: str = key("", 'MLflow tracking URI; "" = file:RUN_DIR/mlruns')
    mlflow_experiment: str = key("loongsage", "MLflow experiment name")


class TensorBoardSink:
    def __init__(self, run_dir: Path, config: dict, cfg: TrackerConfig):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, step: int, numbers: dict) -> None:
        for k, v in numbers.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, config: dict, cfg: TrackerConfig):
        import wandb

        self.run = wandb.init(project=cfg.wandb_project, dir=str(run_dir), mode=cfg.wandb_mode, config=config,
                              name=run_dir.name, reinit=True)

    def log(self, step: int, numbers: dict) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, run_dir: Path, config: dict, cfg: TrackerConfig):
        import mlflow

        self.client = mlflow.MlflowClient(tracking_uri=cfg.mlflow_uri or (run_dir / "mlruns").resolve().as_uri())
        exp = self.client.get_experiment_by_name(cfg.mlflow_experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.mlflow_experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        for k, v in _flatten(config).items():
            self.client.log_param(self.run_id, k, str(v)[:500])

    def log(self, step: int, numbers: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in numbers.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out |= _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def open_metrics(run_dir: str | Path, cfg: TrackerConfig, config: dict | None = None, log=None) -> "TrackedMetrics":
    """The trackers are opened first: one refused at start leaves no file open. A missing TensorBoard is said
    through `log` (a warning without one)."""
    run_dir, config, sinks = Path(run_dir), config or {}, []
    for enabled, make, pkg in ((cfg.tensorboard, TensorBoardSink, "tensorboard"), (cfg.wandb, WandbSink, "wandb"),
                               (cfg.mlflow, MlflowSink, "mlflow")):
        try:
            sinks += [make(run_dir, config, cfg)] if enabled else []
        except ImportError as e:
            if pkg != "tensorboard":
                raise TrackerError(f"trackers.{pkg}=true but {pkg} does not import ({e}); pip install {pkg}") from e
            note = ("TensorBoard event files off: tensorboard is not installed (pip install tensorboard); "
                    "metrics.jsonl only")
            log(note) if log else warnings.warn(note, stacklevel=2)
    return TrackedMetrics(MetricsWriter(run_dir), sinks)


class TrackedMetrics:
    """metrics.jsonl first, then every sink: the MetricsWriter interface."""

    def __init__(self, writer: MetricsWriter, sinks: list):
        self.writer, self.sinks = writer, sinks

    def write(self, step: int, metrics: dict) -> dict:
        line = self.writer.write(step, metrics)
        numbers = {k: float(v) for k, v in line.items() if k not in ("step", "time_s")      # the loggable part
                   and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for s in list(self.sinks):
            try:
                s.log(line["step"], numbers)
            except Exception as e:     # a tracker must never stop training: the jsonl has the line
                warnings.warn(f"{type(s).__name__} failed ({e!r}); dropped for the rest of the run", stacklevel=2)
                self.sinks.remove(s)
        return line

    def close(self) -> None:
        self.writer.close()
        for s in self.sinks:
            s.close()
