"""`loongsage` command line: run a recipe, replay a recording, profile a run.

    loongsage run configs/quickstart.yaml [section.key=value ...] [--run-dir DIR]
    loongsage replay RUN/rollouts [CONFIG] [replay.steps=[1,2] ...] [--run-dir DIR]
    loongsage profile RUN [--out DIR]
    loongsage make-teacher --task addition --out DIR
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _progress(total: int):
    """A live line per run: step, reward, accuracy, samples/s, ETA (rich when on a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn(), console=console, transient=False)
    task = bar.add_task("train", total=total, info="starting")
    state = {"t0": time.time(), "samples": 0, "acc": None}

    def on_step(line: dict) -> None:
        if "eval/accuracy" in line:
            state["acc"] = line["eval/accuracy"]
            console.print(f"[eval] step {line['step']}: accuracy {line['eval/accuracy']:.3f} "
                          f"(reward mean {line['eval/reward_mean']:.3f})")
        if "train/loss" in line:
            state["samples"] += line.get("rollout/samples", 0)
            rate = state["samples"] / max(time.time() - state["t0"], 1e-9)
            acc = "-" if state["acc"] is None else f"{state['acc']:.3f}"
            info = (f"reward {line['rollout/reward_mean']:.3f}  eval acc {acc}  "
                    f"loss {line['train/loss']:+.4f}  {rate:.1f} samples/s")
            bar.update(task, completed=line["step"], info=info)

    return bar, on_step


def cmd_run(args) -> int:
    from pipeline.config import ConfigError, load_config
    from pipeline.controller import run

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    bar, on_step = _progress(cfg.run.steps)
    try:
        with bar:
            summary = run(cfg, run_dir, on_step=on_step, log=bar.console.print)
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init, final = summary["initial"].get("eval/accuracy"), summary["final"].get("eval/accuracy")
    print(f"done: {summary['steps']} steps, weights version {summary['version']}; run directory {run_dir}")
    if init is not None and final is not None:
        print(f"eval/accuracy: {init:.3f} at step 0 -> {final:.3f} at step {summary['steps']}")
    return 0


def cmd_replay(args) -> int:
    from pipeline.replay import cli_replay

    return cli_replay(args.rollouts_dir, args.config, args.overrides, args.run_dir)


def cmd_profile(args) -> int:
    from pipeline.profile import cli_profile

    return cli_profile(args.run_dir, args.out)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    p = argparse.ArgumentParser(prog="loongsage", description="LoongSage: asynchronous RL post-training on Ray Data")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a recipe")
    r.add_argument("config", help="recipe YAML, e.g. configs/quickstart.yaml")
    r.add_argument("overrides", nargs="*", help="section.key=value overrides")
    r.add_argument("--run-dir", default=None, help="run directory (default runs/<recipe>-<time>)")
    r.set_defaults(fn=cmd_run)
    rp = sub.add_parser("replay", help="train from a recorded rollouts/ dataset, without rollout engines")
    rp.add_argument("rollouts_dir", help="RUN_DIR/rollouts of a recorded run")
    rp.add_argument("config", nargs="?", default=None, help="recipe YAML (default: the recorded run's config.yaml)")
    rp.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. replay.reward_min=0.5")
    rp.add_argument("--run-dir", default=None, help="run directory (default RUN_DIR-replay-<time>)")
    rp.set_defaults(fn=cmd_replay)
    pr = sub.add_parser("profile", help="per-stage table and timeline plots of a run's profile/")
    pr.add_argument("run_dir", help="a run directory")
    pr.add_argument("--out", default=None, help="where the PNGs go (default RUN_DIR/profile_report)")
    pr.set_defaults(fn=cmd_profile)
    from stages.tasks.make_teacher import add_subcommand

    add_subcommand(sub)       # loongsage make-teacher: tiny specialist teachers and mixed prompts (OPD recipe)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
