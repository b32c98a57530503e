"""The pipeline builder, and the actors a run starts for it.

A pipeline is a source and map stages, which run as Ray Data streaming `map_batches` over
`pyarrow.Table` batches, each in its own actor pool; the window and the trainer take the stream from
there. Columns are checked when the pipeline is built, before anything runs. `start_actors` starts
what it runs against: the engines, the trainer, the window gate and the TransferMesh between them.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pyarrow as pa

from pipeline.profile import profiled

# what the window and the trainer read of every row at the end of the stream
TRAINED = ("group_id", "sample_idx", "status", "reward", "token_versions", "prompt_ids", "response_ids",
           "response_logprobs", "loss_mask")


def set_stream_poll(wake: str, seconds: float = 0.01) -> bool:
    """Ray Data's streaming executor waits for its running tasks with ray.wait(all of them, timeout=0.1 s)
    each loop: while one stage holds a long call (a rollout waiting at the gate), a block another stage
    finished sits there until the timeout. `wake="event"` (run.data_wake's default) wakes the executor per
    hand-off (_WakeOnOutput), polling every `seconds` while a ready task's output stays untaken (Ray's
    output budget); `wake="ray"`: Ray's own wait. Ray Data has no public setting for it:
    transfer/compat/ray_api.py swaps what its executor calls `ray`, for streams already open too.
    False (nothing changed) with "ray" or on a Ray Data without these internals."""
    from transfer.compat.ray_api import executor_ray, executor_wait_internals, set_executor_wait

    if executor_wait_internals():
        return False
    real = executor_ray()
    real = real._ray if isinstance(real, _WakeOnOutput) else real
    set_executor_wait(_WakeOnOutput(real) if wake == "event" else real,
                      float(seconds) if wake == "event" else _WakeOnOutput.MAX_SLEEP_S)
    return wake == "event"


class _WakeOnOutput:
    """Stands in for the `ray` module inside Ray Data's executor state module: `wait` for all of a
    list with a timeout becomes "sleep until the first is ready (at most MAX_SLEEP_S), then take every
    ready one"; everything else is the real module."""

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
        # ready before we slept and ready still: output the executor did not take. Poll as Ray does
        # (timeout `timeout`) so a stuck-ready task cannot make this loop spin.
        stuck = ready and frozenset(ready) <= self._last
        ready, rest = ray.wait(refs, num_returns=num_returns, timeout=timeout if stuck else 0, fetch_local=fetch_local)
        self._last = frozenset(ready)
        return ready, rest


class PipelineError(ValueError):
    pass


class Stage:
    """A map stage: a callable class `cls(*args, **kwargs)` with `__call__(pa.Table) -> pa.Table`, in a
    pool of `workers` actors; resources are per actor, and batch_rows None is one group block a call."""

    def __init__(self, cls: type, *args, workers: int = 1, num_cpus: float = 0.1, batch_rows: int | None = None,
                 inputs: tuple | None = None, outputs: tuple | None = None, max_concurrency: int = 1,
                 num_gpus: float = 0, **kwargs):
        self.cls, self.args, self.kwargs = cls, args, kwargs
        self.workers, self.num_cpus = workers, num_cpus
        self.batch_rows, self.max_concurrency, self.num_gpus = batch_rows, max_concurrency, num_gpus
        # calls queued per actor (None = Ray Data's default). A stage that blocks inside a call on
        # something an earlier block must do first (the window gate) sets 1 on its class: Ray Data
        # runs an actor's queued calls on several threads, so their order is not the queue's.
        self.tasks_in_flight = getattr(cls, "tasks_in_flight", None)
        self.inputs = tuple(inputs if inputs is not None else getattr(cls, "inputs", ()))
        self.outputs = tuple(outputs if outputs is not None else getattr(cls, "outputs", ()))

    @property
    def name(self) -> str:
        return getattr(self.cls, "__name__", str(self.cls))


