"""`loongsage` command line: `run` here, every other subcommand in the module SUBCOMMANDS names.

Options and positionals (key=value overrides too) come in any order. The command line answers before torch
or Ray is imported: -h lists the subcommands without importing their modules, a subcommand imports only its
own, and `run` refuses a bad value or a used run directory before the run's own modules load.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import shlex
import signal
import sys
import time
from pathlib import Path

# name -> (the module that declares its options and runs it: add_subcommand(sub), what -h says of it)
SUBCOMMANDS = {
    "run": ("pipeline.cli", "run a recipe"),
    "replay": ("pipeline.replay", "train from a recorded rollouts/ dataset, without rollout engines"),
    "profile": ("pipeline.planner.spans", "per-stage table and timeline plots of a run's profile/"),
    "make-teacher": ("stages.tasks.make_teacher", "SFT a tiny specialist teacher on a built-in task"),
    "make-model": ("stages.tasks.make_model", "write a tiny random model on a real vocabulary"),
    "export": ("pipeline.export", "write a checkpoint as an HF model directory (--merge: LoRA base + adapter)"),
    "plan": ("pipeline.planner.plan", "simulate a run on a cluster (calibrated on a run's profile, or presets)"),
    "config": ("pipeline.config_doc", "the config reference; --check validates a recipe"),
    "serve": ("pipeline.serve", "serve a model or checkpoint behind the recording proxy (all four APIs)"),
}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # no "Writing model shards" bars from transformers, here and in the Ray workers that inherit this environment
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = parse_argv(sys.argv[1:] if argv is None else list(argv))
    return args.fn(args)


def parser(name: str | None = None) -> argparse.ArgumentParser:
    """Subcommand `name`'s parser, declared in full by its module; or (None) the top level, listing every
    subcommand by its name and help alone."""
    p = argparse.ArgumentParser(prog="loongsage", description="LoongSage: asynchronous RL post-training on Ray Data")
    sub = p.add_subparsers(dest="cmd", required=True)
    if name is not None:
        importlib.import_module(SUBCOMMANDS[name][0]).add_subcommand(sub)
        return sub.choices[name]
    for n, (_, text) in SUBCOMMANDS.items():
        sub.add_parser(n, help=text)
    return p


def parse_argv(argv: list[str]) -> argparse.Namespace:
    """The command line as its subcommand's parser reads it, options and positionals intermixed
    (argparse refuses intermixed parsing on a parser that has subcommands: the top level only picks one)."""
    if argv and argv[0] in SUBCOMMANDS:
        return parser(argv[0]).parse_intermixed_args(argv[1:], argparse.Namespace(cmd=argv[0]))
    return parser().parse_args(argv)      # -h, or no / an unknown subcommand: argparse's own message


def add_subcommand(sub) -> None:
    r = sub.add_parser("run")
    r.add_argument("config", help="recipe YAML, e.g. configs/quickstart.yaml")
    r.add_argument("overrides", nargs="*", help="section.key=value overrides")
    r.add_argument("--run-dir", default=None, help="run directory (default runs/<recipe>-<time>)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the run directory's newest intact checkpoint (run.resume_from=latest)")
    r.add_argument("--overwrite", action="store_true",
                   help="start over in a run directory that holds an earlier run (its files are removed)")
    r.add_argument("--verbose", action="store_true",
                   help="show Ray's own logs on the terminal (by default they go to RUN_DIR/ray.log)")
    r.set_defaults(fn=cmd_run)


def cmd_run(args) -> int:
    from pipeline.checkpoint import CheckpointError
    from pipeline.config import ConfigError, check_names, load_config
    from pipeline.rundir import RunDirError, claim

    if args.resume and not args.run_dir:
        print("error: --resume continues the run in --run-dir DIR: name it", file=sys.stderr)
        return 2
    overrides = [*args.overrides, *(["run.resume_from=latest"] if args.resume else [])]
    try:
        cfg = load_config(args.config, overrides)
        check_names(cfg)          # as `config --check` does: reward.fn imports, the paths it names exist
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    one_line = (ValueError, ConfigError, CheckpointError, RunDirError)     # errors that are their message
    run_dir = Path(args.run_dir or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        # claimed before anything (ray.log included) is written into it, and before torch and Ray load
        with claim(run_dir, cfg.run.resume_from, args.overwrite, log=lambda m: print(m, file=sys.stderr)):
            summary = _train(cfg, run_dir, args.verbose, one_line)
    except one_line as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted before the run could stop at a step; nothing to resume from", file=sys.stderr)
        return 130
    except BaseException:
        if not args.verbose:
            print(f"(Ray's own log of this run: {run_dir / 'ray.log'})", file=sys.stderr)
        raise
    if (code := resume_hint(summary, args.config, args.overrides, run_dir)) is not None:
        return code
    init, final = summary["initial"].get("eval/accuracy"), summary["final"].get("eval/accuracy")
    print(f"done: {summary['steps']} steps, weights version {summary['version']}; run directory {run_dir}")
    if init is not None and final is not None:
        print(f"eval/accuracy: {_num(init, '.3f')} at step 0 -> {_num(final, '.3f')} at step {summary['steps']}")
    return 0


def _train(cfg, run_dir: Path, verbose: bool, one_line: tuple) -> dict:
    """The run under a live progress line; Ray's own output goes to RUN_DIR/ray.log unless verbose."""
    from pipeline.cluster import ray_output_to
    from pipeline.controller import run

    with contextlib.nullcontext() if verbose else ray_output_to(run_dir / "ray.log"):
        bar, on_step, say = _progress(cfg.run.steps)
        with bar:
            try:
                return run(cfg, run_dir, on_step=on_step, log=say)
            except one_line:
                bar.live.transient = True       # the terminal keeps the error's one line, not the bar
                raise


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v, spec: str) -> str:
    """A metric as the display shows it, '-' if missing or not a finite number: the display never stops a run."""
    return format(v, spec) if _finite(v) else "-"


