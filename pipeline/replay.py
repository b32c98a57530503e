"""Replay: train from a recorded rollouts/ dataset instead of generating (docs/replay-and-profiling.md).

The recording is the source (`RecordedSource`); the rest is a run's path: the window (its staleness bound off)
-> the TorchTrainer actor; no engines, weight sync or evaluation. With the recording's config a synchronous
replay reproduces the recorded run's per-step loss, grad norm and final weights exactly. Filters keep or drop
whole groups; kept groups are re-batched B per step, and groups left over are reported, never trained as a
short step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.checkpoint import write as write_checkpoint
from pipeline.config import ConfigError, ReplayConfig, dump_config, load_config
from pipeline.recorder import Recorder, Recording, RecordingError

CHUNK_STEPS = 50     # recorded steps read per Ray Dataset: memory holds a chunk, never the whole recording


class ReplayError(ValueError):
    pass


def select_groups(rec: Recording, f: ReplayConfig | None = None) -> pa.Table:
    """The recording's group index (step, group_id, data_source, reward) after the filters, in recorded order."""
    f = f or ReplayConfig()
    g = rec.groups
    if f.steps:
        unknown = sorted(set(f.steps) - set(rec.steps))
        if unknown:
            raise ReplayError(f"replay.steps: {unknown} not in the recording {rec.root} "
                              f"(it has steps {rec.steps[0]}..{rec.steps[-1]})")
        g = g.filter(pc.is_in(g.column("step"), pa.array(f.steps, pa.int64())))
    if f.data_sources:
        have = set(rec.groups.column("data_source").to_pylist())
        unknown = sorted(set(f.data_sources) - have)
        if unknown:
            raise ReplayError(f"replay.data_sources: {unknown} not in the recording (it has {sorted(have)})")
        g = g.filter(pc.is_in(g.column("data_source"), pa.array(f.data_sources, pa.string())))
    for bound, keep in ((f.reward_min, pc.greater_equal), (f.reward_max, pc.less_equal)):
        g = g if bound is None else g.filter(keep(g.column("reward"), bound))
    return g


class RecordedSource:
    """A pipeline source whose rows are a recording's: seq g is the g-th kept group in recorded order.
    Blocks never span two recorded steps, so with the recording's groups_per_step the batcher forms
    exactly the recorded steps."""

    def __init__(self, recording: Recording, groups: pa.Table):
        self.rec, self.n_samples = recording, recording.n_samples
        self.outputs = tuple(pq.read_schema(recording.files[0].path).names)
        self.steps = groups.column("step").to_pylist()           # recorded step of each seq
        self.group_ids = groups.column("group_id").to_pylist()
        self.num_groups = len(self.group_ids)

    def step_ends(self) -> list[int]:
        """Seqs at which a recorded step ends (exclusive), in order."""
        return [i + 1 for i in range(self.num_groups) if i + 1 == self.num_groups or self.steps[i + 1] != self.steps[i]]

    def blocks(self, start: int, num_groups: int, groups_per_block: int, skip=frozenset()):
        seqs = [g for g in range(start, min(start + num_groups, self.num_groups)) if g not in skip]
        for step, same in itertools.groupby(seqs, key=self.steps.__getitem__):    # a step's seqs are contiguous
            gids = [self.group_ids[g] for g in same]
            table = self.rec.read_step(step, gids)
            order = {gid: i for i, gid in enumerate(dict.fromkeys(table.column("group_id").to_pylist()))}
            for i in range(0, len(gids), groups_per_block):
                part = sorted(gids[i:i + groups_per_block], key=order.__getitem__)
                yield table.filter(pc.is_in(table.column("group_id"), pa.array(part, pa.int64())))

    def dataset(self, start: int, num_groups: int, groups_per_block: int, skip: frozenset = frozenset()):
        import ray

        return ray.data.from_arrow(list(self.blocks(start, num_groups, groups_per_block, skip)))


