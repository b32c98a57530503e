"""The config schema is the one source of every key's type, default, range and doc: the
reference is generated from it, and values out of range are refused when a recipe is read."""
from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import config_doc
from pipeline.config import Config, ConfigError, load_config
from stages.keys import problem

ROOT = Path(__file__).resolve().parents[1]
# numeric keys where any finite value is meaningful (a coefficient's sign, an optional bound)
ANY_NUMBER = {"algorithm.entropy_coef", "replay.reward_min", "replay.reward_max"}


def test_docs_config_md_is_generated_from_the_schema():
    current = (ROOT / "docs/config.md").read_text()
    assert current == config_doc.markdown(), f"docs/config.md is stale: run {config_doc.REGENERATE}"


def test_every_key_has_a_doc_and_every_numeric_key_a_range():
    rows = [r for _, _, keys in config_doc.sections() for r in keys]
    assert len(rows) >= 192
    assert [r.key for r in rows if not r.doc.strip()] == []
    numeric = [r for r in rows if r.type in ("int", "float", "float | None")]
    assert [r.key for r in numeric if r.accepts in ("any", "finite") and r.key not in ANY_NUMBER] == []


def test_defaults_pass_their_own_checks_and_every_recipe_loads():
    for _, _, keys in config_doc.sections():
        assert all(r.default is not None for r in keys)
    cfg = Config()
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if not dataclasses.is_dataclass(value):
                assert problem(value, f.metadata.get("check")) is None, f"{section.name}.{f.name}"
    for recipe in sorted(glob.glob(str(ROOT / "configs/*.yaml"))):
        load_config(recipe)


@pytest.mark.parametrize("override, message", [
    ("trainer.lr=.inf", "trainer.lr must be a finite number > 0, got inf"),
    ("sampling.temperature=.nan", "sampling.temperature must be a finite number >= 0, got nan"),
    ("eval.every=-5", "eval.every must be >= 0, got -5"),
    ("sampling.top_p=0", "sampling.top_p must be in (0, 1], got 0.0"),
    ("trainer.betas=[0.9,1.5]", "trainer.betas must be two numbers, each in [0, 1), got (0.9, 1.5)"),
    ("sandbox.workers=0", "sandbox.workers must be > 0, got 0"),
    ("algorithm.name=ppo", "algorithm.name must be one of grpo, dr_grpo"),
])
def test_out_of_range_values_are_refused_naming_key_value_and_range(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", [override])
    assert message in str(e.value)


def _cli(*args, cwd=ROOT, python=()):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, *python, "-m", "pipeline.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


HEAVY = {"torch", "ray", "transformers", "vllm", "sglang", "megatron"}   # seconds to import, each


def test_bad_values_are_refused_by_the_real_cli_with_one_line(tmp_path):
    cases = {"run.steps=abc": "run.steps: expected int, got 'abc'",
             "run.steps=1e3": "run.steps: expected int, got '1e3'",
             "trainer.lr=.inf": "trainer.lr must be a finite number > 0, got inf",
             "sampling.temperature=.nan": "sampling.temperature must be a finite number >= 0, got nan",
             "eval.every=-5": "eval.every must be >= 0, got -5",
             "eval.num_prompts=-1": "eval.num_prompts must be >= 0, got -1",
             "rollout.max_new_tokens=4": "rollout.max_new_tokens is now sampling.max_new_tokens"}
    # -X importtime: Python lists every module the process imported (on stderr, one "import time:" line each);
    # a refusal comes before torch and Ray are imported, which is what makes it take a fraction of a second
    procs = {o: _cli("run", "configs/quickstart.yaml", o, "--run-dir", str(tmp_path / o), python=("-X", "importtime"))
             for o in cases}
    for override, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        timed = [x.rsplit("|", 1)[-1].strip() for x in err.splitlines() if x.startswith("import time:")]
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith("import time:")]
        assert proc.returncode == 2, (override, err)
        assert lines == [f"config error: {cases[override]}"], (override, lines)
        assert not (tmp_path / override).exists()          # refused before the run directory is made
        assert "pipeline.config" in timed and "yaml" in timed, timed[-20:]      # the list is really read
        assert sorted({m.split(".")[0] for m in timed} & HEAVY) == [], override


def test_the_schema_names_what_the_torch_modules_implement():
    """The update stage's config (torch-free) lists the advantage estimators, surrogates and KL
    estimators by name; the modules that implement them hold the same names."""
    from stages.update import advantages, config, losses

    assert config.ADVANTAGES == tuple(advantages.ESTIMATORS)
    assert config.SURROGATE_NAMES == tuple(losses.SURROGATES)
    assert config.KL_ESTIMATOR_NAMES == tuple(losses.KL_ESTIMATORS)


def test_config_command_prints_the_reference_and_checks_a_recipe():
    section, check, bad, unknown = (_cli("config", "eval"), _cli("config", "--check", "configs/quickstart.yaml",
                                                               "eval.every=3"),
                                    _cli("config", "--check", "configs/quickstart.yaml", "eval.every=-3"),
                                    _cli("config", "evals"))
    out, _ = section.communicate(timeout=300)
    assert section.returncode == 0
    assert "eval.num_prompts  (int, default 200, accepts >= 0)" in out and "run.steps" not in out
    out, err = check.communicate(timeout=300)
    assert check.returncode == 0 and "every: 3" in out and "steps: 160" in out and "valid" in err
    _, err = bad.communicate(timeout=300)
    assert bad.returncode == 2 and err.strip() == "config error: eval.every must be >= 0, got -3"
    _, err = unknown.communicate(timeout=300)
    assert unknown.returncode == 2 and "unknown section 'evals'" in err
