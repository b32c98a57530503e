"""Costs from a real run directory: its profile spans, its recording and its config.

    trainer   update span seconds against the step's response tokens (least squares; a fixed
              part only when the tokens vary enough to tell it apart, else proportional)
    sync      mean sync span seconds (a fixed cost at this model size)
    reward    Reward span seconds per row
    engine    per rollout block: generation time (its rows' t_dispatch .. t_done) against its
              decode waves (turn k of every sample decodes together; a wave takes as many
              iterations as its longest turn): seconds = waves * call_s + iterations * iter_s
    handoff   a block's generation end -> its Reward span, and Reward end -> the driver taking
              the batch (steps where the driver was waiting for that block)
    dispatch  the gate letting a block go (the previous sync's end, or its worker's previous
              block's end) -> its first t_dispatch

Step 1 (start-up) is left out. Every figure is a median or a fit over the steps that remain.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import ConfigError, load_config
from pipeline.planner.model import Costs, EngineModel, Layout, PlanError, StageCosts, SyncModel, TrainerModel
from pipeline.planner.spans import ProfileError, load_spans
from pipeline.planner.workload import RecordedLengths, outside_generation_s, turns_of
from pipeline.recorder import Recording, RecordingError


@dataclass
class Calibration:
    costs: Costs
    lengths: RecordedLengths


def _fit(x, y) -> tuple[float, float]:
    """(intercept, slope) >= 0 of y ~ a + b x; proportional (0, sum y / sum x) when x barely varies
    or the fit would go negative."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) >= 3 and x.std() > 0.05 * max(abs(x.mean()), 1e-12):
        b, a = np.polyfit(x, y, 1)
        if a >= 0 and b >= 0:
            return float(a), float(b)
    return 0.0, float(y.sum() / max(x.sum(), 1e-12))


def _median(v) -> float:
    v = [x for x in v if np.isfinite(x)]
    return float(np.median(v)) if v else 0.0


def calibrate(run_dir: str | Path, skip: int = 1) -> Calibration:
    run = Path(run_dir)
    if not (run / "profile").is_dir():
        raise PlanError(f"--calibrate {run}: no profile directory {run / 'profile'} (a run directory written by "
                        f"`loongsage run` has one)")
    if not (run / "config.yaml").is_file():
        raise PlanError(f"--calibrate {run}: no config.yaml (not a run directory)")
    try:
        cfg = load_config(str(run / "config.yaml"), [])
        spans = load_spans(run)
        rec = Recording.open(run / "rollouts")
        cols = ["group_id", "loss_mask", "t_dispatch", "t_done"]
        if "agent_stats" in rec.read_step(rec.steps[0]).column_names:
            cols.append("agent_stats")
        rows = rec.read(columns=cols).to_pandas()
    except (ConfigError, ProfileError, RecordingError, ValueError) as e:
        raise PlanError(f"--calibrate {run}: {e}") from e
    steady = spans[spans["step"] > skip]
    if not len(steady):
        raise PlanError(f"--calibrate {run}: the profile has no step after step {skip} to calibrate on")

    upd = steady[steady["stage"] == "update"]
    fixed, per_token = _fit(upd["tokens"], upd["duration_s"])
    trainer = TrainerModel(fixed, per_token, source=f"{run}: {len(upd)} update spans")
    sync = SyncModel(_median(steady.loc[steady["stage"] == "sync", "duration_s"]), route="measured")
    rew = spans[spans["stage"] == "Reward"]
    r_fixed, r_row = _fit(rew["rows_in"], rew["duration_s"])

    gpb = cfg.rollout.groups_per_batch or cfg.batcher.groups_per_step
    rows = rows.assign(block=rows["group_id"] // gpb)
    waves, iters, gen_s, blocks = [], [], [], {}
    for blk, g in rows.groupby("block"):
        turns = [turns_of(list(m)) for m in g["loss_mask"]]
        depth = max(len(t) for t in turns)
        wave_iters = [max((t[k][0] for t in turns if len(t) > k), default=0) for k in range(depth)]
        t0, t1 = float(g["t_dispatch"].min()), float(g["t_done"].max())
        blocks[int(blk)] = (t0, t1, int(g["group_id"].min()))
        waves.append(depth)
        iters.append(sum(wave_iters))
        gen_s.append(t1 - t0 - _outside_generation(g))
    steady_blocks = slice(1, None) if len(gen_s) > 2 else slice(None)      # the first block waits for start-up
    waves, iters, gen_s = np.array(waves[steady_blocks]), np.array(iters[steady_blocks]), np.array(gen_s[steady_blocks])
    call_s, iter_s = _fit_engine(waves, iters, gen_s)
    engine = EngineModel(base_s=iter_s, call_s=call_s, prefix_cache=False)

    handoff, dispatch = _latencies(spans, blocks, cfg.batcher.groups_per_step, gpb, skip)
    stages = StageCosts(r_fixed, r_row, handoff, dispatch, reward_workers=1)
    costs = Costs(engine, trainer, sync, stages, Layout(engines=cfg.engine.count, description="this run"),
                  sources={k: f"calibrated from {run}" for k in ("engine", "trainer", "sync", "stages")})
    return Calibration(costs, RecordedLengths.open(run / "rollouts"))


def _outside_generation(block) -> float:
    """An agent block's seconds outside generation (tool calls, the agent's own work) on its critical
    path: those of the sample that finished last. The simulation adds that time in the gaps between
    turns (workload.agent_turns), so the engine is fitted on the rest."""
    last = block.loc[block["t_done"].idxmax(), "agent_stats"] if "agent_stats" in block.columns else None
    return outside_generation_s(last) if isinstance(last, dict) else 0.0


def _fit_engine(waves, iters, gen_s) -> tuple[float, float]:
    """gen_s ~ waves * call_s + iters * iter_s (both >= 0)."""
    if len(gen_s) == 0:
        raise PlanError("no rollout blocks to calibrate the engine on")
    A = np.stack([waves, iters], axis=1).astype(float)
    if len(gen_s) >= 3 and iters.std() > 0.05 * iters.mean():
        (c, it), *_ = np.linalg.lstsq(A, gen_s, rcond=None)
        if c >= 0 and it >= 0:
            return float(c), float(it)
    return 0.0, float(gen_s.sum() / max(iters.sum(), 1e-12))


def _latencies(spans, blocks: dict, B: int, gpb: int, skip: int) -> tuple[float, float]:
    rew = spans[spans["stage"] == "Reward"].set_index("batch_id")
    to_reward, reward_end = [], {}
    for b, (_, t1, first) in blocks.items():
        if first in rew.index:
            r = rew.loc[[first]].iloc[0]
            to_reward.append(float(r["start"]) - t1)
            reward_end[b] = float(r["end"])
    taken = spans[(spans["stage"] == "batcher") & (spans["step"] > skip)]
    to_batch = []
    for _, s in taken.iterrows():     # the step's last block, in a sync run: the one the driver waited for
        last = (int(s["step"]) * B - 1) // gpb
        if last in reward_end and s["start"] < reward_end[last] < s["end"]:
            to_batch.append(float(s["end"]) - reward_end[last])
    syncs = spans[spans["stage"] == "sync"]["end"].sort_values().to_numpy()
    order = sorted(blocks)
    gaps = []
    for prev, b in zip(order, order[1:]):
        t0 = blocks[b][0]
        before = syncs[syncs < t0]
        free = max(blocks[prev][1], before[-1] if len(before) else -np.inf)
        if t0 > free:
            gaps.append(t0 - free)
    return max(0.0, _median(to_reward)) + max(0.0, _median(to_batch)), _median(gaps)
