"""Metric trackers: metrics.jsonl first, then TensorBoard (and W&B / MLflow offline when installed)."""
import importlib.util

import pytest

from pipeline.metrics import read_metrics
from pipeline.trackers import TrackerConfig, TrackerError, open_metrics

LINES = [(0, {"eval/accuracy": 0.25}), (1, {"train/loss": 0.5, "rollout/reward_mean": 0.125, "note": "text"}),
         (2, {"train/loss": -0.25, "rollout/reward_mean": 0.375, "train/grad_norm": float("nan")})]


def tb_scalars(run_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_jsonl_and_tensorboard_agree(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install loongsage[profile])")
    m = open_metrics(tmp_path, TrackerConfig(), {"run": {"seed": 0}})
    for step, metrics in LINES:
        m.write(step, metrics)
    m.close()
    lines = read_metrics(tmp_path)
    assert [x["step"] for x in lines] == [0, 1, 2] and lines[2]["train/grad_norm"] is None   # NaN -> null
    s = tb_scalars(tmp_path)
    assert s["train/loss"] == [(1, 0.5), (2, -0.25)]
    assert s["rollout/reward_mean"] == [(1, 0.125), (2, 0.375)] and s["eval/accuracy"] == [(0, 0.25)]
    assert "train/grad_norm" not in s and "note" not in s and "time_s" not in s    # numbers only, finite only


class Broken:
    def log(self, step, numbers):
        raise OSError("disk full")

    def close(self):
        pass


def test_a_failing_tracker_never_stops_the_jsonl(tmp_path):
    m = open_metrics(tmp_path, TrackerConfig(tensorboard=False))
    m.sinks.append(Broken())
    with pytest.warns(UserWarning, match=r"Broken failed \(OSError\('disk full'\)\); dropped"):
        m.write(1, {"train/loss": 1.0})
    m.write(2, {"train/loss": 2.0})          # no second warning: the sink is gone
    m.close()
    assert [x["train/loss"] for x in read_metrics(tmp_path)] == [1.0, 2.0] and m.sinks == []


@pytest.mark.parametrize("pkg", ["wandb", "mlflow"])
def test_enabling_a_missing_tracker_fails_at_start(tmp_path, pkg):
    if importlib.util.find_spec(pkg) is not None:
        pytest.skip(f"{pkg} is installed; its offline test below covers it")
    with pytest.raises(TrackerError, match=f"trackers.{pkg}=true but {pkg} does not import"):
        open_metrics(tmp_path, TrackerConfig(tensorboard=False, **{pkg: True}))


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_SILENT", "true")
    m = open_metrics(tmp_path, TrackerConfig(tensorboard=False, wandb=True, wandb_mode="offline"))
    for step, metrics in LINES:
        m.write(step, metrics)
    m.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_mlflow_file_store(tmp_path):
    mlflow = pytest.importorskip("mlflow", reason="mlflow not installed (pip install mlflow)")
    m = open_metrics(tmp_path, TrackerConfig(tensorboard=False, mlflow=True), {"trainer": {"lr": 0.1}})
    for step, metrics in LINES:
        m.write(step, metrics)
    m.close()
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(m.sinks[0].run_id)
    assert run.data.params["trainer.lr"] == "0.1"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(x.step, x.value) for x in history] == [(1, 0.5), (2, -0.25)]
