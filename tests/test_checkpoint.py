"""Checkpoints are written atomically with a manifest; a truncated, garbled or NaN checkpoint is
refused in one line naming the file and the newest intact step before it; `latest` resumes the
newest intact one; a full disk mid-write is one line and leaves the earlier checkpoint intact."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


def _fill(step: int, nan: bool = False):
    """What the trainer and controller write: weights (safetensors), trainer_state.pt, controller.json."""
    def fill(tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)      # as save_pretrained does: the directory is new and empty
        g = torch.Generator().manual_seed(step)
        w = {"layer.weight": torch.randn(256, 256, generator=g), "layer.bias": torch.zeros(256)}
        if nan:
            w["layer.weight"][3, 7] = float("nan")
        save_file(w, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text("{}")
        torch.save({"optimizer": {"m": torch.randn(64, 64, generator=g)}, "version": step}, tmp / "trainer_state.pt")
        (tmp / "controller.json").write_text(json.dumps({"step": step, "version": step, "done_seqs": []}))
    return fill


def _run_dir(tmp_path: Path, steps=(1, 2, 3)) -> Path:
    for s in steps:
        ckpt.write(tmp_path / "checkpoints" / f"step_{s:06d}", _fill(s))
    return tmp_path


def _truncate(p: Path, keep: float = 0.5) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])


def _garble(p: Path) -> None:
    """64 KiB of 0xff inside the weights: as float32 those are NaNs."""
    with open(p, "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 65536)


def test_a_checkpoint_is_written_atomically_with_a_manifest(tmp_path):
    path = _run_dir(tmp_path, steps=(1,)) / "checkpoints" / "step_000001"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["algorithm"] in ("xxh3_128", "sha256")
    assert set(manifest["files"]) == {"model.safetensors", "config.json", "trainer_state.pt", "controller.json"}
    assert manifest["files"]["model.safetensors"]["bytes"] == (path / "model.safetensors").stat().st_size
    assert ckpt.verify(path) is None
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]     # no temporary left
    ckpt.write(path, _fill(1))                       # the same step again: replaced whole
    assert ckpt.verify(path) is None and len(list((tmp_path / "checkpoints").iterdir())) == 1


@pytest.mark.parametrize("damage, file, says", [
    (_truncate, "model.safetensors", "the manifest says"),
    (_truncate, "trainer_state.pt", "the manifest says"),
    (_garble, "model.safetensors", "does not match its"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_intact_step_before(tmp_path, damage, file, says):
    run = _run_dir(tmp_path)
    bad = run / "checkpoints" / "step_000003"
    damage(bad / file)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.resolve(str(bad), run)
    msg = str(e.value)
    assert "\n" not in msg and file in msg and says in msg
    assert f"the newest intact checkpoint before it is {run / 'checkpoints' / 'step_000002'}" in msg
    logs = []
    assert ckpt.resolve("latest", run, logs.append) == run / "checkpoints" / "step_000002"
    assert any("skipping" in x and "step_000003" in x for x in logs)


def test_nan_weights_are_refused_with_or_without_a_manifest(tmp_path):
    nan = ckpt.write(tmp_path / "checkpoints" / "step_000001", _fill(1, nan=True))
    with pytest.raises(ckpt.CheckpointError, match=r"model\.safetensors holds non-finite weights .* layer\.weight"):
        ckpt.resolve(str(nan), tmp_path)
    legacy = ckpt.write(tmp_path / "checkpoints" / "step_000002", _fill(2))
    (legacy / "manifest.json").unlink()              # written before manifests existed
    assert ckpt.verify(legacy) is None
    _garble(legacy / "model.safetensors")
    assert "non-finite" in ckpt.verify(legacy)
    _truncate(legacy / "trainer_state.pt")
    shutil.copy(nan / "model.safetensors", legacy / "model.safetensors")
    assert "trainer_state.pt" in ckpt.verify(legacy)


def test_latest_with_nothing_intact_is_one_line(tmp_path):
    run = _run_dir(tmp_path, steps=(1,))
    _truncate(run / "checkpoints" / "step_000001" / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint in"):
        ckpt.resolve("latest", run, lambda _: None)


def test_a_full_disk_mid_checkpoint_is_one_line_and_keeps_the_earlier_one(tmp_path):
    run = _run_dir(tmp_path, steps=(1,))

    def fill_then_fail(tmp: Path) -> None:             # fault injection: the disk fills mid-write
        _fill(2)(tmp)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "model.safetensors"))

    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.write(run / "checkpoints" / "step_000002", fill_then_fail)
    msg = str(e.value)
    assert "\n" not in msg and "ENOSPC" in msg and "step_000001 is intact" in msg
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
    assert ckpt.verify(run / "checkpoints" / "step_000001") is None


def test_a_temporary_left_by_a_dead_writer_is_not_a_checkpoint(tmp_path):
    run = _run_dir(tmp_path, steps=(1,))
    dead = run / "checkpoints" / ".step_000002.tmp-999999"
    shutil.copytree(run / "checkpoints" / "step_000001", dead)
    assert ckpt.resolve("latest", run) == run / "checkpoints" / "step_000001"
    ckpt.write(run / "checkpoints" / "step_000003", _fill(3))       # the next write clears it
    assert not dead.exists()


def test_a_planted_temporary_is_never_written_through(tmp_path):
    """The temporary directory was `.step_N.tmp-PID`: a symlink planted there led the weights elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckdir = tmp_path / "run" / "checkpoints"
    ckdir.mkdir(parents=True)
    (ckdir / f".step_000001.tmp-{os.getpid()}").symlink_to(elsewhere)
    path = ckpt.write(ckdir / "step_000001", _fill(1))
    assert list(elsewhere.iterdir()) == [] and ckpt.verify(path) is None
    assert path.stat().st_mode & 0o777 == 0o700


