"""The single controller: start the actors and the pipeline (source -> rollout -> [teacher scoring] ->
reward), evaluate, run the step loop (pipeline/loop.py), evaluate again, checkpoint, stop.

The driver holds no weights. It keeps the version clock, writes the run directory (config.yaml,
metrics.jsonl, rollouts/, checkpoints/) and evaluates. What can go wrong while it trains (a
signal, a restarted engine, a lost node) is pipeline/faults.py's.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import signal
import tempfile
import time
import weakref
from pathlib import Path
from typing import Callable

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from pipeline import checkpoint as ckpt
from pipeline import rundir, seeds
from pipeline.builder import Pipeline, Stage, check_lora, start_actors
from pipeline.config import Config, check_names, dump_config, to_dict
from pipeline.evaluate import Evaluator, load_test
from pipeline.faults import Faults, interrupts
from pipeline.loop import Batch, StepLoop
from pipeline.metrics import engine_metrics
from pipeline.profile import Profiler
from pipeline.recorder import Recorder
from pipeline.trackers import open_metrics
from pipeline.window import Window, capacity, on_actor
from stages.agentflow.rollout import AgentFlowRollout, load_agent
from stages.model import load_tokenizer, resolve_model_path
from stages.prompts import PromptSource
from stages.reward import Reward
from stages.schema import step_metrics
from stages.teacher import TeacherScoring, check_teachers, teacher_metrics
from stages.tokenizer import stage_tokenizer, tokenizer_class_of
from transfer import TransferError

# A stream chunk is a new Ray Data execution whose actor pools start afresh (seconds): chunks hold
# up to CHUNK_BYTES of prompt rows (memory holds a chunk's prompt blocks, not the run's), between
# CHUNK_STEPS_MIN and CHUNK_STEPS_MAX steps.
CHUNK_BYTES = 64 * 2**20
CHUNK_STEPS_MIN, CHUNK_STEPS_MAX = 50, 2000


def chunk_groups(c: Config, prompts, steps: int) -> int:
    """Groups per stream chunk, for `steps` steps to go over the `prompts` table."""
    B = c.batcher.groups_per_step
    step_bytes = B * c.rollout.n_samples * prompts.nbytes / max(prompts.num_rows, 1)
    chunk = min(CHUNK_STEPS_MAX, max(CHUNK_STEPS_MIN, int(CHUNK_BYTES // max(step_bytes, 1.0))))
    return min(chunk, steps) * B + capacity(B, c.rollout.stale_steps)


class Controller:
    def __init__(self, cfg: Config, run_dir: str | Path, rows: list[dict] | None = None,
                 on_step: Callable[[dict], None] | None = None, log: Callable[[str], None] = print):
        """Everything that can be wrong is found here, before an actor exists."""
        cfg = seeds.resolve(cfg)    # a Config built in code, not by load_config, gets its seeds here
        check_names(cfg)
        load_agent(cfg.agent.name, cfg.agent.preload)
        self.cfg, self.run_dir, self.on_step, self.log = cfg, Path(run_dir), on_step, log
        self.model_path = resolve_model_path(cfg.model, log=log, check_tokenizer=False)   # loaded below
        check_lora(cfg, self.model_path)
        self.resume = ckpt.resolve(cfg.run.resume_from, self.run_dir, log) if cfg.run.resume_from else None
        self.state = {"step": 0, "version": 0, "done_seqs": []}      # the clock and the settled groups
        if self.resume:
            self.state, self.model_path = ckpt.resume_state(self.resume, self.model_path, cfg.trainer.lora.enabled)
        # The driver's one tokenizer load: its class for the workers (loaded without torch), the special
        # ids HF engines need, what checkpoints copy, and evaluation's encoding.
        tok = load_tokenizer(self.model_path)
        self.tok_class, self.special_ids = tokenizer_class_of(tok), (tok.eos_token_id, tok.pad_token_id)
        self.tokenizer_staged = stage_tokenizer(tok, tempfile.mkdtemp(prefix="loongsage-tokenizer-"))
        self._unstage = weakref.finalize(self, shutil.rmtree, self.tokenizer_staged, True)
        self.source = PromptSource(cfg.data, cfg.rollout.n_samples, rows=rows)
        test = load_test(cfg, cfg.eval.num_prompts)
        self.tok = tok if test is not None else None     # held only for evaluation (~45 MB at 151k tokens)
        self.evaluator = Evaluator(cfg, self.model_path, tok, self.tok_class, test) if test is not None else None
        if cfg.teacher.enabled:    # teacher dirs, tokenizers, budget and routes
            check_teachers(cfg.teacher, self.model_path, set(self.source.table.column("data_source").to_pylist()))
        self.actors = self.pipeline = self.loop = None

    def start(self) -> None:
        """The actors (builder.start_actors) and the default pipeline, which a caller may swap before run()."""
        c = self.cfg
        self.actors = a = start_actors(c, self.model_path, self.special_ids, self.state["version"],
                                       str(self.resume or ""), self.log)
        self.engines, self.trainer, self.mesh = a.engines, a.trainer, a.mesh
        self.pipeline = Pipeline([
            self.source,
            Stage(AgentFlowRollout, a.engines, a.gate, self.model_path, self.tok_class, workers=c.rollout.num_workers,
                  num_cpus=a.res.worker_cpus, **{s: getattr(c, s) for s in AgentFlowRollout.sections}),
            *([Stage(TeacherScoring, c.teacher, self.model_path, a.res.engine_threads, workers=c.teacher.workers,
                     num_cpus=a.res.worker_cpus)] if c.teacher.enabled else []),
            Stage(Reward, c.reward, self.model_path, c.rollout.nice, self.tok_class, num_cpus=a.res.worker_cpus)])

    def stop(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        if self.actors is not None:
            self.actors.stop()
            self.actors = None
        self._unstage()

    def run(self) -> dict:
        """Evaluate, run the step loop, evaluate again, checkpoint; returns the run's summary."""
        c = self.cfg
        with rundir.locked(self.run_dir, self.log):      # the CLI holds it already; a Python caller takes it here
            dump_config(c, self.run_dir / "config.yaml")
            self.recorder = Recorder(self.run_dir, c.rollout.n_samples)
            # time_s counts from here
            with contextlib.closing(open_metrics(self.run_dir, c.trackers, to_dict(c), self.log)) as self.metrics:
                if self.pipeline is None:
                    self.start()
                routes = "\n".join(f"{n}: {r.transport} ({r.reason})" for n, r in self.mesh.plan().items())
                (self.run_dir / "topology.txt").write_text(self.mesh.topology_table() + "\n\n" + routes + "\n")
                with contextlib.closing(Profiler(self.run_dir)) as self.profiler:
                    self.pipeline.profiler = self.profiler
                    return self._run()

    def _run(self) -> dict:
        c, a = self.cfg, self.actors
        gpb = c.rollout.groups_per_batch or c.batcher.groups_per_step
        window = Window(c.batcher, c.rollout.n_samples, c.rollout.stale_steps, c.rollout.window, on_actor(a.gate),
                        self.state["done_seqs"], c.rollout.partial_mask_old)
        window.read(window.chunks(lambda start, n, skip: self.pipeline.stream(start, n, gpb, skip),
                                  chunk_groups(c, self.source.table, c.run.steps - self.state["step"])))
        self.faults = Faults(a, lambda: self.loop.version, self._stop_lost, c.run.node_wait_s, self.log)
        self.loop = loop = StepLoop(
            window, a.trainer.train_step.remote, self._record, c.run.steps, step=self.state["step"],
            version=self.state["version"], publish=self.faults.publish, checkpoint=self.checkpoint,
            lock=self.faults.lock, span=self.profiler.add, queue_next=c.rollout.stale_steps >= 1,
            checkpoint_every=c.run.checkpoint_every)
        try:
            with self.faults, interrupts(loop.stop, self._on_interrupt) as signals:
                # the stream opens before the step-0 evaluation, its dispatch held at the gate: its actor
                # pools spawn and its first blocks are cut while the engines evaluate
                loop.start()
                initial = self._evaluate() if self.evaluator else {}
                window.gate("open")
                self._t_step = time.time()
                try:
                    loop.run()
                except (RayActorError, TransferError):    # the trainer's host lost: stop as for any lost node
                    if not self.faults.trainer_lost():
                        raise
                return self._summary(initial, signals)
        finally:
            loop.close()

    def _summary(self, initial: dict, signals: list[int]) -> dict:
        c, loop, res = self.cfg, self.loop, self.actors.res
        summary = {"steps": loop.step, "version": loop.version, "initial": initial, "run_dir": str(self.run_dir),
                   "threads": {"engines": [i.get("threads", res.engine_threads) for i in self.actors.infos[:-1]],
                               "trainer": res.trainer_threads}}     # an HF engine may time 1 thread as faster
        if signals:       # no final eval: the user asked to stop; the checkpoint resumes it
            return summary | {"final": {}, "interrupted": signal.Signals(signals[0]).name,
                              "resume_from": self.checkpoint()}
        if self.faults.reason:      # a node was lost for good: the same stop, unless the trainer went with it
            # (its state is gone: the newest checkpoint on disk resumes)
            path = (str(ckpt.newest_intact(self.run_dir / "checkpoints") or "") if "trainer" in self.faults.reason
                    else self.checkpoint())
            return summary | {"final": {}, "interrupted": "NODE_LOST", "lost": self.faults.reason, "resume_from": path}
        if loop.step < c.run.steps:
            self.log(f"the data stream ended after {loop.step} of {c.run.steps} steps "
                     f"(groups: {loop.window.fairness.groups})")
        loop.close()        # the engines serve the final evaluation alone
        final = self._evaluate() if self.evaluator else {}
        self.checkpoint()
        return summary | {"final": final}

    def _on_interrupt(self, signum: int) -> None:
        self.log(f"{signal.Signals(signum).name}: stopping after step {self.loop.last_step()}, then writing a "
                 f"checkpoint (press Ctrl-C again to exit at once)")

    def _stop_lost(self) -> None:
        """A node was lost for good: the run ends after the step in hand, dispatching nothing more."""
        self.loop.stop.set()
        self.loop.window.close()

    def _record(self, step: int, batch: Batch, line: dict) -> None:
        """A trained step's bookkeeping: rollouts, metrics, periodic eval. Runs while the trainer works on
        the next step (the engines serve this step's weights meanwhile)."""
        c, t = self.cfg, batch.table
        self.recorder.write(step, t)
        now = time.time()
        wall, self._t_step = now - self._t_step, now
        line |= step_metrics(t, batch.version) | teacher_metrics(t) | self.loop.window.metrics() | \
            engine_metrics(self._engine_stats(), wall) | {
                "samples_per_s": t.num_rows / max(wall, 1e-9), "step_wall_s": wall,
                "trainer/busy_frac": line.get("train/seconds", 0.0) / max(wall, 1e-9)}
        if self.evaluator and c.eval.every and step % c.eval.every == 0 and step < c.run.steps:
            line |= self._evaluate(step)
        self._emit(line, step, batch.version + 1)

    def _engine_stats(self) -> list[dict]:
        """Each engine's busy time this step; one lost with its node is not asked, one restarting has none."""
        lost, stats = self.faults.waiting_for(), []
        for ref in [e.pop_stats.remote() for i, e in enumerate(self.engines) if f"engine{i}" not in lost]:
            with contextlib.suppress(RayActorError, ActorUnavailableError):
                stats.append(ray.get(ref))
        return stats

    def _evaluate(self, step: int | None = None) -> dict:
        """Held-out evaluation; its own metrics line unless it is a step's (`step`)."""
        t = time.time()
        m = self.evaluator(self.engines)
        self.profiler.add("eval", t, time.time(), actor="engines", step=self.loop.step if step is None else step)
        if step is None:
            self._emit(m, self.loop.step, self.loop.version)
        return m

    def _emit(self, metrics: dict, step: int, version: int) -> None:
        line = self.metrics.write(step, metrics | {"version": version})
        if self.on_step:
            self.on_step(line)

    def checkpoint(self) -> str:
        """Weights (HF), optimizer + RNGs, and controller.json: the clock and the settled groups (trained or
        dropped). A group in flight, or taken but not trained, is not settled: a resumed run streams it again."""
        step, version = self.loop.step, self.loop.version

        def fill(tmp: Path) -> None:
            ray.get(self.trainer.save.remote(str(tmp), self.model_path, tokenizer_staged=self.tokenizer_staged))
            (tmp / "controller.json").write_text(json.dumps(
                {"step": step, "version": version, "done_seqs": self.loop.window.saved()}))

        return str(ckpt.write(self.run_dir / "checkpoints" / f"step_{step:06d}", fill))


def run(cfg: Config, run_dir: str | Path, rows: list[dict] | None = None, on_step=None, log=print) -> dict:
    ctl = Controller(cfg, run_dir, rows=rows, on_step=on_step, log=log)
    try:
        return ctl.run()
    finally:
        ctl.stop()
