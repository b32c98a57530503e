"""The pipeline builder: source -> map stages (Ray Data) -> batcher -> update.

    Pipeline([PromptSource(...), Stage(AgentFlowRollout, cfg.rollout, engines=...),
              Stage(Reward, cfg.reward), WindowedBatcher(...), Update(trainer)])

The map stages between the source and the batcher run as Ray Data streaming
`map_batches` over `pyarrow.Table` batches, each in its own actor pool (a stage's
heavy state loads once per actor). Columns are checked when the pipeline is built:
a stage that needs a column no earlier stage produces fails here, before anything runs.
"""
from __future__ import annotations

from typing import Any, Iterator

import pyarrow as pa

from pipeline.profile import profiled


class PipelineError(ValueError):
    pass


# The Ray releases whose executor internals set_stream_poll was read against and measured on
# (pyproject.toml pins ray to this range). tests/test_pipeline.py checks the internals on the
# installed Ray, so an upgrade that changes them fails there, loudly, not by running slower.
RAY_DATA_TESTED = ("2.60",)


def stream_poll_internals() -> list[str]:
    """What set_stream_poll relies on that this Ray lacks (empty: all there)."""
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


def set_stream_poll(seconds: float, wake: str = "event") -> bool:
    """How Ray Data's streaming executor (on the driver) waits for its running tasks.

    Each loop of Ray's executor waits for *all* running tasks with a timeout (0.1 s), so while
    one stage holds a long call (a rollout waiting at the window for the next version) a block
    another stage has finished sits there until the timeout: 70-120 ms per hand-off measured
    here, on the critical path from rollout to trainer. Ray Data has no public setting for
    it. `wake="poll"`: the timeout becomes `seconds` (every loop costs ~1.5 ms of driver CPU:
    at 0.01 s that was ~15% of the driver's CPU in an async quickstart run). `wake="event"`:
    the executor sleeps until the first of its tasks produces output (at most 0.1 s) and
    then takes all that are ready, so it wakes per hand-off, not per poll; a task that stays
    ready without its output being taken (Ray's output budget) makes that loop fall back to
    polling every `seconds`. Both take effect for streams already open. Returns False (and
    changes nothing) on a Ray Data without these internals (stream_poll_internals), and with
    `wake="ray"`: Ray's own polling then runs.

    Ray Data has no public route to this: DataContext's options (execution, backpressure,
    prefetching) and iter_batches' prefetch settings change what runs, not how long the
    executor sleeps between hand-offs. Measured against `wake="ray"` (Ray as it ships), async
    quickstart, 40 steps, 2 alternating rounds (session 7): step 399 / 454 ms (event) vs
    362 / 524 ms (ray), trainer busy 0.95 / 0.95 vs 0.90 / 0.87. The step times are within this
    machine's noise; the trainer-busy gap repeats, as did the 70-120 ms per hand-off measured when
    the patch was written. Kept by default; `run.data_wake=ray` turns it off."""
    from ray.data._internal.execution import streaming_executor_state as state

    if wake not in ("event", "poll", "ray"):
        raise ValueError(f"run.data_wake must be event, poll or ray, got {wake!r}")
    if stream_poll_internals():
        return False
    if wake == "ray":
        state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = _RAY_DEFAULT_POLL_S
        state.ray = state.ray._ray if isinstance(state.ray, _WakeOnOutput) else state.ray
        return False
    state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = float(seconds)
    real = state.ray._ray if isinstance(state.ray, _WakeOnOutput) else state.ray
    state.ray = _WakeOnOutput(real) if wake == "event" else real
    return True


_RAY_DEFAULT_POLL_S = 0.1


class _WakeOnOutput:
    """Stands in for the `ray` module inside Ray Data's executor state module: `wait` for all
    of a list with a timeout becomes "sleep until the first is ready (at most MAX_SLEEP_S),
    then take every ready one"; everything else is the real module."""

    MAX_SLEEP_S = 0.1       # Ray's own loop period: nothing waits longer than it did

    def __init__(self, real):
        self._ray, self._last = real, frozenset()

    def __getattr__(self, name):
        return getattr(self._ray, name)

    def wait(self, refs, *, num_returns=1, timeout=None, fetch_local=True):
        ray = self._ray
        if num_returns != len(refs) or timeout is None:
            return ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.MAX_SLEEP_S, fetch_local=fetch_local)
        if ready and frozenset(ready) <= self._last:
            # ready before we slept and ready still: output the executor did not take. Poll as
            # Ray does (timeout `timeout`) so a stuck-ready task cannot make this loop spin.
            ready, rest = ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)
        else:
            ready, rest = ray.wait(refs, num_returns=num_returns, timeout=0, fetch_local=fetch_local)
        self._last = frozenset(ready)
        return ready, rest


