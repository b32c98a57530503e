"""Ray for a run: start local Ray or join a cluster, once per process, with Ray Data's
settings for a run (no progress bars, no stats logs, no memory-issue detector); and
`ray_output_to(path)`, which keeps what Ray itself prints off the terminal."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import sys
from pathlib import Path

import ray

# A local Ray started for one run. Ray starts one idle worker per CPU for the first driver, for
# tasks to come; a run's work is actors, each started in a process of its own, so those workers
# sat idle through the run (~80 MB RSS each, measured). Not prestarted, a worker starts when one
# is needed, as every actor's does.
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
# Two of the processes a local Ray starts serve nothing a run uses (~80 MB RSS each, measured): the
# autoscaler monitor (no autoscaler on one machine) and the log monitor (it streams workers' output to
# the driver, which a run turns off: log_to_driver=False; the files stay in Ray's session dir).
# ray.init has no switch for them; Ray's own head-node settings (what `ray start --no-monitor
# --include-log-monitor=False` sets) do, and are passed through while ray.init builds them.
LOCAL_HEAD_SETTINGS = {"no_monitor": True, "include_log_monitor": False}


def init_ray(cfg, num_cpus: int) -> None:
    if ray.is_initialized():
        return
    if cfg.run.ray_address:
        ray.init(address=cfg.run.ray_address, log_to_driver=False)
    else:
        with _head_settings(LOCAL_HEAD_SETTINGS):
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(_code_roots())}},
                     _system_config=LOCAL_SYSTEM_CONFIG)
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.verbose_stats_logs = False
    ctx.issue_detectors_config.high_memory_detector_config.detection_time_interval_s = -1


@contextlib.contextmanager
def _head_settings(settings: dict):
    """While the block runs, the head-node parameters ray.init makes (ray._private.parameter.RayParams)
    get `settings` too. A Ray whose RayParams lacks one of them starts as it would without."""
    from ray._private import parameter

    cls = parameter.RayParams
    if not set(settings) <= set(inspect.signature(cls).parameters):
        yield
        return

    class WithSettings(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **(kwargs | settings))

    parameter.RayParams = WithSettings
    try:
        yield
    finally:
        parameter.RayParams = cls


def _code_roots() -> list[str]:
    """Make the project importable in workers even when it is run from a source checkout."""
    root = str(Path(__file__).resolve().parent.parent)
    return [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


@contextlib.contextmanager
def ray_output_to(path: str | Path):
    """While the block runs, what Ray itself prints goes to the file `path`, not the terminal.

    Three channels reach a driver's terminal, and each is moved:
    * Python loggers under `ray` (start-up and token-auth notices, Ray Data's execution
      plans): their console handlers give way to one handler on the file;
    * the C++ core worker in this process writes its warnings and errors straight to file
      descriptor 2 ("core_worker.cc: ... max_restarts > 0"): fd 2 is pointed at the file,
      and `sys.stderr` (the project's own output: progress, evaluation lines, tracebacks,
      Python warnings) keeps writing to the terminal through a copy of the old descriptor.
      Whatever else writes to fd 2 itself (a library's handler that kept the original
      sys.stderr object, a crash dump) lands in the file too;
    * errors the cluster pushes to the driver ("(raylet) Task ... failed ... ray.kill") are
      printed to sys.stdout by a Ray thread: its printer writes to the file instead.
    Ray is shut down before the block ends, so what it prints while stopping lands there too.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    importlib.import_module("ray.data")     # configures its logger, with a console handler, on import
    handler = logging.FileHandler(path)
    handler.setLevel(logging.INFO)      # Ray Data logs DEBUG too; its own ray-data.log in the session dir keeps them
    handler.setFormatter(logging.Formatter("%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"))
    try:
        with _loggers_to(handler), _fd2_to(path), _pushed_errors_to(logging.getLogger("ray.pushed_to_driver")):
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
        if isinstance(lg, logging.PlaceHolder):
            continue
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


@contextlib.contextmanager
def _pushed_errors_to(logger: logging.Logger):
    """Ray's error listener thread calls ray._private.worker.print_to_stdstream (looked up at
    each call): while the block runs, it logs the lines instead. A Ray without that function
    prints them as before."""
    from ray._private import worker

    printer = getattr(worker, "print_to_stdstream", None)

    def to_log(data: dict, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            logger.warning("(%s) %s", data.get("pid", "?"), line)

    if printer is not None:
        worker.print_to_stdstream = to_log
    try:
        yield
    finally:
        if printer is not None:
            worker.print_to_stdstream = printer


def on_driver_node() -> dict:
    """Actor options that keep a driver-side helper (the window gate, the span sink) on this
    driver's node: there it lives and dies with the run, not with a worker host that may be lost.
    The affinity is hard: a soft one let Ray place the gate on another host, which took it down with it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}
