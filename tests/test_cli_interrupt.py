"""Ctrl-C on a real `loongsage run` process: the step in hand finishes, a resumable checkpoint is
written, one line says how to resume, exit 130 with no traceback; the resumed run goes on from there."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _steps_done(run: Path) -> int:
    f = run / "metrics.jsonl"
    if not f.is_file():
        return 0
    return sum("train/loss" in json.loads(x) for x in f.read_text().splitlines() if x.strip())


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "run", "configs/quickstart.yaml", *args]


# ~90 s; the default tier covers SIGINT -> checkpoint -> resume in-process
# (test_resume_continues_the_data_stream_without_loss) and the resume line (test_cli_logs.py)
@pytest.mark.slow
def test_sigint_checkpoints_and_the_printed_command_resumes(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    args = [f"model.path={tiny_model_dir}", "run.steps=200", "eval.num_prompts=0", "engine.count=1",
            "run.ray_num_cpus=2"]
    proc = subprocess.Popen(_cli(*args, "--run-dir", str(run)), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 240
        while _steps_done(run) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None and _steps_done(run) >= 2
        proc.send_signal(signal.SIGINT)
        t = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err and took < 60, (took, err[-2000:])
    line = next(x for x in out.splitlines() + err.splitlines() if "resume with:" in x)
    ckpt = Path(line.split("; checkpoint ")[1].split(";")[0])
    assert line.endswith(f"--run-dir {run} --resume"), line      # the same directory, not a fresh one
    state = json.loads((ckpt / "controller.json").read_text())
    stopped_at = state["step"]
    assert ckpt.name == f"step_{stopped_at:06d}" and (ckpt / "trainer_state.pt").is_file()
    assert stopped_at == _steps_done(run)                  # the checkpoint holds every step the run logged

    # the printed command, with fewer steps left, continues the clock and the data stream in the same directory
    again = [a for a in args if not a.startswith("run.steps=")] + [f"run.steps={stopped_at + 2}",
                                                                   "--run-dir", str(run), "--resume"]
    out = subprocess.run(_cli(*again), cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in json.loads(x)]
    assert steps == list(range(1, stopped_at + 3))


@pytest.mark.e2e
def test_a_second_sigint_half_a_second_after_the_first_exits_at_once(tiny_model_dir, tmp_path):
    """The second Ctrl-C used to be lost or late: when the first came while the main thread waited in
    ray.get (it looks for signals once a second), both made one call of the handler and the second was
    swallowed; when the run had already stopped, Ray's shutdown (a C call that retries EINTR) held the
    KeyboardInterrupt off, which then said there was nothing to resume from. It ends the process now."""
    run = tmp_path / "run"
    args = [f"model.path={tiny_model_dir}", "run.steps=200", "eval.num_prompts=0", "engine.count=1",
            "run.ray_num_cpus=2", "--run-dir", str(run)]
    proc = subprocess.Popen(_cli(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 240
        while _steps_done(run) < 1 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None and _steps_done(run) >= 1
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        t = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - t
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and took < 1.5, (proc.returncode, took, out[-2000:])
    assert "nothing to resume from" not in out, out[-2000:]     # not a KeyboardInterrupt once Ray's shutdown returned