def _progress(total: int):
    """A live line per run: step, reward, accuracy, samples/s, ETA (rich when on a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn(), console=console, transient=False)
    task = bar.add_task("train", total=total, info="starting")
    state = {"t0": time.time(), "samples": 0, "acc": None}

    def say(text: str) -> None:     # plain text: "[eval]" is not rich markup
        console.print(text, markup=False, highlight=False)

    def on_step(line: dict) -> None:
        step = line.get("step")
        at = {"completed": step} if isinstance(step, int) else {}
        if "eval/accuracy" in line:
            state["acc"] = line["eval/accuracy"]
            say(f"[eval] step {step}: accuracy {_num(line['eval/accuracy'], '.3f')} "
                f"(reward mean {_num(line.get('eval/reward_mean'), '.3f')})")
        if "train/loss" in line:
            samples = line.get("rollout/samples")
            state["samples"] += samples if _finite(samples) else 0
            rate = state["samples"] / max(time.time() - state["t0"], 1e-9)
            bar.update(task, info=f"reward {_num(line.get('rollout/reward_mean'), '.3f')}  eval acc "
                                  f"{_num(state['acc'], '.3f')}  loss {_num(line['train/loss'], '+.4f')}  "
                                  f"{rate:.1f} samples/s", **at)
        elif "train/skipped_steps" in line and line.get("train/tokens") == 0:   # skipped: no trainable row
            bar.update(task, info=f"step skipped: no trainable rows ({line['train/skipped_steps']} skipped so far)",
                       **at)

    return bar, on_step, say


def resume_hint(summary: dict, config: str, overrides: list[str], run_dir: str | Path) -> int | None:
    """A run stopped by a signal or a lost node: print how to resume it in its own run directory and return
    the shell's exit code (128 + the signal's number; 1 for a lost node). None for a run that finished."""
    sig = summary.get("interrupted")
    if not sig:
        return None
    code = 128 + signal.Signals[sig].value if sig in signal.Signals.__members__ else 1
    at = summary.get("steps", "?")      # "lost": a Ray node that held engines or the trainer died for good
    where = f"stopped at step {at}: {summary['lost']}" if summary.get("lost") else f"interrupted at step {at}"
    if summary.get("resume_from"):
        # the same directory, its newest intact checkpoint (the one just written): metrics go on in one file
        again = ["loongsage", "run", config, *(o for o in overrides if not o.startswith("run.resume_from=")),
                 "--run-dir", str(run_dir), "--resume"]
        print(f"{where}; checkpoint {summary['resume_from']}; resume with: {shlex.join(again)}")
    else:
        print(f"{where}; no checkpoint was written, so there is nothing to resume from")
    return code


if __name__ == "__main__":
    sys.exit(main())
