"""Hostile recipes through the real CLI: a file too big, not UTF-8, nested 50,000 deep, an alias bomb,
a cycle, an override 20,000 brackets deep, a reward.fn or a path that is not there. `loongsage run` and
`loongsage config --check` refuse each with the same one line (naming the file, and the key where there
is one) and no traceback, in seconds; replay, plan and serve read recipes with the same loader."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICK_S = 5.0           # Python and the config modules start in ~0.3 s; the alias bomb took over a minute
DEEP_OVERRIDE = "run.steps=" + "[" * 20_000 + "]" * 20_000


def _cli(*args, path=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *map(str, path)]))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *map(str, args)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300)
    return proc, time.monotonic() - t0


def _one_line(proc) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def _run_and_check(tmp_path, recipe, *overrides, path=()) -> str:
    """The line `run` and `config --check` both refuse with (the same), each within QUICK_S."""
    run, run_s = _cli("run", recipe, *overrides, "--run-dir", tmp_path / "run", path=path)
    check, check_s = _cli("config", "--check", recipe, *overrides, path=path)
    line = _one_line(check)
    assert _one_line(run) == line
    assert not (tmp_path / "run").exists()          # refused before the run directory is made
    assert run_s < QUICK_S and check_s < QUICK_S, (run_s, check_s)
    return line


def _alias_bomb() -> str:
    """Nine levels of ten aliases each: 10**9 values once expanded, in 400 bytes."""
    lines = ["placement:", "  trainer_resources:", "    r0: &r0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    r{i}: &r{i} [{', '.join([f'*r{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


HOSTILE_FILES = {
    "alias_bomb": (_alias_bomb().encode(), "placement.trainer_resources.r3: holds more than 10000 values, aliases "
                                           "expanded (line 6)"),
    "deep": (b"run: " + b"[" * 50_000 + b"]" * 50_000 + b"\n", "nested deeper than 64 levels (line 1)"),
    "not_utf8": (b"run:\n  steps: 3   # caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset 23)"),
    "too_big": (b"# " + b"x" * 2**20 + b"\n", "larger than 1 MiB"),
    "cycle": (b"run: &a [*a]\n", "run[0]: an alias inside its own anchor's value (a cycle)"),
    "control_char": (b"run:\n  steps: 3\x00\n", "not valid YAML: unacceptable character #x0000"),
}


@pytest.mark.parametrize("case", HOSTILE_FILES)
def test_a_hostile_recipe_file_is_refused_in_one_line_naming_the_file(tmp_path, case):
    content, says = HOSTILE_FILES[case]
    recipe = tmp_path / f"{case}.yaml"
    recipe.write_bytes(content)
    line = _run_and_check(tmp_path, recipe)
    assert line.startswith(f"config error: {recipe}: ") and says in line, line
    assert len(line) < 300, line        # no message formats the value whole


def test_an_override_20000_brackets_deep_is_refused_in_one_line_naming_the_key(tmp_path):
    line = _run_and_check(tmp_path, "configs/quickstart.yaml", DEEP_OVERRIDE)
    assert line.startswith("config error: override run.steps: ") and "nested deeper than 64 levels" in line, line
    assert len(line) < 300, line


def test_a_huge_value_is_shown_cut(tmp_path):
    recipe = tmp_path / "long.yaml"
    recipe.write_text("model:\n  dtype: " + "x" * 200_000 + "\n")
    line = _run_and_check(tmp_path, recipe)
    assert line.startswith("config error: model.dtype must be one of bfloat16, float16, float32, got 'xxx"), line
    assert line.endswith("...") and len(line) < 400, line


@pytest.fixture
def user_code(tmp_path):
    """A directory on PYTHONPATH with reward modules: one fine, one not callable, one that raises on import."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "good_reward.py").write_text("def score(prompt, response, answer, row):\n    return 1.0\n")
    (code / "flat_reward.py").write_text("score = 3\n")
    (code / "raising_reward.py").write_text('raise RuntimeError("needs the network\\nand a key")\n')
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return code


@pytest.mark.parametrize("recipe_text, says", [
    ("reward: {fn: no_such_pkg_47.rewards:score}",
     "config error: reward.fn 'no_such_pkg_47.rewards:score' does not import: ModuleNotFoundError: No module named "
     "'no_such_pkg_47'"),
    ("reward: {fn: raising_reward:score}",
     "config error: reward.fn 'raising_reward:score' does not import: RuntimeError: needs the network and a key"),
    ("reward: {fn: flat_reward:score}", "config error: reward.fn 'flat_reward:score' is not callable"),
    ("data: {path: TMP/missing.parquet}", "config error: data.path 'TMP/missing.parquet': no such file or directory"),
    ("data: {path: TMP/prompts.jsonl, test_path: TMP/gone.jsonl}",
     "config error: data.test_path 'TMP/gone.jsonl': no such file or directory"),
    ("model: {path: TMP/no_model}", "config error: model.path 'TMP/no_model' is not a directory"),
    ("model: {path: TMP/code}", "config error: model.path 'TMP/code' has no config.json (not an HF model directory)"),
    ("teacher: {teachers: {t: TMP/no_teacher}, default: t}",
     "config error: teacher.teachers.t 'TMP/no_teacher' is not a directory"),
    ("data: {path: 'builtin:additon'}", "config error: unknown built-in task 'additon'; built-in tasks: addition, "),
    ("rollout: {window: no_such_pkg_47:Window}",
     "config error: window strategy 'no_such_pkg_47:Window' does not import: ModuleNotFoundError: No module named "
     "'no_such_pkg_47'"),
])
def test_check_and_run_refuse_what_a_recipe_names_with_one_line(tmp_path, user_code, recipe_text, says):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text.replace("TMP", str(tmp_path)) + "\n")
    assert _run_and_check(tmp_path, recipe, path=[user_code]).startswith(says.replace("TMP", str(tmp_path)))


def test_check_passes_a_recipe_whose_names_are_there(tmp_path, user_code):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"reward: {{fn: good_reward:score}}\ndata: {{path: {tmp_path}/prompts.jsonl}}\n")
    proc, _ = _cli("config", "--check", recipe, path=[user_code])
    assert proc.returncode == 0, proc.stderr
    assert "fn: good_reward:score" in proc.stdout and proc.stderr.strip() == f"# {recipe}: valid"


def test_replay_plan_and_serve_refuse_hostile_yaml_in_one_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    says = f"{bomb}: placement.trainer_resources.r3: holds more than 10000 values"
    cluster = "configs/clusters/h100_64.yaml"
    for args, line in [
        (["replay", tmp_path / "rollouts", bomb, "--run-dir", tmp_path / "replay"], f"error: {says}"),
        (["plan", bomb, "--cluster", cluster], f"error: {says}"),
        (["plan", "configs/quickstart.yaml", "--cluster", bomb], f"error: {says}"),
        (["plan", "configs/quickstart.yaml", "--cluster", cluster, "layout.engines=" + "[" * 20_000 + "]" * 20_000],
         "error: override layout.engines: "),
        (["serve", tmp_path / "model", DEEP_OVERRIDE], "config error: override run.steps: "),
    ]:
        proc, seconds = _cli(*args)
        assert _one_line(proc).startswith(line), (args[:2], proc.stderr[-500:])
        assert seconds < 3 * QUICK_S, (args[:2], seconds)        # these import more (pyarrow, aiohttp)
    assert not (tmp_path / "replay").exists()
