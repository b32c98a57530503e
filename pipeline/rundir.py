"""A run directory is owned by one run at a time.

`RUN/.lock` names its holder (pid, host, start time) and is held with `flock` while the run lives:
a lock left by a dead run on this host is taken over (said in one line); one written on another host
cannot be checked from here and is refused, naming the host. The lock file is owner-only and never
opened through a symlink. `claim` adds the rule for a directory holding an earlier run.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import Callable

from pipeline.checkpoint import steps

LOCK = ".lock"
# what makes a directory a run's: a new run into it would mix its files with these
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "rollouts", "profile")

_held: dict[str, tuple[int, int]] = {}      # resolved run dir -> (fd, holders in this process)


class RunDirError(Exception):
    """The run directory belongs to another run; the message is one line for the user."""


def _holder(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode(errors="replace"))
        return info if isinstance(info, dict) else {}
    except ValueError:
        return {}


def _describe(info: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if "started" in info else "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (started {when})"


def _open_lock(path: Path) -> int:
    """An fd of the regular file `path`, created owner-only if missing. A symlink (a planted
    `.lock -> ~/.bashrc` would be truncated), fifo or directory is refused."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError:         # ELOOP: a symlink; EISDIR: a directory; ENXIO: a socket
        fd = None
    if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    kind = {stat.S_IFLNK: "a symlink", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a fifo"}.get(
        stat.S_IFMT(os.lstat(path).st_mode), "not a regular file")
    if fd is not None:
        os.close(fd)
    raise RunDirError(f"{path} is {kind}, not a lock file: refusing to use it; remove it if no run holds "
                      f"this directory")


def _acquire(path: Path, log: Callable[[str], None]) -> int:
    """An fd of `path` holding its flock, with this process written in; RunDirError names a live holder."""
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _holder(fd)
            os.close(fd)
            raise RunDirError(f"run directory {path.parent} is in use by {_describe(info)}; "
                              f"choose another directory or wait for that run to end") from None
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        os.close(fd)        # replaced between open and flock (another run took it over): again
    old, host = _holder(fd), socket.gethostname()
    if old.get("host") and old["host"] != host:
        os.close(fd)
        raise RunDirError(f"run directory {path.parent} is locked by {_describe(old)}, which cannot be checked from "
                          f"{host}; if that run has ended, remove {path}")
    if old.get("pid"):
        log(f"run directory {path.parent}: taking over the stale lock of {_describe(old)}, which is no longer running")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": host, "started": time.time()}).encode(), 0)
    os.fsync(fd)
    return fd


@contextlib.contextmanager
def locked(run_dir: str | Path, log: Callable[[str], None] = print):
    """Hold RUN/.lock for the block; nested use in one process shares it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    key = str(run_dir.resolve())
    fd, n = _held.get(key) or (_acquire(run_dir / LOCK, log), 0)
    _held[key] = (fd, n + 1)
    try:
        yield
    finally:
        fd, n = _held.pop(key)
        if n > 1:
            _held[key] = (fd, n - 1)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(run_dir / LOCK)       # while still held: no one can take a lock being removed
            os.close(fd)


def previous_run(run_dir: Path) -> list[str]:
    """The files of an earlier run in `run_dir` (empty for a new or empty directory)."""
    return [n for n in RUN_FILES if (Path(run_dir) / n).exists()]


def trained(run_dir: Path) -> bool:
    """Whether the run in `run_dir` trained a step: it left a checkpoint, or a train line in its metrics."""
    metrics = Path(run_dir) / "metrics.jsonl"
    return bool(steps(Path(run_dir) / "checkpoints")) or (
        metrics.is_file() and '"train/loss"' in metrics.read_text(errors="replace"))


@contextlib.contextmanager
def claim(run_dir: str | Path, resume: bool | str, overwrite: bool, log: Callable[[str], None] = print):
    """Hold `run_dir` for a new run. A directory holding an earlier run is refused unless the run
    resumes or overwrites; overwrite removes the earlier run's files first; resume `latest` needs a
    checkpoint there."""
    run_dir = Path(run_dir)
    with locked(run_dir, log):
        found = previous_run(run_dir)
        if found and not resume and not overwrite:
            if trained(run_dir):
                raise RunDirError(f"run directory {run_dir} holds a finished run ({', '.join(found)}); resume it "
                                  f"with --resume (or run.resume_from=...), start over with --overwrite, or choose "
                                  f"another --run-dir")
            raise RunDirError(f"run directory {run_dir} holds a run that trained nothing ({', '.join(found)}); "
                              f"start over in it with --overwrite, or choose another --run-dir")
        if resume == "latest" and not steps(run_dir / "checkpoints"):
            raise RunDirError(f"run.resume_from=latest: run directory {run_dir} holds no checkpoint to resume from"
                              f"{' (its run trained nothing)' if found else ''}; start over"
                              f"{' in it with --overwrite' if found else ' without --resume'}, or choose another "
                              f"--run-dir")
        if found and overwrite and not resume:
            for name in found:
                p = run_dir / name
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            log(f"run directory {run_dir}: removed the earlier run's {', '.join(found)} (--overwrite)")
        yield