class Pipeline:
    def __init__(self, stages: list):
        if not stages or not hasattr(stages[0], "dataset"):
            name = type(stages[0]).__name__ if stages else "nothing"
            raise PipelineError(f"a pipeline starts with a source (an object with .dataset()), not {name}")
        self.source, *self.maps = stages
        for s in self.maps:
            if not isinstance(s, Stage):
                raise PipelineError(f"{type(s).__name__}: the stages after the source must be Stage(...)")
        self.columns = self.check_columns()
        self.profiler = None     # set by the run: each map stage call then records a span (pipeline/profile.py)

    def check_columns(self) -> list[str]:
        """Walk the chain once; every input must be produced upstream. Returns the final columns."""
        available = list(self.source.outputs)
        for s in self.maps:
            missing = [c for c in s.inputs if c not in available]
            if missing:
                raise PipelineError(f"stage {s.name} needs column {missing[0]!r}, which no earlier stage "
                                    f"produces (available: {', '.join(available)})")
            available += [c for c in s.outputs if c not in available]
        missing = [c for c in TRAINED if c not in available]
        if missing:
            raise PipelineError(f"the window and the trainer need column {missing[0]!r}, which no stage produces "
                                f"(available: {', '.join(available)})")
        return available

    def stream(self, start: int, num_groups: int, groups_per_block: int,
               skip: frozenset = frozenset()) -> Iterator[pa.Table]:
        """Rows of groups [start, start + num_groups) but `skip`, through every map stage, as they finish."""
        from ray.data import ActorPoolStrategy

        n = getattr(self.source, "n_samples", 1)
        ds = self.source.dataset(start, num_groups, groups_per_block, skip)
        for s in self.maps:
            remote_args = {"max_concurrency": s.max_concurrency} if s.max_concurrency > 1 else {}
            remote_args |= {"num_gpus": s.num_gpus} if s.num_gpus else {}
            pool = ActorPoolStrategy(size=s.workers, max_tasks_in_flight_per_actor=s.tasks_in_flight)
            ds = ds.map_batches(profiled(s.cls, self.profiler), fn_constructor_args=s.args,
                                fn_constructor_kwargs=s.kwargs, batch_size=s.batch_rows or groups_per_block * n,
                                batch_format="pyarrow", compute=pool, num_cpus=s.num_cpus, **remote_args)
        yield from ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)


