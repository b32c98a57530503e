"""A run directory is owned by one run: a second run into a live one is refused naming the
holder; a lock left by a dead run is taken over; a finished run's directory needs --resume or
--overwrite."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.rundir import LOCK, RunDirError, claim, locked

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time; sys.path.insert(0, sys.argv[2]); from pipeline.rundir import locked\n"
        "with locked(sys.argv[1], log=lambda _: None):\n"
        "    print('held', flush=True); time.sleep(60)")


def test_a_second_run_into_a_live_run_dir_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), str(ROOT)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError) as e:
            with claim(tmp_path, resume=True, overwrite=True):
                pass
        msg = str(e.value)
        assert f"in use by pid {holder.pid} on host {socket.gethostname()}" in msg and "\n" not in msg
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (killed: it left its lock file): the lock is stale and taken over
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == holder.pid
    said = []
    with locked(tmp_path, log=said.append):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] != holder.pid
    assert any(f"stale lock of pid {holder.pid}" in x for x in said)
    assert not (tmp_path / LOCK).exists()              # released at the end of the run


def test_a_lock_written_on_another_host_is_refused(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"pid": 1234, "host": "elsewhere", "started": time.time()}))
    with pytest.raises(RunDirError, match="locked by pid 1234 on host elsewhere .* remove"):
        with locked(tmp_path, log=lambda _: None):
            pass


def test_the_lock_is_shared_within_one_process(tmp_path):
    with locked(tmp_path, log=lambda _: None):
        with locked(tmp_path, log=lambda _: None):      # the CLI holds it, the controller's run finds it held
            assert (tmp_path / LOCK).exists()
        assert (tmp_path / LOCK).exists()
    assert not (tmp_path / LOCK).exists()


def test_a_finished_run_dir_needs_resume_or_overwrite(tmp_path):
    (tmp_path / "config.yaml").write_text("run: {}\n")
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    with pytest.raises(RunDirError, match=r"holds a finished run \(config.yaml, checkpoints\); resume it with"):
        with claim(tmp_path, resume=False, overwrite=False):
            pass
    assert not (tmp_path / LOCK).exists()              # a refusal leaves no lock behind
    with claim(tmp_path, resume=True, overwrite=False):
        assert (tmp_path / "checkpoints" / "step_000002").is_dir()   # resuming keeps the run's files
    said = []
    with claim(tmp_path, resume=False, overwrite=True, log=said.append):
        assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "config.yaml").exists()
    assert any("--overwrite" in x for x in said)
    with claim(tmp_path / "new", resume=False, overwrite=False):  # a new directory needs nothing
        pass


@pytest.mark.parametrize("plant", ["symlink", "fifo", "directory"])
def test_a_lock_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, plant):
    """A planted `RUN/.lock -> victim` made a run truncate the victim and write its pid into it."""
    victim, run = tmp_path / "victim", tmp_path / "run"
    victim.write_text("keep me")
    run.mkdir()
    lock = run / LOCK
    {"symlink": lambda: lock.symlink_to(victim), "fifo": lambda: os.mkfifo(lock), "directory": lock.mkdir}[plant]()
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "configs/quickstart.yaml", "--run-dir", str(run)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"error: {lock} is a {plant}, not a lock file: refusing to use it; remove it "
                                     f"if no run holds this directory"]
    assert victim.read_text() == "keep me" and os.listdir(run) == [LOCK]