class Stage:
    """A map stage: a callable class `cls(*args, **kwargs)` with `__call__(pa.Table) -> pa.Table`.

    workers: actor pool size; num_cpus: logical CPUs per actor (threads are the stage's
    business); batch_rows: rows per call (None = one group block per call);
    max_concurrency: concurrent calls per actor (a threaded actor when > 1); num_gpus: GPUs
    per actor; tasks_in_flight: calls queued per actor.
    """

    def __init__(self, cls: type, *args, workers: int = 1, num_cpus: float = 0.1, batch_rows: int | None = None,
                 inputs: tuple | None = None, outputs: tuple | None = None, max_concurrency: int = 1,
                 num_gpus: float = 0, tasks_in_flight: int | None = None, **kwargs):
        self.cls, self.args, self.kwargs = cls, args, kwargs
        self.workers, self.num_cpus = workers, num_cpus
        self.batch_rows, self.max_concurrency = batch_rows, max_concurrency
        self.num_gpus = num_gpus   # GPUs per actor (e.g. a GPU teacher pool); 0 = CPU only
        # calls queued per actor (None = Ray Data's default). A stage that blocks inside a call on
        # something an earlier block must do first (the window gate) sets 1 on its class: Ray Data
        # runs an actor's queued calls on several threads, so their order is not the queue's.
        self.tasks_in_flight = tasks_in_flight if tasks_in_flight is not None else getattr(cls, "tasks_in_flight", None)
        self.inputs = tuple(inputs if inputs is not None else getattr(cls, "inputs", ()))
        self.outputs = tuple(outputs if outputs is not None else getattr(cls, "outputs", ()))

    @property
    def name(self) -> str:
        return getattr(self.cls, "__name__", str(self.cls))


def _name(obj: Any) -> str:
    return obj.name if isinstance(obj, Stage) else type(obj).__name__


class Pipeline:
    def __init__(self, stages: list):
        if len(stages) < 3:
            raise PipelineError("a pipeline needs at least a source, a batcher and an update")
        self.source, *self.maps, self.batcher, self.update = stages
        if not hasattr(self.source, "dataset"):
            raise PipelineError(f"first stage {_name(self.source)} is not a source (it has no .dataset())")
        for s in self.maps:
            if not isinstance(s, Stage):
                raise PipelineError(f"{_name(s)}: stages between the source and the batcher must be Stage(...)")
        self.columns = self.check_columns()
        self.profiler = None     # set by the controller: each map stage call then records a span (pipeline/profile.py)

    def check_columns(self) -> list[str]:
        """Walk the chain once; every input must be produced upstream. Returns the final columns."""
        available = list(self.source.outputs)
        for s in [*self.maps, self.batcher, self.update]:
            missing = [c for c in getattr(s, "inputs", ()) if c not in available]
            if missing:
                raise PipelineError(f"stage {_name(s)} needs column {missing[0]!r}, which no earlier stage "
                                    f"produces (available: {', '.join(available)})")
            available += [c for c in getattr(s, "outputs", ()) if c not in available]
        return available

    def dataset(self, start: int, num_groups: int, groups_per_block: int, skip: frozenset = frozenset(),
                source=None):
        """The lazy Ray Dataset of stages source -> ... -> last map stage (`source`: the source's
        dataset for these arguments, already made)."""
        from ray.data import ActorPoolStrategy

        n = getattr(self.source, "n_samples", 1)
        ds = source if source is not None else self.source.dataset(start, num_groups, groups_per_block, skip)
        for s in self.maps:
            remote_args = {"max_concurrency": s.max_concurrency} if s.max_concurrency > 1 else {}
            remote_args |= {"num_gpus": s.num_gpus} if s.num_gpus else {}
            fn = profiled(s.cls, self.profiler)      # s.cls itself when no profiler is set
            pool = ActorPoolStrategy(size=s.workers, max_tasks_in_flight_per_actor=s.tasks_in_flight)
            ds = ds.map_batches(fn, fn_constructor_args=s.args, fn_constructor_kwargs=s.kwargs,
                                batch_size=s.batch_rows or groups_per_block * n, batch_format="pyarrow",
                                compute=pool, num_cpus=s.num_cpus, **remote_args)
        return ds

    def stream(self, start: int, num_groups: int, groups_per_block: int,
               skip: frozenset = frozenset(), source=None) -> Iterator[pa.Table]:
        ds = self.dataset(start, num_groups, groups_per_block, skip, source)
        yield from ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)
