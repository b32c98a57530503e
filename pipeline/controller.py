"""The single controller: builds the actors and the pipeline, then runs the step loop.

    for each step:
        batch   = next B complete groups from the stream   (rollout runs in Ray Data; a
                                                             thread takes it during the
                                                             previous update)
        metrics = trainer.train_step(batch)                 (update; the previous step's
                                                             bookkeeping runs meanwhile)
        version += 1; publish weights to every engine       (weight sync)
        gate.consumed(batch groups, version)                (the window moves on)

The driver holds no weights. It keeps the version clock, writes the run directory
(config.yaml, metrics.jsonl, rollouts/, checkpoints/) and evaluates periodically.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

import pyarrow as pa
import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from pipeline import checkpoint as ckpt
from pipeline import rundir, seeds
from pipeline.builder import Pipeline, Stage, set_stream_poll, stream_poll_internals
from pipeline.cluster import init_ray, on_driver_node
from pipeline.config import Config, ConfigError, dump_config, to_dict
from pipeline.evaluate import evaluate, evaluate_agent
from pipeline.loop import Batch, StepLoop, StepParts
from pipeline.nodewatch import NodeWatch
from pipeline.placement import Placement, plan_pools
from pipeline.profile import Profiler
from pipeline.recorder import Recorder
from pipeline.resources import plan_resources
from pipeline.trackers import open_metrics
from pipeline.window import Gate, capacity, make_strategy
from stages.agentflow.engine import HFEngine
from stages.agentflow.rollout import AgentFlowRollout, load_agent
from stages.agentflow.sglang_engine import SGLangEngine
from stages.agentflow.vllm_engine import VLLMEngine
from stages.batcher import WindowedBatcher, mask_old_versions
from stages.lora import LoraTargetError, base_of, check_targets, is_adapter_dir
from stages.model import load_tokenizer, resolve_model_path
from stages.prompts import PromptSource, load_prompts
from stages.reward import Reward, load_reward_fn
from stages.schema import conform
from stages.teacher import TeacherScoring, check_recipe, check_teachers, teacher_metrics
from stages.tokenizer import stage_tokenizer, tokenizer_class_of
from stages.update.stage import Update
from stages.update.trainer import TorchTrainer
from transfer import TransferError, TransferMesh

# The stream is opened in chunks of steps' groups (+ window capacity). Each new chunk is a new
# Ray Data execution whose actor pools start afresh (~5 s on 2 cores): chunks are as long as
# CHUNK_BYTES of prompt rows allows, between CHUNK_STEPS_MIN and CHUNK_STEPS_MAX steps.
CHUNK_BYTES = 64 * 2**20
CHUNK_STEPS_MIN, CHUNK_STEPS_MAX = 50, 2000     # 2,000 steps of add-tiny: ~4,000 blocks, ~4 s to cut (prebuilt)


class Controller:
    def __init__(self, cfg: Config, run_dir: str | Path, rows: list[dict] | None = None,
                 on_step: Callable[[dict], None] | None = None, log: Callable[[str], None] = print):
        cfg = seeds.resolve(cfg)    # a Config built in code, not by load_config, gets its seeds here
        self.cfg, self.run_dir, self.on_step, self.log = cfg, Path(run_dir), on_step, log
        self.validate()
        self.model_path = resolve_model_path(cfg.model, log=log, check_tokenizer=False)   # loaded below
        self._check_lora()
        self.done_seqs: set[int] = set()        # groups taken or dropped: never dispatched again
        self.settled: set[int] = set()          # groups trained or dropped: what a checkpoint calls done
        self.resume_path = ckpt.resolve(cfg.run.resume_from, self.run_dir, log) if cfg.run.resume_from else None
        self.resume_state = self._load_resume(str(self.resume_path)) if self.resume_path else None
        # The driver's one tokenizer load: what workers need to load theirs by class (no AutoTokenizer,
        # no torch), the special ids HF engines need (they load none), and evaluation's encoding.
        tok = load_tokenizer(self.model_path)
        self.tok_class = tokenizer_class_of(tok)
        self.special_ids = (tok.eos_token_id, tok.pad_token_id)
        # what checkpoints copy (the trainer then loads no tokenizer at the end of an update)
        self.tokenizer_staged = stage_tokenizer(tok, tempfile.mkdtemp(prefix="loongsage-tokenizer-"))
        self._unstage = weakref.finalize(self, shutil.rmtree, self.tokenizer_staged, True)
        self.source = PromptSource(cfg.data, cfg.rollout.n_samples, rows=rows)
        self.test = self._load_test()
        self.tok = tok if self.test is not None else None     # held only for evaluation (~45 MB at 151k tokens)
        del tok
        self._reward_local: Reward | None = None
        if cfg.teacher.enabled:    # teacher dirs, tokenizers, budget and routes, before any actor starts
            sources = set(self.source.table.column("data_source").to_pylist())
            check_teachers(cfg.teacher, self.model_path, sources)
        self._start_version = self.resume_state["version"] if self.resume_state else 0
        self._start_step = self.resume_state["step"] if self.resume_state else 0
        self.loop: StepLoop | None = None        # the step loop holds the clock (step, version) while it runs
        self._mesh_lock = threading.RLock()     # one weight publish at a time (step loop, engine watch)
        self._seqs_lock = threading.Lock()      # done_seqs: the prefetch thread adds, checkpoints read
        self.engine_restarts = 0
        self.nodes = NodeWatch(cfg.run.node_wait_s, log)     # a lost Ray node: say so, wait, then stop

    # ---- start-up checks: everything that can be wrong is found before an actor exists
    def validate(self) -> None:
        c = self.cfg
        load_reward_fn(c.reward.fn)
        load_agent(c.rollout.agent, c.rollout.agent_preload)
        make_strategy(c.rollout.window)
        capacity(c.batcher.groups_per_step, c.rollout.stale_steps)
        step_samples = c.batcher.groups_per_step * c.rollout.n_samples
        mb = c.trainer.mini_batch_size
        if mb and step_samples % mb:
            raise ConfigError(f"trainer.mini_batch_size={mb} does not divide batcher.groups_per_step x "
                              f"rollout.n_samples = {step_samples}")
        if c.run.steps <= 0:
            raise ConfigError(f"run.steps must be > 0, got {c.run.steps}")
        if c.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine=vllm needs vLLM: pip install -e '.[vllm]' (docs/vllm.md)")
        check_recipe(c.teacher, c.algorithm)
        if c.algorithm.distill_coef and c.trainer.backend != "torch":
            raise ConfigError("algorithm.distill_coef > 0 needs trainer.backend=torch (the Megatron trainer has no "
                              "distillation term yet)")

    def _check_lora(self) -> None:
        """trainer.lora's targets against the model itself (built on the meta device), before any actor."""
        lora = self.cfg.trainer.lora
        if not lora.enabled:
            return
        try:
            targets = check_targets(lora, self.model_path)
        except LoraTargetError as e:
            raise ConfigError(str(e)) from e
        if self.cfg.rollout.engine == "vllm":
            from stages.agentflow.vllm_engine import check_lora

            try:
                check_lora(lora)
            except ValueError as e:
                raise ConfigError(str(e)) from e
        if self.cfg.rollout.engine == "sglang":
            from stages.agentflow.sglang_engine import check_lora_targets

            try:
                check_lora_targets(lora, self.model_path, targets)
            except ValueError as e:
                raise ConfigError(str(e)) from e

    def _load_resume(self, path: str) -> dict:
        """A checkpoint holds HF weights (with LoRA: a peft adapter naming its base), trainer_state.pt and
        controller.json (clock + consumed groups); pipeline/checkpoint.py has verified it."""
        p = Path(path)
        lora = self.cfg.trainer.lora.enabled
        for f in ("adapter_config.json" if lora else "config.json", "trainer_state.pt", "controller.json"):
            if not (p / f).is_file():
                hint = ""
                if not lora and is_adapter_dir(p):
                    hint = "; it holds a LoRA adapter: resume it with trainer.lora.enabled=true"
                elif lora and (p / "config.json").is_file():
                    hint = "; it holds full weights, not a LoRA adapter (trainer.lora.enabled is true)"
                raise ConfigError(f"run.resume_from={path}: not a resumable checkpoint (no {f}){hint}")
        state = json.loads((p / "controller.json").read_text())
        self.done_seqs = set(state["done_seqs"])
        self.settled = set(self.done_seqs)
        if lora:    # engines and the trainer start from the base; the trainer loads the adapter, engines get it sent
            base = base_of(p)
            if os.path.realpath(base) != os.path.realpath(self.model_path):
                raise ConfigError(f"run.resume_from={path}: its adapter was trained on {base}, this run's model is "
                                  f"{self.model_path} (model.path, or the built-in model's settings)")
        else:
            self.model_path = str(p)         # engines and the trainer start from the checkpoint's weights
        return state

    def _load_test(self) -> pa.Table | None:
        c = self.cfg.data
        path = c.test_path or (c.path if c.path.startswith("builtin:") else "")
        if not path or self.cfg.eval.num_prompts == 0:
            return None
        return load_prompts(c, path=path, split="test", size=self.cfg.eval.num_prompts).slice(
            0, self.cfg.eval.num_prompts)

    # ---- actors ----------------------------------------------------------------------
    def start(self, early: bool = False) -> None:
        """Start Ray, the engines, the trainer, the window gate and the pipeline. `early` (the
        controller's own run, which nothing swaps a pipeline into): the first chunk's stream opens as
        soon as the actors exist, so its actor pools spawn while the engines and trainer load (~7 s on
        2 cores that the first step would otherwise wait for); the gate holds every dispatch until
        the run's clock starts (run(), after the step-0 evaluation)."""
        c = self.cfg
        res = self.res = plan_resources(c)
        init_ray(c, res.ray_num_cpus)
        self._prebuild_first_chunk()
        if not set_stream_poll(c.run.data_poll_s, c.run.data_wake) and c.run.data_wake != "ray":
            self.log(f"run.data_wake={c.run.data_wake}: not applied on this Ray Data, which changed what it relies on "
                     f"({'; '.join(stream_poll_internals())}); block hand-offs wait up to Ray's own 0.1 s")
        self.placement = _placement(c)
        self.engines = _start_engines(c, self.model_path, res, self.placement, self.special_ids)
        self.trainer = _start_trainer(c, self.model_path, res, self.placement)
        self.gate = ray.remote(Gate).options(num_cpus=0, **on_driver_node()).remote(
            c.batcher.groups_per_step, c.rollout.stale_steps, c.rollout.window, self.version)
        if early:
            self.profiler = Profiler(self.run_dir)
            self.pipeline = self.build_pipeline()
            self.pipeline.profiler = self.profiler
            self._open_early_stream()
        if self.resume_state:
            ray.get(self.trainer.load_state.remote(str(self.resume_path)))
            if not c.trainer.lora.enabled:      # LoRA: the adapter is published below, with the clock
                ray.get([e.load_weights.remote({}, self.version) for e in self.engines])   # engines report the clock
        infos = ray.get([e.info.remote() for e in self.engines] + [self.trainer.info.remote()])
        self._engine_infos = infos[:-1]
        self.threads = {"engines": [i.get("threads", res.engine_threads) for i in infos[:-1]],
                        "trainer": res.trainer_threads}     # an HF engine may time 1 thread as faster
        self._start_mesh()
        if self.resume_state and c.trainer.lora.enabled:
            self.mesh.publish(self.version)     # the engines hold the base: the resumed adapter reaches them
        if not early:
            self.pipeline = self.build_pipeline()

    @property
    def reward_local(self) -> Reward:
        """The reward stage in this process, for evaluation: made on first use, with the driver's
        tokenizer (a run without evaluation never makes it)."""
        if self._reward_local is None:
            self._reward_local = Reward(self.cfg.reward, self.model_path, tokenizer=self.tok)
        return self._reward_local

    def _start_mesh(self) -> None:
        """The TransferMesh from the trainer to every engine; its topology and routes go to topology.txt."""
        self.mesh = TransferMesh(self.trainer, {f"engine{i}": e for i, e in enumerate(self.engines)}, self.cfg.transfer)
        self.mesh.discover()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        routes = "\n".join(f"{n}: {r.transport} ({r.reason})" for n, r in self.mesh.plan().items())
        (self.run_dir / "topology.txt").write_text(self.mesh.topology_table() + "\n\n" + routes + "\n")

    def build_pipeline(self) -> Pipeline:
        """The default pipeline: source -> rollout -> [teacher scoring] -> reward -> batcher -> update."""
        c, res = self.cfg, self.res
        return Pipeline([
            self.source,
            Stage(AgentFlowRollout, c.rollout, self.engines, self.gate, self.model_path, self.tok_class,
                  workers=c.rollout.num_workers, num_cpus=res.worker_cpus),
            *([Stage(TeacherScoring, c.teacher, self.model_path, res.engine_threads, workers=c.teacher.workers,
                     num_cpus=res.worker_cpus)] if c.teacher.enabled else []),
            Stage(Reward, c.reward, self.model_path, c.rollout.nice, self.tok_class, num_cpus=res.worker_cpus),
            WindowedBatcher(c.batcher, c.rollout.n_samples, c.rollout.stale_steps, make_strategy(c.rollout.window)),
            Update(self.trainer),
        ])

    def stop(self) -> None:
        early, self._early = getattr(self, "_early", None), None
        if early is not None:       # opened but never taken (the run failed before its first step)
            early[1].close()
        if getattr(self, "_eval_rollout", None) is not None:
            self._eval_rollout.close()
        if getattr(self, "_reward_local", None) is not None:
            self._reward_local.close()          # its reward worker processes
        if getattr(self, "trainer", None) is not None and self.cfg.trainer.backend == "megatron":
            with contextlib.suppress(RayActorError):        # lost with its host: the peer ranks end with this driver
                ray.get(self.trainer.shutdown.remote())     # the leader stops its peer ranks
        for h in getattr(self, "engines", []) + [getattr(self, "trainer", None), getattr(self, "gate", None)]:
            if h is not None:
                ray.kill(h)
        if getattr(self, "placement", None) is not None:
            self.placement.remove()
        if getattr(self, "_unstage", None) is not None:
            self._unstage()

    # ---- the run ---------------------------------------------------------------------
    def run(self) -> dict:
        """Evaluate, run the step loop, evaluate again, checkpoint; returns the run's summary."""
        with rundir.locked(self.run_dir, self.log):      # the CLI holds it already; a Python caller takes it here
            return self._run()

    def _run(self) -> dict:
        c = self.cfg
        self._open_run_dir()
        self.loop = StepLoop(self._step_parts(), c.run.steps, step=self.step, version=self.version,
                             queue_next=c.rollout.stale_steps >= 1, checkpoint_every=c.run.checkpoint_every)
        try:
            with self._engine_watch(), _interrupts(self.loop.stop, self._on_interrupt) as signals:
                initial = self._evaluate() if self.test is not None else {}
                self.t_opened = time.time()
                ray.get(self.gate.open.remote())      # held while an early stream's pools spawned
                self._t_step = time.time()
                try:
                    self.loop.run()
                except (RayActorError, TransferError):    # the trainer's host lost: stop as for any lost node
                    if not self.nodes.trainer_lost(lambda: ray.get(self.trainer.info.remote(), timeout=5)):
                        raise
                self._wait_window()
                return self._close_run(initial, signals)
        finally:
            self.loop.close()
            try:
                ray.get(self.gate.close.remote())
            except (RayActorError, ActorUnavailableError) as e:   # lost with its node: nothing to close
                self.log(f"window gate not closed: {type(e).__name__}")
            self.mesh.close()
            self.metrics.close()
            try:
                self.profiler.close()
            except (RayActorError, ActorUnavailableError) as e:   # its node was lost: the spans with it
                self.log(f"profile not written: {type(e).__name__}")

    @property
    def step(self) -> int:
        return self.loop.step if self.loop is not None else self._start_step

    @property
    def version(self) -> int:
        return self.loop.version if self.loop is not None else self._start_version

    def _open_run_dir(self) -> None:
        c = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(c, self.run_dir / "config.yaml")
        self.metrics = open_metrics(self.run_dir, c.trackers, to_dict(c), self.log)
        self.recorder = Recorder(self.run_dir, c.rollout.n_samples)
        if hasattr(self, "pipeline"):       # a caller may start() and swap in its own pipeline first
            self.profiler = self.pipeline.profiler = Profiler(self.run_dir)
        else:
            self.start(early=True)
        self._consumed = None
        self._tables_left = c.run.steps - self.step     # the batch stream's own count (it runs ahead)
        self._take_version = self.version              # the version the next table taken is trained at

    def _step_parts(self) -> StepParts:
        """The step loop's parts: the batch stream, the trainer, the TransferMesh, the window gate."""
        update = self.pipeline.update
        return StepParts(
            batches=self.batches(),
            submit=update.submit if hasattr(update, "submit") else update,   # an update without submit runs here
            record=self._finish, publish_begin=self.mesh.publish_begin, publish_end=self.publish_end,
            window_moved=self._window_moved, checkpoint=self.checkpoint, lock=self._mesh_lock,
            release=lambda: ray.get(self.gate.close.remote()),
            # One chunk per column: a step's table is sliced from many Ray Data blocks, and
            # serialising slices ships their parent buffers (measured 796 KB vs 52 KB).
            put=lambda table: ray.put(table.combine_chunks()),
            span=self.profiler.add)

    def _window_moved(self, batch: Batch, version: int) -> None:
        """Not waited for: the gate runs this driver's calls in order, so the next batch sees it;
        the previous step's call is long done and surfaces any error."""
        self._wait_window()
        with self._seqs_lock:
            self.settled.update(batch.groups)
        self._consumed = self.gate.consumed.remote(batch.groups, version)

    def _wait_window(self) -> None:
        if self._consumed is not None:
            ray.get(self._consumed)
            self._consumed = None

    def _close_run(self, initial: dict, signals: list[int]) -> dict:
        c = self.cfg
        summary = {"steps": self.step, "version": self.version, "initial": initial, "run_dir": str(self.run_dir),
                   "threads": self.threads}
        if signals:       # no final eval: the user asked to stop; the checkpoint below resumes it
            path = self.checkpoint(self.loop.untrained())
            return summary | {"final": {}, "interrupted": signal.Signals(signals[0]).name, "resume_from": path}
        if self.nodes.reason:       # a node was lost for good: the same stop, unless the trainer went with it
            if "trainer" in self.nodes.reason:      # its state is gone: the newest checkpoint on disk resumes
                newest = ckpt.newest_intact(self.run_dir / "checkpoints")
                path = str(newest) if newest else ""
            else:
                path = self.checkpoint(self.loop.untrained())
            return summary | {"final": {}, "interrupted": "NODE_LOST", "lost": self.nodes.reason, "resume_from": path}
        if self.step < c.run.steps:
            self.log(f"the data stream ended after {self.step} of {c.run.steps} steps "
                     f"(dropped: {self.pipeline.batcher.stats})")
        self.loop.close()
        final = self._evaluate() if self.test is not None else {}
        self.checkpoint(self.loop.untrained())
        return summary | {"final": final}

    def _on_interrupt(self, signum: int) -> None:
        self.log(f"{signal.Signals(signum).name}: stopping after step {self.loop.last_step()}, then writing a "
                 f"checkpoint (press Ctrl-C again to exit at once)")

    def _finish(self, step: int, batch: Batch, line: dict) -> None:
        """A trained step's bookkeeping: rollouts, metrics, periodic eval. Runs while the
        trainer works on the next step (the engines serve this step's weights meanwhile)."""
        c, table = self.cfg, batch.table
        self.recorder.write(step, table)
        line = line | self._staleness(table, batch.version) | self._rollout_metrics(table) | teacher_metrics(table) \
            | self._pipeline_metrics(table, line)
        if self.test is not None and c.eval.every and step % c.eval.every == 0 and step < c.run.steps:
            line |= self._evaluate(write=False, step=step)
        self._emit(line, step, batch.version + 1)

    def batches(self):
        """Yield (step table, seconds waited) as soon as B eligible complete groups exist."""
        c = self.cfg
        B = c.batcher.groups_per_step
        gpb = c.rollout.groups_per_batch or B
        batcher = self.pipeline.batcher
        t_wait = time.time()
        start = self._first_seq()
        while self._tables_left > 0:
            count = self._chunk_count(start, self._tables_left)
            yield from self._chunk(start, count, gpb, batcher, t_wait)
            start += count
            t_wait = time.time()

    def _first_seq(self) -> int:
        return min(set(range(max(self.done_seqs, default=-1) + 2)) - self.done_seqs)   # first group not done

    def _chunk_count(self, start: int, tables_left: int) -> int:
        """Groups in the chunk from `start`: its steps' groups, the window's capacity ahead, and the
        groups already done in that range (skipped)."""
        B = self.cfg.batcher.groups_per_step
        count = min(tables_left, self._chunk_steps()) * B + capacity(B, self.cfg.rollout.stale_steps)
        return count + sum(1 for q in self.done_seqs if q >= start)

    def _prebuild_first_chunk(self) -> None:
        """Cut the first chunk's prompt blocks into the object store in the background while the actors
        load: ~2,000 blocks take seconds (a ray.put and a metadata task each), which the first step
        would otherwise wait for after the step-0 evaluation."""
        c = self.cfg
        start = self._first_seq()
        key = (start, self._chunk_count(start, c.run.steps - self.step), frozenset(self.done_seqs))
        gpb = c.rollout.groups_per_batch or c.batcher.groups_per_step
        self.prebuilt_used = False
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prebuild")
        self._prebuilt = (key, pool.submit(self.source.dataset, key[0], key[1], gpb, key[2]))
        pool.shutdown(wait=False)

    def _open_early_stream(self) -> None:
        """The first chunk's stream, opened now (start(early=True)) with the dispatch held at the gate."""
        key, gpb = self._prebuilt[0], self.cfg.rollout.groups_per_batch or self.cfg.batcher.groups_per_step
        start, count, skip = key
        ray.get(self.gate.hold.remote())
        ray.get(self.gate.expect.remote([q for q in range(start, start + count) if q not in skip]))
        self.early_used = False
        self._early = (key, EarlyStream(lambda: self.pipeline.stream(
            start, count, gpb, skip, source=self._take_prebuilt(start, count, skip))))

    def _take_early(self, start: int, count: int, skip: frozenset):
        """The early stream when this chunk is the one it was opened for (else it is closed, and None)."""
        early, self._early = getattr(self, "_early", None), None
        if early is None:
            return None
        if early[0] != (start, count, skip):
            early[1].close()
            return None
        self.early_used = True
        return early[1].iterate()

    def _take_prebuilt(self, start: int, count: int, skip: frozenset):
        """The prebuilt source dataset when this chunk is the one it was cut for, else None."""
        pre, self._prebuilt = getattr(self, "_prebuilt", None), None
        if pre is None or pre[0] != (start, count, skip) or self.pipeline.source is not self.source:
            return None
        self.prebuilt_used = True
        return pre[1].result()

    def _chunk_steps(self) -> int:
        table = self.source.table
        row_bytes = table.nbytes / max(table.num_rows, 1)
        step_bytes = max(self.cfg.batcher.groups_per_step * self.cfg.rollout.n_samples * row_bytes, 1.0)
        return int(min(CHUNK_STEPS_MAX, max(CHUNK_STEPS_MIN, CHUNK_BYTES // step_bytes)))

    def _chunk(self, start, count, gpb, batcher, t_wait):
        c, B = self.cfg, self.cfg.batcher.groups_per_step
        ray.get(self.gate.expect.remote([q for q in range(start, start + count) if q not in self.done_seqs]))
        skip = frozenset(self.done_seqs)
        stream = self._take_early(start, count, skip)
        if stream is None:
            stream = self.pipeline.stream(start, count, gpb, skip, source=self._take_prebuilt(start, count, skip))
        try:
            for part in stream:
                done = batcher.feed(part)
                if done:
                    ray.get(self.gate.collected.remote(done))
                state = ray.get(self.gate.snapshot.remote()) if batcher.strategy else None
                while True:
                    table, dropped = batcher.take(self._take_version, _StateView(state, B) if state else None)
                    if dropped:
                        with self._seqs_lock:
                            self.done_seqs.update(dropped)
                            self.settled.update(dropped)
                        ray.get(self.gate.release.remote(dropped))
                    if table is None:
                        break
                    with self._seqs_lock:
                        self.done_seqs.update(table.column("group_id").to_pylist())
                    if c.rollout.partial_mask_old:
                        table = mask_old_versions(table)
                    yield conform(table), time.time() - t_wait
                    self._take_version += 1
                    self._tables_left -= 1
                    t_wait = time.time()
                    if self._tables_left <= 0:
                        return
        finally:
            stream.close()

    # ---- helpers -----------------------------------------------------------------------
    def _rollout_metrics(self, t: pa.Table) -> dict:
        rewards = t.column("reward").to_pylist()
        lens = [len(r) for r in t.column("response_ids").to_pylist()]
        status = t.column("status").to_pylist()
        span = max(t.column("t_done").to_pylist()) - min(t.column("t_dispatch").to_pylist())
        return {"rollout/reward_mean": sum(rewards) / len(rewards),
                "rollout/accuracy": sum(r >= 1 - 1e-6 for r in rewards) / len(rewards),
                "rollout/response_len": sum(lens) / len(lens), "rollout/samples": len(rewards),
                "rollout/tokens": sum(lens), "rollout/failed": status.count("failed"),
                "rollout/truncated": status.count("truncated"), "rollout/span_s": span} | _agent_metrics(t)

    @staticmethod
    def _staleness(t: pa.Table, version: int) -> dict:
        """Trained-at version - token version over trained tokens; how many rows span an update."""
        gaps, spans = [], []
        for vs, mask in zip(t.column("token_versions").to_pylist(), t.column("loss_mask").to_pylist()):
            model = [v for v, k in zip(vs, mask) if v >= 0 and k]
            gaps += [version - v for v in model]
            spans.append(max(model) - min(model) if model else 0)
        return {"staleness/mean": sum(gaps) / max(len(gaps), 1), "staleness/max": max(gaps, default=0),
                "partial_ratio": sum(s > 0 for s in spans) / max(len(spans), 1), "partial_span_max": max(spans)}

    def _pipeline_metrics(self, t: pa.Table, train_m: dict) -> dict:
        """Buffer depth, filters and how busy each resource was during this step."""
        now, wall = time.time(), time.time() - self._t_step
        self._t_step = now
        snap = ray.get(self.gate.snapshot.remote())
        busy = self._engine_stats()
        st = self.pipeline.batcher.stats
        return {"pipeline_buf_size": snap["in_flight"] + snap["buffered"], "filter_drop": st.dropped_filter,
                "stale_drop": st.dropped_stale, "dispatch_out_of_order": snap["out_of_order"],
                "samples_per_s": t.num_rows / max(wall, 1e-9), "step_wall_s": wall,
                "rollout/busy_frac": sum(b["busy_s"] for b in busy) / len(busy) / max(wall, 1e-9),
                "trainer/busy_frac": train_m.get("train/seconds", 0.0) / max(wall, 1e-9)} | self._engine_batch(busy) \
            | self.pipeline.batcher.fairness.summary()

    def _engine_stats(self) -> list[dict]:
        """Each engine's busy time this step; an engine lost with its node has none (and is not asked)."""
        lost, busy = self.nodes.waiting_for(), []
        asked = [e.pop_stats.remote() for i, e in enumerate(self.engines) if f"engine{i}" not in lost]
        for ref in asked:
            try:
                busy.append(ray.get(ref))
            except (RayActorError, ActorUnavailableError):
                continue
        return busy or [{"busy_s": 0.0}]

    @staticmethod
    def _engine_batch(stats: list[dict]) -> dict:
        """Continuous batching's figures over the engines, this step: rows decoding per step (mean, max)
        and a request's wait in the queue before it joined the running batch (mean, max)."""
        stats = [s for s in stats if s.get("decode_steps")]
        if not stats:
            return {}
        steps = sum(s["decode_steps"] for s in stats)
        return {"engine/running_rows_mean": sum(s["running_rows_mean"] * s["decode_steps"] for s in stats) / steps,
                "engine/running_rows_max": max(s["running_rows_max"] for s in stats),
                "engine/queue_wait_s_mean": sum(s["queue_wait_s_mean"] for s in stats) / len(stats),
                "engine/queue_wait_s_max": max(s["queue_wait_s_max"] for s in stats)}

    def _evaluate(self, write: bool = True, step: int | None = None) -> dict:
        c, t, step = self.cfg, time.time(), self.step if step is None else step
        if c.rollout.agent == "single_turn":
            m = evaluate(self.engines, self.reward_local, self.test, self.tok, c.eval.temperature,
                         c.rollout.max_new_tokens, c.eval.n_samples, seed=seeds.derive(c.run.seed, "eval"))
        else:   # the recipe's agent itself, on the live engines: its accuracy is what training moves
            if getattr(self, "_eval_rollout", None) is None:
                self._eval_rollout = AgentFlowRollout(_replace(c.rollout, temperature=c.eval.temperature,
                                                               seed=seeds.derive(c.run.seed, "eval")),
                                                      self.engines, None, self.model_path, self.tok_class)
            m = evaluate_agent(self._eval_rollout, self.reward_local, self.test, c.eval.n_samples)
        self.profiler.add("eval", t, time.time(), actor="engines", step=step)
        if write:
            self._emit(m, self.step, self.version)
        return m

    def _emit(self, metrics: dict, step: int, version: int) -> None:
        line = self.metrics.write(step, metrics | {"version": version})
        if self.on_step:
            self.on_step(line)

    def publish(self, version: int) -> dict:
        """After each update: the trainer's weights reach every engine, tagged with the new version.

        An engine whose process died is left out (Ray restarts it; the engine watch re-sends it
        the current version before it serves again); any other transfer failure stops the run."""
        with self._mesh_lock:
            return self.publish_end(self.mesh.publish_begin(version))

    def publish_end(self, publishing) -> dict:
        version = publishing.version
        try:
            m = self.mesh.publish_end(publishing)
        except TransferError as e:
            fatal = {n: f for n, f in e.failures.items() if n not in self.mesh.dead or n == "sender"}
            if fatal or not e.failures:
                raise
            self.log(f"weight sync v{version}: {', '.join(e.failures)} died; resent when restarted")
            m = e.metrics
        served = {n: self.mesh.served.get(n) for n in self.mesh.receivers if n not in self.mesh.dead}
        if any(v != version for v in served.values()):
            raise RuntimeError(f"weight sync: engines serve versions {served}, expected {version}")
        return {k: v for k, v in m.items() if isinstance(v, (int, float))} | {"engine_restarts": self.engine_restarts}

    @contextlib.contextmanager
    def _engine_watch(self):
        """A driver thread re-sends the current weights to an engine Ray restarted, before it serves again."""
        stop = threading.Event()
        known = {i: info.get("incarnation") for i, info in enumerate(self._engine_infos)}
        watch = threading.Thread(target=self._watch_engines, args=(stop, known), name="engine-watch", daemon=True)
        nodes = threading.Thread(target=self._watch_nodes, args=(stop,), name="node-watch", daemon=True)
        watch.start()
        nodes.start()
        try:
            yield
        finally:
            stop.set()
            watch.join(timeout=60)
            nodes.join(timeout=10)

    def _watch_engines(self, stop: threading.Event, known: dict[int, str]) -> None:
        """A restart is a new engine process: its incarnation id changed (not a cleared serving flag,
        which an ordinary in-place landing clears too), or it awaits weights (restarted during start-up,
        before start() asked its incarnation)."""
        from ray.exceptions import GetTimeoutError

        while not stop.wait(0.5):
            for i, e in enumerate(self.engines):
                try:
                    info = ray.get(e.info.remote(), timeout=30)
                except (RayActorError, ActorUnavailableError, GetTimeoutError):
                    continue                    # restarting (or gone for good): ask again next round
                incarnation = info.get("incarnation")
                if incarnation == known.get(i) and not info.get("needs_sync"):
                    continue
                with self._mesh_lock:
                    self.mesh.add_receiver(f"engine{i}", e)
                    if info["version"] < self.version:
                        self.mesh.publish(self.version)
                    else:       # restarted before the first update: the weights it loaded are the current ones
                        ray.get(e.load_weights.remote({}, self.version), timeout=60)
                known[i] = incarnation
                self.engine_restarts += 1
                self.log(f"engine{i} restarted: re-sent weights version {self.version}")
                self.nodes.back(f"engine{i}")

    def _watch_nodes(self, stop: threading.Event) -> None:
        """Its own thread: the engine watch can sit 30 s in a call to an engine whose node died."""
        while not stop.wait(1.0):
            placed = {n: p.node_id for n, p in self.mesh.parties.items()}
            if self.mesh.sender_party is not None:
                placed["trainer"] = self.mesh.sender_party.node_id
            try:
                reason = self.nodes.poll(placed)
            except Exception as e:      # noqa: BLE001 - the GCS itself unreachable: the run's own calls will say so
                self.log(f"node watch: cannot read Ray's node table ({e}); not watching nodes any more")
                return
            if reason:
                self._stop_lost()
                return

    def _stop_lost(self) -> None:
        """End the run after the step in hand: the lost engines are given up (killed for good, so
        the rollouts waiting on them fail instead of hanging) and the gate dispatches nothing more."""
        self.loop.stop.set()
        for name in self.nodes.waiting_for():
            if name.startswith("engine"):
                ray.kill(self.engines[int(name.removeprefix("engine"))], no_restart=True)
        ray.get(self.gate.close.remote())

    def checkpoint(self, untrained: set[int] = frozenset()) -> str:
        """Weights (HF), optimizer + RNGs, and the controller's clock and consumed-group set.

        Groups in flight are not saved: they were never trained, so a resumed run dispatches
        them again; the saved `done_seqs` (the settled groups: trained or dropped) make sure no
        trained or dropped group comes back. A batch the stream takes while the trainer saves is
        not settled, so it is not saved as done however the two threads interleave; `untrained`
        (the step loop's batches taken but not trained) can only confirm that."""
        def fill(tmp: Path) -> None:
            ray.get(self.trainer.save.remote(str(tmp), self.model_path, tokenizer_staged=self.tokenizer_staged))
            with self._seqs_lock:
                done = sorted(self.settled - set(untrained))
            (tmp / "controller.json").write_text(json.dumps(
                {"step": self.step, "version": self.version, "done_seqs": done}))

        return str(ckpt.write(self.run_dir / "checkpoints" / f"step_{self.step:06d}", fill))


class _StateView:
    """What a window strategy's can_collect sees, rebuilt from the gate's snapshot."""

    def __init__(self, snap: dict, B: int):
        self.groups_per_step, self.capacity = B, snap["capacity"]
        self._min = snap["min_uncompleted"]

    def min_uncompleted(self, default: int) -> int:
        return default if self._min < 0 else self._min


class EarlyStream:
    """A stream advanced to its first block on a thread of its own: iterating it starts the Ray Data
    execution (the actor pools spawn) and then waits, at the held gate, for the run to begin.
    iterate() hands the stream to its consumer: the first block (or the error), then the rest."""

    _END = object()

    def __init__(self, make: Callable[[], object]):
        self._gen, self._first, self._error = None, self._END, None
        self._lock, self._closed = threading.Lock(), False
        self._thread = threading.Thread(target=self._advance, args=(make,), name="early-stream", daemon=True)
        self._thread.start()

    def _advance(self, make) -> None:
        try:
            self._gen = make()
            self._first = next(self._gen)
        except StopIteration:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the consumer by iterate()
            self._error = e
        with self._lock:
            if self._closed and self._gen is not None:
                self._gen.close()

    def iterate(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        try:
            if self._first is not self._END:
                yield self._first
            if self._gen is not None:
                yield from self._gen
        finally:
            if self._gen is not None:
                self._gen.close()

    def close(self) -> None:
        """Not taken: the stream closes once its first block is out (the gate's close releases it)."""
        with self._lock:
            self._closed = True
            if not self._thread.is_alive() and self._gen is not None:
                self._gen.close()


def _agent_metrics(t: pa.Table) -> dict:
    """Means of what the agents reported per trajectory (a trajectory of several segment rows counts
    once): turns, tool calls, token segments (by kind), prompt-prefix reuse, history re-sent, timings."""
    if "agent_stats" not in t.column_names:
        return {}
    keys = zip(t.column("group_id").to_pylist(), t.column("sample_idx").to_pylist())
    seg = t.column("segment_stats").to_pylist() if "segment_stats" in t.column_names else [None] * t.num_rows
    first = {}
    for k, s, g in zip(keys, t.column("agent_stats").to_pylist(), seg):
        first.setdefault(k, (s, g))
    stats = [s for s, _ in first.values() if s]
    if not stats:
        return {}
    m = {f"agent/{k}": sum(s[k] or 0 for s in stats) / len(stats) for k in ("turns", "tool_calls", "segments",
                                                                             "wall_s", "gen_s")}
    m["agent/failed"] = sum(bool(s["fail"]) for s in stats)
    m["agent/rows_per_trajectory"] = t.num_rows / len(first)
    segs = [g for _, g in first.values() if g]
    if segs:
        for kind in ("main", "compaction", "subagent"):
            m[f"agent/segments_{kind}"] = sum(g[kind] or 0 for g in segs) / len(segs)
        reused, fresh = sum(g["reused_tokens"] or 0 for g in segs), sum(g["fresh_tokens"] or 0 for g in segs)
        m["agent/prefix_reuse"] = reused / max(1, reused + fresh)   # prompt tokens taken from recorded streams
        m["agent/resent_kb"] = sum(g["resent_bytes"] or 0 for g in segs) / len(segs) / 1024
    return m


def _placement(c: Config) -> Placement | None:
    """Placement groups when the recipe asks for them (a cluster); None = plain local actors."""
    if c.placement.mode == "none":
        return None
    ranks = c.megatron.world_size if c.trainer.backend == "megatron" else 1
    group = c.megatron.tensor_parallel if c.trainer.backend == "megatron" else 1
    return Placement(plan_pools(c.placement, ranks, group, c.rollout.num_engines), c.placement.timeout_s)


# rollout.engine -> (engine class, extra constructor arguments from the config)
ENGINES = {"hf": (HFEngine, lambda c, special: (c.rollout.nice, c.trainer.lora, c.rollout.engine_max_rows,
                                                 c.rollout.kv_cache_mb, special)),
           "vllm": (VLLMEngine, lambda c, special: (c.vllm, c.trainer.lora)),
           "sglang": (SGLangEngine, lambda c, special: (c.sglang, c.trainer.lora))}


def _start_engines(c: Config, model_path: str, res, placement: Placement | None,
                   special_ids: tuple[int, int] | None = None) -> list:
    """special_ids: (eos, pad) of the model's tokenizer, which an HF engine then does not load."""
    cls, extra = ENGINES[c.rollout.engine]
    if placement is not None:
        opts = placement.options("rollout")
    else:
        gpus = {"num_gpus": c.sglang.tp} if c.rollout.engine == "sglang" else {}
        opts = [{"num_cpus": res.engine_cpus, **gpus}] * c.rollout.num_engines
    return [ray.remote(cls).options(**o, max_concurrency=16, max_restarts=c.rollout.engine_restarts).remote(
        model_path, c.model.dtype, seeds.derive(c.run.seed, "engine", i), res.engine_threads, f"engine{i}",
        *extra(c, special_ids))
        for i, o in enumerate(opts)]


def _start_trainer(c: Config, model_path: str, res, placement: Placement | None):
    trainer_cfg = _replace(c.trainer, num_threads=res.trainer_threads,
                           lr_decay_steps=c.trainer.lr_decay_steps or c.run.steps)   # 0 = decay over the run
    args = (c.algorithm, c.rollout.temperature, c.rollout.max_new_tokens, c.model.dtype)
    if c.trainer.backend == "megatron":
        from stages.update.megatron.launch import launch

        opts = placement.options("trainer") if placement is not None else None
        return launch(model_path, trainer_cfg, c.algorithm, c.megatron, *args[1:], rank_options=opts,
                      num_cpus=res.trainer_cpus / c.megatron.world_size)
    opts = placement.options("trainer")[0] if placement is not None else {"num_cpus": res.trainer_cpus}
    return ray.remote(TorchTrainer).options(**opts).remote(model_path, trainer_cfg, *args)


def _replace(dc, **kw):
    import dataclasses

    return dataclasses.replace(dc, **kw)


def run(cfg: Config, run_dir: str | Path, rows: list[dict] | None = None, on_step=None, log=print) -> dict:
    ctl = Controller(cfg, run_dir, rows=rows, on_step=on_step, log=log)
    try:
        return ctl.run()
    finally:
        ctl.stop()


@contextlib.contextmanager
def _interrupts(stop: threading.Event, announce: Callable[[int], None]):
    """SIGINT / SIGTERM end the run after the step in hand (the caller checkpoints); a second one
    exits at once. Yields the signals received. Outside the main thread signals stay as they are.

    The second is counted by a thread of its own, off the signal wakeup fd (a byte per signal): a
    Python handler runs in the main thread between bytecodes, and the main thread sits in C calls
    (ray.get looks for signals once a second, Ray's shutdown retries EINTR), where two signals make one
    call of it. After a stop the count goes on through what follows (the checkpoint, Ray's shutdown in
    the CLI), unless the caller had a SIGINT handler of its own: then everything is put back."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum, _frame):
        got.append(signum)
        stop.set()
        announce(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    r, w = os.pipe()
    os.set_blocking(w, False)
    wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    threading.Thread(target=_exit_on_second, args=(r,), name="second-signal", daemon=True).start()
    try:
        yield got
    finally:
        if not (got and previous[signal.SIGINT] is signal.default_int_handler):
            signal.set_wakeup_fd(wakeup)
            os.close(w)             # the thread reads the end and stops
            for s, h in previous.items():
                signal.signal(s, h)


def _exit_on_second(fd: int) -> None:
    seen = 0
    while data := os.read(fd, 64):
        for signum in data:
            seen += signum in (signal.SIGINT, signal.SIGTERM)
            if seen == 2:
                os._exit(128 + signum)      # the user insists: Ray's raylet reaps this driver's actors
    os.close(fd)
