"""`loongsage` command line: run a recipe, replay a recording, profile a run.

    loongsage run configs/quickstart.yaml [section.key=value ...] [--run-dir DIR] [--resume | --overwrite] [--verbose]
    loongsage replay RUN/rollouts [CONFIG] [replay.steps=[1,2] ...] [--run-dir DIR]
    loongsage profile RUN [--out DIR]
    loongsage make-teacher --task addition --out DIR
    loongsage make-model --vocab qwen OUT_DIR
    loongsage export [--merge] CHECKPOINT OUT
    loongsage plan [CONFIG] [key=value ...] [--calibrate RUN] [--cluster FILE] [--sweep KEY=V1,V2 ...]
    loongsage serve MODEL_OR_CHECKPOINT [key=value ...] [--port P] [--key-file F] [--record DIR]
    loongsage config [SECTION] | --check RECIPE [key=value ...] | --markdown

Every subcommand takes its options and its positional arguments (key=value overrides too) in any order;
an option of several values (plan --sweep) takes every word up to the next option.
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


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v, spec: str) -> str:
    """A metric as the display shows it: '-' when it is missing, None (NaN in metrics.jsonl),
    not a number or not finite. The display never stops a run."""
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
        if "eval/accuracy" in line:
            state["acc"] = line["eval/accuracy"]
            say(f"[eval] step {line.get('step')}: accuracy {_num(line['eval/accuracy'], '.3f')} "
                f"(reward mean {_num(line.get('eval/reward_mean'), '.3f')})")
        if "train/loss" in line:
            samples = line.get("rollout/samples")
            state["samples"] += samples if _finite(samples) else 0
            rate = state["samples"] / max(time.time() - state["t0"], 1e-9)
            info = (f"reward {_num(line.get('rollout/reward_mean'), '.3f')}  eval acc {_num(state['acc'], '.3f')}  "
                    f"loss {_num(line['train/loss'], '+.4f')}  {rate:.1f} samples/s")
            step = line.get("step")
            bar.update(task, info=info, **({"completed": step} if isinstance(step, int) else {}))
        elif "train/skipped_steps" in line and line.get("train/tokens") == 0:   # skipped: no trainable row
            step = line.get("step")
            bar.update(task, info=f"step skipped: no trainable rows ({line['train/skipped_steps']} skipped so far)",
                       **({"completed": step} if isinstance(step, int) else {}))

    return bar, on_step, say


def resume_hint(summary: dict, config: str, overrides: list[str], run_dir: str | Path) -> int | None:
    """A run stopped by a signal (the summary's "interrupted": "SIGINT" | "SIGTERM") or by a
    lost node: print how to resume it in its own run directory and return the shell's exit
    code (128 + the signal's number: 130, 143; 1 otherwise). None for a run that finished."""
    sig = summary.get("interrupted")
    if not sig:
        return None
    code = 128 + signal.Signals[sig].value if sig in signal.Signals.__members__ else 1
    where = f"interrupted at step {summary.get('steps', '?')}"
    if summary.get("lost"):     # a Ray node that held engines or the trainer died and did not come back
        where = f"stopped at step {summary.get('steps', '?')}: {summary['lost']}"
    if summary.get("resume_from"):
        # the same directory, its newest intact checkpoint (the one just written): metrics go on in one file
        again = ["loongsage", "run", config, *(o for o in overrides if not o.startswith("run.resume_from=")),
                 "--run-dir", str(run_dir), "--resume"]
        print(f"{where}; checkpoint {summary['resume_from']}; resume with: {shlex.join(again)}")
    else:
        print(f"{where}; no checkpoint was written, so there is nothing to resume from")
    return code


def cmd_run(args) -> int:
    from pipeline.config import ConfigError, check_names, load_config

    if args.resume and not args.run_dir:
        print("error: --resume continues the run in --run-dir DIR: name it", file=sys.stderr)
        return 2
    overrides = [*args.overrides, *(["run.resume_from=latest"] if args.resume else [])]
    try:      # before torch and Ray are imported (seconds): a bad key or value is refused at once
        cfg = load_config(args.config, overrides)
        check_names(cfg)          # as `config --check` does: reward.fn imports, the paths it names exist
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from pipeline.checkpoint import CheckpointError
    from pipeline.cluster import ray_output_to
    from pipeline.controller import run
    from pipeline.rundir import RunDirError, claim

    one_line = (ValueError, ConfigError, CheckpointError, RunDirError)     # errors that are their message
    run_dir = Path(args.run_dir or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    # Ray's own output goes to RUN_DIR/ray.log; --verbose leaves it on the terminal
    ray_log = run_dir / "ray.log"
    quiet = contextlib.nullcontext() if args.verbose else ray_output_to(ray_log)
    try:
        # the run directory is claimed before anything (ray.log included) is written into it
        with claim(run_dir, bool(cfg.run.resume_from), args.overwrite, log=lambda m: print(m, file=sys.stderr)):
            with quiet:
                bar, on_step, say = _progress(cfg.run.steps)
                with bar:
                    try:
                        summary = run(cfg, run_dir, on_step=on_step, log=say)
                    except one_line:
                        bar.live.transient = True       # the terminal keeps the error's one line, not the bar
                        raise
    except one_line as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted before the run could stop at a step; nothing to resume from", file=sys.stderr)
        return 130
    except BaseException:
        if not args.verbose:
            print(f"(Ray's own log of this run: {ray_log})", file=sys.stderr)
        raise
    code = resume_hint(summary, args.config, args.overrides, run_dir)
    if code is not None:
        return code
    init, final = summary["initial"].get("eval/accuracy"), summary["final"].get("eval/accuracy")
    print(f"done: {summary['steps']} steps, weights version {summary['version']}; run directory {run_dir}")
    if init is not None and final is not None:
        print(f"eval/accuracy: {_num(init, '.3f')} at step 0 -> {_num(final, '.3f')} at step {summary['steps']}")
    return 0


def cmd_replay(args) -> int:
    from pipeline.replay import cli_replay

    return cli_replay(args.rollouts_dir, args.config, args.overrides, args.run_dir)


def cmd_profile(args) -> int:
    from pipeline.profile import cli_profile

    return cli_profile(args.run_dir, args.out)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # the terminal carries the run's own lines: no "Writing model shards" bars from transformers (read at its
    # import, here and in every Ray worker the run starts, which inherit this environment)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = parse_argv(sys.argv[1:] if argv is None else list(argv))
    return args.fn(args)


# subcommand -> (its module, the function that adds its parser), in the order -h lists them
SUBCOMMANDS = {
    "make-teacher": ("stages.tasks.make_teacher", "add_subcommand"),   # tiny specialist teachers (OPD recipe)
    "make-model": ("stages.tasks.make_model", "add_subcommand"),           # a tiny model on Qwen's vocabulary
    "export": ("pipeline.export", "register"),                         # a checkpoint as an HF model directory
    "plan": ("pipeline.plan", "add_subcommand"),                       # simulate a run on a cluster
    "config": ("pipeline.config_doc", "add_subcommand"),               # the config reference, --check RECIPE
    "serve": ("pipeline.serve", "add_subcommand"),                     # the engines behind the recording proxy
}


def parse_argv(argv: list[str]) -> argparse.Namespace:
    """The command line as every subcommand's parser reads it (nothing is run)."""
    p = argparse.ArgumentParser(prog="loongsage", description="LoongSage: asynchronous RL post-training on Ray Data")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a recipe")
    r.add_argument("config", help="recipe YAML, e.g. configs/quickstart.yaml")
    r.add_argument("overrides", nargs="*", help="section.key=value overrides")
    r.add_argument("--run-dir", default=None, help="run directory (default runs/<recipe>-<time>)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the run directory's newest intact checkpoint (run.resume_from=latest)")
    r.add_argument("--overwrite", action="store_true",
                   help="start over in a run directory that holds a finished run (its files are removed)")
    r.add_argument("--verbose", action="store_true",
                   help="show Ray's own logs on the terminal (by default they go to RUN_DIR/ray.log)")
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
    # the other subcommands are declared in their own modules, some of which import torch or Ray: only the
    # one named is imported (all of them for -h or a wrong name), so `run` reaches its config check at once
    named = argv[0] if argv and argv[0] in (*sub.choices, *SUBCOMMANDS) else None
    for name, (module, register) in SUBCOMMANDS.items():
        if named is None or named == name:
            getattr(importlib.import_module(module), register)(sub)
    return parse(p, sub, argv)


def parse(parser: argparse.ArgumentParser, sub, argv: list[str]) -> argparse.Namespace:
    """Options and positionals in any order (`run CFG --run-dir D k=v`), for every subcommand: its own
    parser parses what follows its name intermixed (argparse's intermixed parsing refuses a parser
    that has subcommands, so the top level only picks the subcommand)."""
    if argv and argv[0] in sub.choices:
        return sub.choices[argv[0]].parse_intermixed_args(argv[1:], argparse.Namespace(cmd=argv[0]))
    return parser.parse_args(argv)      # -h, or no / an unknown subcommand: argparse's own message


if __name__ == "__main__":
    sys.exit(main())
