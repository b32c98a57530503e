"""The terminal of a run shows the project's lines; Ray's own output goes to RUN_DIR/ray.log.

Ray reaches a driver's terminal through Python loggers, its C++ core worker writing to
fd 2, and errors the cluster pushes to the driver. The CLI runs here are real subprocesses
on real local Ray; the in-process test drives each channel on purpose.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from pipeline.cli import _progress, resume_hint
from pipeline.cluster import ray_output_to
from pipeline.metrics import MetricsWriter

OWN_RAY = True      # its CLI runs start and stop Ray themselves: it starts without the shared Ray

ROOT = Path(__file__).resolve().parents[1]
FAST = ["run.steps=1", "batcher.groups_per_step=2", "rollout.n_samples=4", "sampling.max_new_tokens=4",
        "eval.every=0", "eval.num_prompts=8", "trainer.mini_batch_size=0", "run.ray_num_cpus=2",
        "trackers.tensorboard=false"]
# Ray's lines a first run used to print: start-up notices, Ray Data's plan, the C++ core
# worker's warning, an error pushed by the raylet
RAY_LINES = ["Started a local Ray instance", "Execution plan of Dataset", "core_worker.cc", "(raylet)",
             "Token authentication is enabled", "streaming_executor.py"]


def cli(model: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "configs/quickstart.yaml", *FAST, f"model.path={model}",
           *extra, "--run-dir", str(run_dir)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


# ~55 s; the default tier covers each channel's routing in-process
# (test_ray_output_to_moves_each_channel_and_puts_them_back)
@pytest.mark.slow
def test_a_cli_run_keeps_rays_lines_in_its_run_dir(tiny_model_dir, tmp_path):
    quiet = cli(tiny_model_dir, tmp_path / "quiet")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    terminal = quiet.stdout + quiet.stderr
    assert [s for s in RAY_LINES if s in terminal] == [], terminal
    assert "done: 1 steps" in quiet.stdout and "[eval] step 0: accuracy" in quiet.stderr   # the project's own
    log = (tmp_path / "quiet" / "ray.log").read_text()
    for line in ("Started a local Ray instance", "Execution plan of Dataset", "core_worker.cc"):
        assert line in log, line


# ~15 s (a CLI subprocess up to Ray's start); the default tier covers the routing in-process
@pytest.mark.slow
def test_verbose_leaves_rays_lines_on_the_terminal(tiny_model_dir, tmp_path):
    """A run that stops once Ray is up (the trainer's placement cannot fit: 64 CPUs asked of
    2) shows Ray's start-up lines on the terminal, as before, and writes no ray.log."""
    loud = cli(tiny_model_dir, tmp_path / "loud", "placement.mode=disaggregated", "placement.cpus=64",
               "placement.trainer_gpus=0", "placement.engine_gpus=0", "placement.timeout_s=1", "--verbose")
    assert loud.returncode != 0 and "could not hold pool 'trainer'" in loud.stderr, loud.stderr[-3000:]
    assert "Started a local Ray instance" in loud.stdout + loud.stderr
    assert not (tmp_path / "loud" / "ray.log").exists()


@ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)
class Stuck:
    def __init__(self, blob):       # a big argument sits in the object store: Ray's C++ side warns
        pass

    def submit(self):
        time.sleep(60)


def test_ray_output_to_moves_each_channel_and_puts_them_back(tmp_path, capfd):
    log = tmp_path / "ray.log"
    stderr_before = sys.stderr
    import ray.data  # noqa: F401 - its logger is configured on import

    handlers_before = {n: set(logging.getLogger(n).handlers) for n in ("ray", "ray.data")}
    with ray_output_to(log):
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        actor = Stuck.remote(np.zeros(1_000_000))
        ref = actor.submit.remote()
        time.sleep(1)
        ray.kill(actor)       # the retried task: "(raylet) Task Stuck.submit failed ... ray.kill"
        deadline = time.time() + 30
        while "Stuck.submit failed" not in log.read_text() and time.time() < deadline:
            time.sleep(0.2)
        logging.getLogger("ray.data").warning("a Ray Data warning")
        # what Ray's C++ side writes goes to fd 2 (its core_worker.cc warning about the big argument
        # above is printed once per process, so a fresh process checks it: the CLI test)
        os.write(2, b"core_worker.cc:0: a line written on fd 2\n")
        print("the project's own line", file=sys.stderr)
        del ref
    assert not ray.is_initialized()
    out, err = capfd.readouterr()
    assert "the project's own line" in err
    for line in ("Stuck.submit failed", "core_worker.cc", "a Ray Data warning", "Started a local Ray instance"):
        assert line not in out + err, line
        assert line in log.read_text(), line
    # all put back: fd 2, sys.stderr and the loggers reach the terminal again
    assert sys.stderr is stderr_before
    assert {n: set(logging.getLogger(n).handlers) for n in ("ray", "ray.data")} == handlers_before
    os.write(2, b"fd 2 again\n")
    logging.getLogger("ray").warning("ray logger again")
    assert "fd 2 again" in capfd.readouterr().err
    assert "ray logger again" not in log.read_text()


# ---- the progress display and the interrupted-run line (no Ray) ----------------------------

def test_the_progress_display_takes_missing_none_and_nonfinite_metrics(tmp_path, capsys):
    writer = MetricsWriter(tmp_path)      # the lines a run writes: NaN and inf become null
    lines = [writer.write(1, {"train/loss": float("nan"), "rollout/reward_mean": 0.5, "rollout/samples": 8}),
             writer.write(2, {"train/loss": float("inf"), "rollout/reward_mean": None}),
             writer.write(3, {"train/loss": None, "rollout/samples": float("nan")}),
             writer.write(3, {"eval/accuracy": float("nan")}),
             writer.write(4, {"eval/accuracy": 0.25, "eval/reward_mean": float("-inf")}),
             writer.write(4, {"train/loss": 0.125, "rollout/reward_mean": 0.75, "rollout/samples": 16})]
    writer.close()
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["train/loss"] is None and lines[1]["train/loss"] is None
    bar, on_step, _ = _progress(4)
    with bar:
        for line in lines:
            on_step(line)
    task = bar.tasks[0]
    assert task.completed == 4
    assert "loss +0.1250" in task.fields["info"] and "eval acc 0.250" in task.fields["info"]
    err = capsys.readouterr().err
    assert "[eval] step 3: accuracy - (reward mean -)" in err
    assert "[eval] step 4: accuracy 0.250 (reward mean -)" in err


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupted_run_says_how_to_resume(sig, code, capsys):
    summary = {"steps": 7, "version": 7, "interrupted": sig, "resume_from": "runs/q/checkpoints/step_000007"}
    overrides = ["run.steps=20", "run.resume_from=old/ckpt", "data.path=my prompts.jsonl"]
    assert resume_hint(summary, "configs/quickstart.yaml", overrides, "runs/q") == code
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["interrupted at step 7; checkpoint runs/q/checkpoints/step_000007; resume with: "
                   "loongsage run configs/quickstart.yaml run.steps=20 "
                   "'data.path=my prompts.jsonl' --run-dir runs/q --resume"]
    assert resume_hint({"steps": 3, "version": 3}, "c.yaml", [], "runs/c") is None       # a finished run
    assert capsys.readouterr().out == ""
