"""Ray internals (pinned in pyproject.toml; checked by tests/test_compat.py)."""
from __future__ import annotations

import contextlib

RAY_DATA_TESTED = ("2.60",)      # the releases the executor internals below were read against


def executor_wait_internals() -> list[str]:
    """What `executor_ray`/`set_executor_wait` rely on in Ray Data's `streaming_executor_state` that this
    Ray lacks (empty: all there). Ray Data has no public setting for how its streaming executor waits
    for running tasks."""
    import inspect

    import ray
    from ray.data._internal.execution import streaming_executor_state as state

    missing = [f"streaming_executor_state.{n}" for n in ("WAIT_FOR_TASK_COMPLETION_TIMEOUT_S", "ray",
                                                         "process_completed_tasks") if not hasattr(state, n)]
    if not missing:
        src = inspect.getsource(state.process_completed_tasks)
        if "ray.wait(" not in src or "timeout=WAIT_FOR_TASK_COMPLETION_TIMEOUT_S" not in src:
            missing.append("process_completed_tasks: ray.wait(..., timeout=WAIT_FOR_TASK_COMPLETION_TIMEOUT_S)")
    if not ray.__version__.startswith(RAY_DATA_TESTED):
        missing.append(f"ray {ray.__version__} (tested: {', '.join(RAY_DATA_TESTED)})")
    return missing


def executor_ray():
    """What Ray Data's streaming executor calls as `ray` (the module, or what set_executor_wait put there)."""
    from ray.data._internal.execution import streaming_executor_state as state

    return state.ray


def set_executor_wait(ray_like, timeout_s: float) -> None:
    """Make Ray Data's streaming executor (on the driver) wait for its running tasks with
    `ray_like.wait(all of them, timeout=timeout_s)`: `ray_like` replaces the executor-state module's
    `ray` and `timeout_s` its WAIT_FOR_TASK_COMPLETION_TIMEOUT_S. Takes effect for streams already open."""
    from ray.data._internal.execution import streaming_executor_state as state

    state.ray = ray_like
    state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = timeout_s


@contextlib.contextmanager
def pushed_errors_to(callback):
    """While the block runs, Ray's error listener thread hands each pushed error to
    `callback(data: dict, ignore_prefix: bool = False)` (data's "lines", "pid") instead of printing it:
    it calls `ray._private.worker.print_to_stdstream`, looked up at each call, which is replaced; Ray
    has no public hook for those lines. A Ray without it prints them as before."""
    from ray._private import worker

    printer = getattr(worker, "print_to_stdstream", None)
    if printer is not None:
        worker.print_to_stdstream = callback
    try:
        yield
    finally:
        if printer is not None:
            worker.print_to_stdstream = printer
