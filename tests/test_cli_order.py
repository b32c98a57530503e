"""Every subcommand takes its options and positional arguments in any order (pipeline/cli.py parse_argv)."""
import argparse

import pytest

from pipeline import cli

VALUES = {int: "3", float: "0.5"}


def _words(sp: argparse.ArgumentParser):
    """A value for each of the subcommand's options and positionals (two for a list of them). An option
    of several values (nargs + or *) takes every word up to the next option, in any order: left out."""
    opts, pos = [], []
    for i, a in enumerate(sp._actions):
        if isinstance(a, argparse._HelpAction):
            continue
        if not a.option_strings:
            pos.append([f"k{i}=1", f"k{i}=2"] if a.nargs in ("*", "+") else [f"p{i}"])
        elif a.nargs == 0:
            opts.append([a.option_strings[0]])
        elif a.nargs in (None, "?"):
            value = a.choices[0] if a.choices else VALUES.get(a.type, f"o{i}")
            opts.append([a.option_strings[0], str(value)])
    return opts, pos


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_options_before_between_or_after_the_positionals(name):
    opts, pos = _words(cli.parser(name))
    flat = [w for o in opts for w in o]
    orders = [flat + [w for p in pos for w in p], [w for p in pos for w in p] + flat]
    if len(pos) > 1 or (pos and len(pos[0]) > 1):     # an option between two positional words
        words = [w for p in pos for w in p]
        orders.append(words[:1] + flat + words[1:])
    parsed = [vars(cli.parse_argv([name, *argv])) for argv in orders]
    for p in parsed:
        p.pop("fn")
    assert all(p == parsed[0] for p in parsed), parsed
    assert parsed[0]["cmd"] == name


def test_run_takes_its_run_dir_before_the_overrides():
    args = cli.parse_argv(["run", "configs/quickstart.yaml", "--run-dir", "D", "run.steps=1", "eval.every=0"])
    assert (args.config, args.run_dir) == ("configs/quickstart.yaml", "D")
    assert args.overrides == ["run.steps=1", "eval.every=0"]


def test_a_subcommand_runs_both_ways(tmp_path, capsys):
    """make-teacher --prompts (seconds): the same files whichever order its options come in."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli.main(["make-teacher", "--task", "addition", "--prompts", str(a), "--train-size", "20"]) == 0
    assert cli.main(["make-teacher", "--train-size", "20", "--prompts", str(b), "--task", "addition"]) == 0
    assert (a / "train.jsonl").read_text() == (b / "train.jsonl").read_text()
    assert len((a / "train.jsonl").read_text().splitlines()) == 20
