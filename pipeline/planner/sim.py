"""One run, simulated with simpy, through the project's own window code.

    dispatcher  blocks of groups in stream order; a block takes a free rollout worker, then each
                of its groups waits until the real strategy's can_dispatch allows it and is
                dispatched by the real Gate (pipeline/window.py), under the gate's version
    samples     per sample, its turns on its group's engine (group % engines, as Affinity does):
                call latency, prefill, decode; tool latency between turns
    engines     continuous batching, decode iterations from EngineModel; at a weight sync they
                stop, land the new version, and continue (partial=interrupt: a sample's later
                tokens carry the new version) or first drain (partial=wait)
    block done  reward, hand-off, then the real Window (pipeline/window.py) gets the groups and
                tells the gate they were collected
    taker       as pipeline/loop.py's Prefetch: takes each step's table at the version it will
                be trained at, one waiting at most
    trainer     as the StepLoop: wait for a batch, update, version + 1, sync, window.consumed

Everything the window decides (who may be dispatched, collected, trained, or dropped as too
stale) is decided by the real objects; the simulation only supplies time. Its record is in
the profiler's span schema, so spans.plot_gantt / bubbles read it as they read a real run.
"""
from __future__ import annotations

import asyncio
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import simpy

from pipeline.planner.model import Costs, EngineModel
from pipeline.window import Gate, Window, in_loop
from stages.batcher_config import BatcherConfig

CHUNK_TOKENS = 256      # a decode interval is re-planned at least every this many tokens (context grows)


@dataclass(frozen=True)
class Recipe:
    """What the simulation reads of a LoongSage config."""
    groups_per_step: int
    n_samples: int
    steps: int
    stale_steps: float = 0.0
    window: str = "no-window"
    groups_per_batch: int = 0
    num_workers: int = 1
    partial: str = "interrupt"
    stale_policy: str = "drop"

    @classmethod
    def of(cls, cfg, steps: int) -> "Recipe":
        r = cfg.rollout
        return cls(cfg.batcher.groups_per_step, r.n_samples, steps, r.stale_steps, r.window,
                   r.groups_per_batch, r.num_workers, r.partial, cfg.batcher.stale_policy)


@dataclass
class _Seq:
    left: float          # tokens still to decode in this turn
    ctx: float           # context tokens held (prompt + generated so far)
    prefill: float       # tokens to prefill before decoding
    done: simpy.Event
    by_version: Counter = field(default_factory=Counter)