@dataclass
class Actors:
    """What a run starts: engines, trainer, window gate, the TransferMesh between them."""
    engines: list
    trainer: Any
    gate: Any
    mesh: Any
    placement: Any
    infos: list[dict]       # each engine's info() at start (its incarnation), then the trainer's
    res: Any
    megatron: bool          # the trainer is a leader of Megatron ranks

    def stop(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        if self.mesh is not None:
            self.mesh.close()
        if self.megatron and self.trainer is not None:
            with contextlib.suppress(RayActorError):        # lost with its host: the peer ranks end with this driver
                ray.get(self.trainer.shutdown.remote())     # the leader stops its peer ranks
        for h in [*self.engines, self.trainer, self.gate]:
            if h is not None:
                ray.kill(h)
        if self.placement is not None:
            self.placement.remove()


def start_actors(c, model_path: str, special_ids: tuple[int, int], version: int, resume: str = "",
                 log: Callable[[str], None] = print) -> Actors:
    """Start Ray, the engines, the trainer, the window gate and the mesh; with `resume` (a checkpoint
    directory) the trainer loads its state and the engines the clock (with LoRA: the adapter, sent).
    What started is stopped again when a later part fails."""
    import ray

    from pipeline.cluster import init_ray, on_driver_node
    from pipeline.placement import Placement, plan_pools
    from pipeline.resources import plan_resources
    from pipeline.window import Gate
    from transfer import TransferMesh
    from transfer.compat.ray_api import executor_wait_internals

    res = plan_resources(c)
    init_ray(c, res.ray_num_cpus)
    if not set_stream_poll(c.run.data_wake) and c.run.data_wake != "ray":
        log(f"run.data_wake={c.run.data_wake}: not applied on this Ray Data, which changed what it relies on "
            f"({'; '.join(executor_wait_internals())}); block hand-offs wait up to Ray's own 0.1 s")
    lora, megatron = c.trainer.lora.enabled, c.trainer.backend == "megatron"
    a = Actors([], None, None, None, None, [], res, megatron)
    try:
        if c.placement.mode != "none":      # placement groups when the recipe asks for them (a cluster)
            ranks, group = (c.megatron.world_size, c.megatron.tensor_parallel) if megatron else (1, 1)
            a.placement = Placement(plan_pools(c.placement, ranks, group, c.engine.count), c.placement.timeout_s)
        a.engines = start_engines(c, model_path, res, a.placement, special_ids)
        a.trainer = start_trainer(c, model_path, res, a.placement)
        a.gate = ray.remote(Gate).options(num_cpus=0, **on_driver_node()).remote(
            c.batcher.groups_per_step, c.rollout.stale_steps, c.rollout.window, version, True)   # held
        if resume:
            ray.get(a.trainer.load_state.remote(resume))
            if not lora:        # engines and the trainer started from the checkpoint's weights: the clock
                ray.get([e.load_weights.remote({}, version) for e in a.engines])
        a.infos = ray.get([e.info.remote() for e in a.engines] + [a.trainer.info.remote()])
        a.mesh = TransferMesh(a.trainer, {f"engine{i}": e for i, e in enumerate(a.engines)}, c.transfer)
        a.mesh.discover()
        if resume and lora:
            a.mesh.publish(version)           # the engines hold the base: the resumed adapter reaches them
    except BaseException:
        a.stop()
        raise
    return a


def check_lora(c, model_path: str) -> None:
    """trainer.lora's targets against the model itself (built on the meta device), and what the
    engine can serve of them; a ConfigError naming the key."""
    if not c.trainer.lora.enabled:
        return
    from pipeline.config import ConfigError
    from stages.lora import check_targets

    try:
        targets = check_targets(c.trainer.lora, model_path)
        if c.engine.kind == "vllm":
            from stages.agentflow.vllm_engine import check_lora as check

            check(c.trainer.lora)
        elif c.engine.kind == "sglang":
            from stages.agentflow.sglang_engine import check_lora_targets

            check_lora_targets(c.trainer.lora, model_path, targets)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def start_engines(c, model_path: str, res, placement=None, special_ids: tuple[int, int] | None = None) -> list:
    """special_ids: (eos, pad) of the model's tokenizer, which an HF engine then does not load."""
    import ray

    from pipeline import seeds
    from stages.agentflow.engine import HFEngine
    from stages.agentflow.sglang_engine import SGLangEngine
    from stages.agentflow.vllm_engine import VLLMEngine

    # engine.kind -> (engine class, extra constructor arguments from the config)
    cls, extra = {"hf": (HFEngine, (c.rollout.nice, c.trainer.lora, c.engine.max_rows, c.engine.kv_cache_mb,
                                    special_ids)),
                  "vllm": (VLLMEngine, (c.vllm, c.trainer.lora)),
                  "sglang": (SGLangEngine, (c.sglang, c.trainer.lora))}[c.engine.kind]
    if placement is not None:
        opts = placement.options("rollout")
    else:
        gpus = {"num_gpus": c.sglang.tp} if c.engine.kind == "sglang" else {}
        opts = [{"num_cpus": res.engine_cpus, **gpus}] * c.engine.count
    return [ray.remote(cls).options(**o, max_concurrency=16, max_restarts=c.engine.restarts).remote(
        model_path, c.model.dtype, seeds.derive(c.run.seed, "engine", i), res.engine_threads, f"engine{i}",
        *extra)
        for i, o in enumerate(opts)]


def start_trainer(c, model_path: str, res, placement=None):
    import ray

    from stages.update.trainer import TorchTrainer

    trainer_cfg = dataclasses.replace(c.trainer, num_threads=res.trainer_threads,
                                      lr_decay_steps=c.trainer.lr_decay_steps or c.run.steps)   # 0: over the run
    args = (c.algorithm, c.sampling.temperature, c.sampling.max_new_tokens, c.model.dtype)
    if c.trainer.backend == "megatron":
        from stages.update.megatron.launch import launch

        opts = placement.options("trainer") if placement is not None else None
        return launch(model_path, trainer_cfg, c.algorithm, c.megatron, *args[1:], rank_options=opts,
                      num_cpus=res.trainer_cpus / c.megatron.world_size)
    opts = placement.options("trainer")[0] if placement is not None else {"num_cpus": res.trainer_cpus}
    return ray.remote(TorchTrainer).options(**opts).remote(model_path, trainer_cfg, *args)
