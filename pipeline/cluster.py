"""Ray for a run: local Ray or a cluster, started once per process with Ray Data's settings for a run
(no progress bars, no stats logs, no memory-issue detector), and what Ray prints kept off the terminal."""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from pathlib import Path

import ray


def init_ray(cfg, num_cpus: int) -> None:
    if ray.is_initialized():
        return
    if cfg.run.ray_address:
        ray.init(address=cfg.run.ray_address, log_to_driver=False)
    else:       # the project importable in workers even when it is run from a source checkout
        paths = [str(Path(__file__).resolve().parent.parent), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, paths))}})
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.verbose_stats_logs = False
    ctx.issue_detectors_config.high_memory_detector_config.detection_time_interval_s = -1


@contextlib.contextmanager
def ray_output_to(path: str | Path):
    """While the block runs, what Ray itself prints goes to the file `path`, not the terminal: its Python
    loggers, its C++ core writing to fd 2 (`sys.stderr` keeps the terminal through a copy of the old fd)
    and the errors the cluster pushes to the driver. Ray is shut down before the block ends."""
    from transfer.compat.ray_api import pushed_errors_to

    pushed = logging.getLogger("ray.pushed_to_driver")

    def to_log(data: dict, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            pushed.warning("(%s) %s", data.get("pid", "?"), line)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    importlib.import_module("ray.data")     # configures its logger, with a console handler, on import
    handler = logging.FileHandler(path)
    handler.setLevel(logging.INFO)      # Ray Data logs DEBUG too; its own ray-data.log in the session dir keeps them
    handler.setFormatter(logging.Formatter("%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"))
    try:
        with _loggers_to(handler), _fd2_to(path), pushed_errors_to(to_log):
            try:
                yield path
            finally:
                if ray.is_initialized():
                    ray.shutdown()
    finally:
        handler.close()


@contextlib.contextmanager
def _loggers_to(handler: logging.Handler):
    names = ["ray"] + [n for n in logging.root.manager.loggerDict if n.startswith("ray.")]
    moved = {}
    for name in names:
        lg = logging.getLogger(name)
        consoles = [h for h in lg.handlers if isinstance(h, logging.StreamHandler)
                    and not isinstance(h, logging.FileHandler)]
        if consoles or name == "ray":
            for h in consoles:
                lg.removeHandler(h)
            if name == "ray" or not lg.propagate:     # a propagating one reaches the file through "ray"
                lg.addHandler(handler)
            moved[name] = consoles
    try:
        yield
    finally:
        for name, consoles in moved.items():
            lg = logging.getLogger(name)
            lg.removeHandler(handler)
            for h in consoles:
                lg.addHandler(h)


@contextlib.contextmanager
def _fd2_to(path: Path):
    """fd 2 -> the file; sys.stderr, if it wrote to fd 2, -> a copy of the old fd 2."""
    try:
        on_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):      # replaced by a test harness or a notebook
        on_fd2 = False
    sys.stderr.flush()
    saved = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    old = sys.stderr
    if on_fd2:
        sys.stderr = open(os.dup(saved), "w", buffering=1, encoding=getattr(old, "encoding", None) or "utf-8",
                          errors="backslashreplace")
    try:
        yield
    finally:
        if sys.stderr is not old:
            sys.stderr.close()
            sys.stderr = old
        os.dup2(saved, 2)
        os.close(saved)


def on_driver_node() -> dict:
    """Actor options that keep a driver-side helper (the window gate, the span sink) on this driver's
    node, where it lives and dies with the run, not with a worker host that may be lost (hard affinity:
    a soft one may place it elsewhere)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}