def replay(rollouts_dir: str | Path, cfg, run_dir: str | Path, filters: ReplayConfig | None = None,
           trackers=None, log: Callable[[str], None] = print, on_step: Callable[[dict], None] | None = None) -> dict:
    """Train `cfg`'s trainer on a recording; write a run directory like a run's. Returns a summary."""
    import ray

    from pipeline.builder import Pipeline, start_trainer
    from pipeline.cluster import init_ray
    from pipeline.loop import Batch, StepLoop
    from pipeline.profile import Profiler
    from pipeline.resources import plan_resources
    from pipeline.trackers import TrackerConfig, open_metrics
    from stages.model import resolve_model_path

    rec = Recording.open(rollouts_dir, kinds=cfg.agent.train_segments)
    source = RecordedSource(rec, select_groups(rec, filters))
    B, n = cfg.batcher.groups_per_step, cfg.rollout.n_samples
    if rec.n_samples != n:
        raise ReplayError(f"{rollouts_dir}: recorded with {rec.n_samples} samples per group, the config has "
                          f"rollout.n_samples={n}")
    steps = min(cfg.run.steps, source.num_groups // B)
    if steps == 0:
        raise ReplayError(f"{rollouts_dir}: {source.num_groups} groups pass the filters, fewer than one step "
                          f"(batcher.groups_per_step={B})")
    model_path = resolve_model_path(cfg.model, log=log)
    res = plan_resources(cfg)
    init_ray(cfg, res.ray_num_cpus)
    # the trainer a run starts, from the same resource plan: same config, seed and thread count, so its
    # RNGs and reductions run as they did in the recorded run (the torch trainer whatever the backend)
    trainer = start_trainer(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, backend="torch")),
                            model_path, res)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    pipeline = Pipeline([source])
    window = replay_window(cfg, pipeline, source)
    pipeline.profiler = profiler = Profiler(run_dir)
    metrics = open_metrics(run_dir, trackers or TrackerConfig())
    recorder = Recorder(run_dir, cfg.rollout.n_samples)

    skipped = 0

    def record(step: int, batch: Batch, m: dict) -> None:
        nonlocal skipped
        recorder.write(step, batch.table)
        if not m.get("train/grad_norm"):    # no finite loss, or an exactly zero gradient: nothing learned
            skipped += 1
            log(f"step {step}: nothing to train ({_untrained(batch.table, m)})")
        line = metrics.write(step, m | _rollout_metrics(batch.table) | {"version": step,
                                                                        "train/skipped_steps": skipped})
        if on_step:
            on_step(line)

    loop = StepLoop(window, trainer.train_step.remote, record, steps, span=profiler.add)
    try:
        loop.run()
        dropped = window.fairness.groups["dropped_filter"]
        left = source.num_groups - loop.step * B - dropped
        if left or dropped:
            log(f"replay: trained {loop.step} steps of {B} groups; {left} kept group(s) left over, "
                f"{dropped} dropped by batcher.filter_equal_rewards")
        ckpt = str(write_checkpoint(run_dir / "checkpoints" / f"step_{loop.step:06d}",
                                    lambda tmp: ray.get(trainer.save.remote(str(tmp), model_path))))
    finally:
        loop.close()
        metrics.close()
        profiler.close()
        ray.kill(trainer)
    return {"steps": loop.step, "version": loop.step, "checkpoint": ckpt, "run_dir": str(run_dir),
            "skipped": skipped}


def _untrained(t: pa.Table, m: dict) -> str:
    """Why a step trained nothing (no finite loss, or a zero gradient), in a few words."""
    if m.get("train/nonfinite_skipped"):
        return f"{m['train/nonfinite_skipped']} mini-batch(es) with a non-finite loss or grad norm, not applied"
    if not m.get("train/tokens"):
        return f"no trainable token in its {t.num_rows} rows: failed or masked out"
    groups: dict[int, tuple[set, set]] = {}
    for g, i, r in zip(*(t.column(c).to_pylist() for c in ("group_id", "sample_idx", "reward"))):
        groups.setdefault(g, (set(), set()))[0].add(i)
        groups[g][1].add(r)
    n, ones = len(groups), sum(len(s) == 1 for s, _ in groups.values())
    if ones == n:
        return f"{n} group{'s' * (n != 1)} of one sample: no advantage"
    if all(len(s) == 1 or len(r) == 1 for s, r in groups.values()):
        return f"{n} groups" + (f": {ones} of one sample, the others" if ones else ", each") + \
            " of equal rewards: zero advantage"
    return "a zero gradient"