# ---- through the real CLI: a run, its checkpoints damaged, refusals, then --resume -----------

def _cli(*args, run_dir: Path):
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "configs/quickstart.yaml", *args, "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _trained_steps(run: Path) -> list[int]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m["step"] for m in lines if "train/loss" in m]


@pytest.mark.slow
def test_cli_refuses_damaged_checkpoints_and_resumes_the_newest_intact(tiny_model_dir, tmp_path):
    base = [f"model.path={tiny_model_dir}", "eval.num_prompts=0", "batcher.groups_per_step=2",
            "run.ray_num_cpus=2", "run.checkpoint_every=1"]
    run = tmp_path / "run"
    first = _cli(*base, "run.steps=2", run_dir=run)
    _, err = first.communicate(timeout=400)
    assert first.returncode == 0, err[-2000:]
    step2 = run / "checkpoints" / "step_000002"
    damaged = {}
    for name, (damage, file) in {"trunc_model": (_truncate, "model.safetensors"),
                                 "trunc_state": (_truncate, "trainer_state.pt"),
                                 "garbled": (_garble, "model.safetensors")}.items():
        copy = run / "checkpoints" / f"step_00000{len(damaged) + 3}"
        shutil.copytree(step2, copy)
        damage(copy / file)
        damaged[name] = (copy, file)
    procs = {n: _cli(*base, "run.steps=9", f"run.resume_from={c}", run_dir=tmp_path / n)
             for n, (c, _) in damaged.items()}
    for n, p in procs.items():
        _, err = p.communicate(timeout=400)
        lines = [x for x in err.splitlines() if x.strip()]
        copy, file = damaged[n]
        assert p.returncode == 2 and len(lines) == 1, (n, err[-2000:])
        assert file in lines[0] and f"the newest intact checkpoint before it is {step2}" in lines[0], lines[0]

    # a new run into the finished run's directory is refused; --resume takes the newest intact (step 2)
    again = _cli(*base, "run.steps=3", run_dir=run)
    _, err = again.communicate(timeout=400)
    assert again.returncode == 2 and "holds a finished run" in err and "--resume" in err, err[-2000:]
    resumed = _cli(*base, "run.steps=3", "--resume", run_dir=run)
    try:
        deadline = time.monotonic() + 300          # while it runs, the directory is its own
        while not (run / ".lock").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        rival = _cli(*base, "run.steps=3", "--resume", run_dir=run)
        _, rival_err = rival.communicate(timeout=400)
        out, err = resumed.communicate(timeout=400)
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert rival.returncode == 2 and f"is in use by pid {resumed.pid}" in rival_err, rival_err[-2000:]
    assert resumed.returncode == 0, err[-2000:]
    said = err.replace("\n", "")                                       # the terminal wraps long lines
    assert "skipping" in said and "step_000005" in said               # the damaged copies were passed over
    assert _trained_steps(run) == [1, 2, 3]                           # resumed at 2: step 3 trained once
    assert ckpt.verify(run / "checkpoints" / "step_000003") is None and not (run / ".lock").exists()