class EngineSim:
    def __init__(self, env: simpy.Environment, name: str, m: EngineModel):
        self.env, self.name, self.m = env, name, m
        self.running: list[_Seq] = []
        self.queue: deque[_Seq] = deque()
        self.version = 0
        self.paused = self.holding = False
        self.wake = env.event()
        self.drained = env.event()
        self.busy: list[list[float]] = []      # merged [start, end] intervals of prefill or decode
        env.process(self._run())

    def submit(self, ctx: float, prefill: float, tokens: float) -> simpy.Event:
        seq = _Seq(float(tokens), float(ctx), float(prefill), self.env.event())
        self.queue.append(seq)
        self._poke()
        return seq.done

    def _poke(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    def pause(self, drain: bool) -> simpy.Event:
        """Stop admitting; with `drain` the event fires once the running sequences finished, else now."""
        self.holding = True
        if not drain or not self.running:
            self.paused = True
            ev = self.env.event()
            ev.succeed()
        else:
            self.drained = ev = self.env.event()
        self._poke()
        return ev

    def resume(self, version: int) -> None:
        self.version = version
        self.paused = self.holding = False
        self._poke()

    def _mark(self, t0: float, t1: float) -> None:
        if t1 <= t0:
            return
        if self.busy and self.busy[-1][1] >= t0 - 1e-12:
            self.busy[-1][1] = t1
        else:
            self.busy.append([t0, t1])

    def _admit(self) -> list[_Seq]:
        m, out = self.m, []
        held = sum(s.ctx for s in self.running)
        while self.queue and not self.holding:
            s = self.queue[0]
            if m.max_running and len(self.running) + len(out) >= m.max_running:
                break
            if m.kv_tokens and (self.running or out) and held + s.ctx + s.left > m.kv_tokens:
                break
            out.append(self.queue.popleft())
            held += s.ctx
        return out

    def _run(self):
        env, m = self.env, self.m
        while True:
            if self.wake.triggered:
                self.wake = env.event()
            if self.holding and not self.paused and not self.running:
                self.paused = True
                if not self.drained.triggered:
                    self.drained.succeed()
            new = [] if self.paused else self._admit()
            if new:
                t0 = env.now
                dt = sum(s.prefill for s in new) * m.prefill_per_token_s
                if dt > 0:
                    yield env.timeout(dt)
                self._mark(t0, env.now)
                self.running.extend(new)
                continue
            if self.paused or not self.running:
                yield self.wake
                continue
            b, ctx = len(self.running), sum(s.ctx for s in self.running)
            it = m.iter_s(b, ctx)
            k = min(min(s.left for s in self.running), CHUNK_TOKENS)
            t0 = env.now
            timer = env.timeout(k * it)
            yield timer | self.wake
            tokens = k if timer.processed or it <= 0 else min(k, (env.now - t0) / it)
            self._mark(t0, env.now)
            still = []
            for s in self.running:
                s.left -= tokens
                s.ctx += tokens
                s.by_version[self.version] += tokens
                if s.left <= 1e-9:
                    s.done.succeed(s.by_version)
                else:
                    still.append(s)
            self.running = still


@dataclass
class SampleRecord:
    group: int
    step: int = 0                  # the step that trained it (0: never trained)
    prompt_tokens: int = 0
    response_tokens: int = 0
    by_version: Counter = field(default_factory=Counter)
    t_dispatch: float = 0.0
    t_done: float = 0.0
    masked: frozenset = frozenset()   # versions whose tokens the batcher took out of the loss (stale_policy mask)


class Simulation:
    def __init__(self, recipe: Recipe, costs: Costs, workload, seed: int = 0):
        self.r, self.c, self.workload = recipe, costs, workload
        self.rng = np.random.default_rng(seed)
        self.env = simpy.Environment()
        self._loop = asyncio.new_event_loop()
        self.gate = Gate(recipe.groups_per_step, recipe.stale_steps, recipe.window)
        self.window = Window(BatcherConfig(recipe.groups_per_step, stale_policy=recipe.stale_policy),
                             recipe.n_samples, recipe.stale_steps, recipe.window, in_loop(self.gate, self._loop))
        self.engines = [EngineSim(self.env, f"engine{i}", costs.engine) for i in range(max(1, costs.layout.engines))]
        self.workers = simpy.Store(self.env)
        for w in range(recipe.num_workers):
            self.workers.put(w)
        self.rewarders = simpy.Resource(self.env, capacity=max(1, costs.stages.reward_workers))
        self.batches = simpy.Store(self.env, capacity=1)
        self.moved = self.env.event()          # the window moved (dispatch may go on)
        self.collected_ev = self.env.event()   # groups reached the batcher (a table may be taken)
        self.version = 0
        self.take_version = 0
        self.samples: dict[int, list[SampleRecord]] = {}
        self.spans: list[dict] = []
        self.dropped: list[int] = []
        self.trained: list[list[int]] = []     # each step's groups
        self.finished = self.env.event()

    def _moved(self) -> None:
        ev, self.moved = self.moved, self.env.event()
        ev.succeed()

    def _span(self, stage: str, actor: str, start: float, end: float, step: int = -1, rows: int = 0,
              tokens: int = 0, batch_id: int = -1) -> None:
        self.spans.append({"stage": stage, "actor": actor, "step": step, "batch_id": batch_id, "rows_in": rows,
                           "rows_out": rows, "tokens": tokens, "start": start, "end": end, "wait_s": 0.0,
                           "overhead_s": 0.0})

    def _dispatcher(self):
        gpb = self.r.groups_per_batch or self.r.groups_per_step
        seq = 0
        while True:
            worker = yield self.workers.get()
            block = list(range(seq, seq + gpb))
            seq += gpb
            for q in block:
                while not self.gate.strategy.can_dispatch(self.gate.s, q):
                    yield self.moved
                self._loop.run_until_complete(self.gate.acquire([q]))   # the real gate, at once: can_dispatch held
            self.env.process(self._block(block, worker))

    def _block(self, block: list[int], worker: int):
        env, st = self.env, self.c.stages
        if st.dispatch_s:
            yield env.timeout(st.dispatch_s)
        t0 = env.now
        procs = []
        for g in block:
            engine = self.engines[g % len(self.engines)]
            recs = self.samples[g] = []
            for spec in self.workload.group(self.rng, self.r.n_samples):
                rec = SampleRecord(g, prompt_tokens=spec.prompt_tokens, response_tokens=spec.response_tokens)
                recs.append(rec)
                procs.append(env.process(self._sample(engine, spec, rec)))
        yield env.all_of(procs)
        t1 = env.now
        self.workers.put(worker)
        rows = len(block) * self.r.n_samples
        self._span("AgentFlowRollout", f"worker{worker}", t0, t1, rows=rows, batch_id=block[0],
                   tokens=sum(r.response_tokens for g in block for r in self.samples[g]))
        with self.rewarders.request() as req:
            yield req
            t2 = env.now
            yield env.timeout(st.reward_fixed_s + st.reward_per_row_s * rows)
            self._span("Reward", "reward", t2, env.now, rows=rows, batch_id=block[0])
        if st.handoff_s:
            yield env.timeout(st.handoff_s)
        if self.window.feed(self._block_table(block)):
            self._moved()
            ev, self.collected_ev = self.collected_ev, self.env.event()
            ev.succeed()

    def _block_table(self, block: list[int]) -> pa.Table:
        """What the batcher reads of a block's rows: the distinct versions of each sample's tokens stand
        for its token_versions (the staleness bound depends only on the oldest)."""
        recs = [r for g in block for r in self.samples[g]]
        n = self.r.n_samples
        versions = [sorted(v for v, k in r.by_version.items() if k > 0) for r in recs]
        return pa.table({"group_id": pa.array([r.group for r in recs], pa.int64()),
                         "sample_idx": pa.array([i % n for i in range(len(recs))], pa.int64()),
                         "status": ["completed"] * len(recs), "reward": pa.array([0.0] * len(recs)),
                         "token_versions": pa.array(versions, pa.list_(pa.int64())),
                         # as real rows carry one: stale_policy=mask rewrites it, and every block's
                         # table must keep one schema
                         "loss_mask": pa.array([[1] * len(v) for v in versions], pa.list_(pa.int8()))})

    def _sample(self, engine: EngineSim, spec, rec: SampleRecord):
        env, m = self.env, self.c.engine
        rec.t_dispatch = env.now
        ctx = new = spec.prompt_tokens       # new: context the engine has not seen (prefilled next turn)
        for i, (gen, tool_tokens, tool_s) in enumerate(spec.turns):
            if m.call_s:
                yield env.timeout(m.call_s)
            if gen > 0:
                by_version = yield engine.submit(ctx, new if m.prefix_cache else ctx, gen)
                rec.by_version.update(by_version)
            ctx += gen
            new = 0
            if i < len(spec.turns) - 1:
                if tool_s:
                    yield env.timeout(tool_s)
                ctx += tool_tokens
                new = tool_tokens
        rec.t_done = env.now

    def _taker(self):
        while True:
            table, gone = self.window.take(self.take_version)
            if gone:
                self.dropped += gone
                self._moved()
            if table is None:
                yield self.collected_ev
                continue
            self._note_masked(table)
            groups = sorted(set(table.column("group_id").to_pylist()))
            self.take_version += 1
            yield self.batches.put(groups)

    def _note_masked(self, table: pa.Table) -> None:
        """stale_policy=mask took some versions' tokens out of the loss: they are context, not trained
        tokens, in the staleness figures (as the real run's staleness/* counts only loss-mask tokens)."""
        cols = [table.column(k).to_pylist() for k in ("group_id", "sample_idx", "token_versions", "loss_mask")]
        for g, i, vs, ks in zip(*cols):
            if not all(ks):
                self.samples[g][i].masked = frozenset(v for v, k in zip(vs, ks) if not k)

    def _trainer(self):
        env, c = self.env, self.c
        for step in range(1, self.r.steps + 1):
            t0 = env.now
            groups = yield self.batches.get()
            self._span("batcher", "driver", t0, env.now, step=step, rows=len(groups) * self.r.n_samples)
            self.trained.append(groups)
            recs = [r for g in groups for r in self.samples[g]]
            for r in recs:
                r.step = step
            if c.layout.colocate:       # the same GPUs: generation stops for the update and the sync
                yield env.all_of([e.pause(drain=False) for e in self.engines])
            t1 = env.now
            resp = sum(r.response_tokens for r in recs)
            yield env.timeout(c.trainer.step_s(sum(r.prompt_tokens for r in recs), resp))
            self._span("update", "trainer", t1, env.now, step=step, rows=len(recs), tokens=resp)
            self.version += 1
            t2 = env.now
            drain = self.r.partial == "wait" and not c.layout.colocate
            yield env.all_of([e.pause(drain) for e in self.engines])
            yield env.timeout(c.sync.seconds)
            for e in self.engines:
                e.resume(self.version)
            self._span("sync", "trainer", t2, env.now, step=step)
            self.window.consumed(groups, self.version)
            self._moved()
        self.finished.succeed()

    def run(self) -> "SimResult":
        for p in (self._dispatcher(), self._taker(), self._trainer()):
            self.env.process(p)
        try:
            asyncio.get_running_loop()
        except RuntimeError:                   # no loop here: the gate's coroutines run on ours
            self.env.run(until=self.finished)
        else:                                  # inside a running loop (a notebook's kernel): the same
            with ThreadPoolExecutor(1) as pool:   # run on a thread of its own, where ours may run
                pool.submit(self.env.run, until=self.finished).result()
        self._loop.close()
        for e in self.engines:
            for s, t in e.busy:
                self._span("generate", e.name, s, t)
        return SimResult(self)


class SimResult:
    """The simulated run's spans (profile schema) and per-sample records."""

    def __init__(self, sim: Simulation):
        import pandas as pd

        self.spans = pd.DataFrame(sim.spans).sort_values(["start", "end"], kind="stable").reset_index(drop=True)
        self.spans["duration_s"] = self.spans["end"] - self.spans["start"]
        self.spans["t"] = self.spans["start"] - self.spans["start"].min()
        self.samples = [r for recs in sim.samples.values() for r in recs]
        self.dropped, self.trained = list(sim.dropped), list(sim.trained)
        self.engine_busy = {e.name: [tuple(b) for b in e.busy] for e in sim.engines}

    def rollouts(self):
        """Trained samples as spans.bubbles reads a recording: step, t_dispatch, t_done."""
        import pandas as pd

        return pd.DataFrame([{"step": r.step, "t_dispatch": r.t_dispatch, "t_done": r.t_done}
                             for r in self.samples if r.step > 0])

    def staleness(self) -> tuple[np.ndarray, np.ndarray]:
        """Per (staleness value): trained tokens. Trained at version step - 1."""
        c: Counter = Counter()
        for r in self.samples:
            if r.step > 0:
                for v, k in r.by_version.items():
                    if v not in r.masked:
                        c[r.step - 1 - v] += k
        keys = np.array(sorted(c), dtype=np.int64)
        return keys, np.array([c[k] for k in keys], dtype=float)