def replay_window(cfg, pipeline, source: RecordedSource):
    """The run's window over the recording, without its staleness bound: recorded token versions count
    the recorded run's weights, and every recorded group already passed the bound once."""
    from pipeline.window import Window

    window = Window(cfg.batcher, cfg.rollout.n_samples, stale_steps=sys.maxsize, mask_old=cfg.rollout.partial_mask_old)
    window.read(_recorded_parts(pipeline, source, CHUNK_STEPS * cfg.batcher.groups_per_step,
                                cfg.rollout.groups_per_batch or cfg.batcher.groups_per_step))
    return window


def _recorded_parts(pipeline, source: RecordedSource, chunk: int, gpb: int):
    """The recording's rows through the pipeline's map stages, `chunk` groups (whole recorded steps) at a time."""
    ends, start = source.step_ends(), 0
    while start < source.num_groups:
        stop = next(e for e in ends if e >= min(start + chunk, ends[-1]))
        with contextlib.closing(pipeline.stream(start, stop - start, gpb)) as stream:
            yield from stream
        start = stop


def _rollout_metrics(t: pa.Table) -> dict:
    rewards = t.column("reward").to_pylist()
    lens = pc.list_value_length(t.column("response_ids")).to_pylist()
    return {"rollout/reward_mean": sum(rewards) / len(rewards), "rollout/samples": len(rewards),
            "rollout/tokens": sum(lens), "rollout/response_len": sum(lens) / len(lens)}


def read_rollouts(path: str | Path, filters: ReplayConfig | None = None):
    """A recording (RUN_DIR or RUN_DIR/rollouts) as a pandas DataFrame with a `step` column, checked and filtered."""
    path = Path(path)
    rec = Recording.open(path / "rollouts" if (path / "rollouts").is_dir() else path)
    keep = select_groups(rec, filters)
    table = rec.read(sorted(set(keep.column("step").to_pylist())))
    table = table.filter(pc.is_in(table.column("group_id"), keep.column("group_id")))
    return table.to_pandas()


def resolve_replay_config(rollouts_dir: str | Path, config: str | None, overrides: list[str]):
    """The config a replay runs: CONFIG if given, else the recorded run's config.yaml, plus overrides."""
    if config is None:
        config = Path(rollouts_dir).resolve().parent / "config.yaml"
        if not config.is_file():
            raise ReplayError(f"no CONFIG given and no recorded config at {config}: pass the recipe the run used")
    return load_config(config, overrides)


def cli_replay(args) -> int:
    config, overrides = args.config, args.overrides
    if config is not None and "=" in config:      # `replay DIR key=value`: no CONFIG, the first override
        config, overrides = None, [config, *overrides]
    try:
        cfg = resolve_replay_config(args.rollouts_dir, config, overrides)
        parent = Path(args.rollouts_dir).resolve().parent
        out = Path(args.run_dir or f"{parent}-replay-{time.strftime('%Y%m%d-%H%M%S')}")
        summary = replay(args.rollouts_dir, cfg, out, cfg.replay, trackers=cfg.trackers, on_step=_say_step)
    except (ConfigError, RecordingError, ReplayError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    none = f" ({summary['skipped']} of them trained nothing)" if summary["skipped"] else ""
    print(f"replayed {summary['steps']} steps{none}; run directory {summary['run_dir']}")
    return 0


def _say_step(m: dict) -> None:
    if m.get("train/grad_norm"):        # a step that trained nothing was said by replay() itself
        print(f"step {m['step']}: loss {m['train/loss']:+.5f} grad_norm {m['train/grad_norm']:.4f}")


def add_subcommand(sub) -> None:
    p = sub.add_parser("replay")
    p.add_argument("rollouts_dir", help="RUN_DIR/rollouts of a recorded run")
    p.add_argument("config", nargs="?", default=None, help="recipe YAML (default: the recorded run's config.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. replay.reward_min=0.5")
    p.add_argument("--run-dir", default=None, help="run directory (default RUN_DIR-replay-<time>)")
    p.set_defaults(fn=cli_replay)
