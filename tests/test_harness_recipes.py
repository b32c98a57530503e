"""The harness recipes (configs/agent_codex.yaml, configs/agent_opencode.yaml) load and name a task agent that
exists; the task's checker rewards exactly the file the task asks for. Their real runs (a warm-up, then training
with the real CLIs) are not in the test suite yet: see docs/harnesses-running.md."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "agents"))
import harness_task  # noqa: E402


@pytest.mark.parametrize("recipe, harness", [("agent_codex", "codex"), ("agent_opencode", "opencode-chat")])
def test_harness_recipe_loads_and_runs_its_harness_through_the_task_agent(recipe, harness):
    cfg = load_config(str(ROOT / "configs" / f"{recipe}.yaml"))
    assert cfg.rollout.agent == f"cmd:python examples/agents/harness_task.py {harness}"
    assert harness in harness_task.HARNESSES
    rows = [json.loads(line) for line in (ROOT / cfg.data.path).read_text().splitlines()]
    assert rows and all(r["prompt"].endswith("into the file answer.txt.") and r["answer"] in r["prompt"] for r in rows)
    assert cfg.eval.num_prompts == 0 and cfg.rollout.agent_sandbox == "auto"


def test_checker_rewards_only_the_named_file_holding_the_answer(tmp_path):
    assert harness_task.check(tmp_path, "maple") == 0.0
    (tmp_path / "output.txt").write_text("maple\n")
    assert harness_task.check(tmp_path, "maple") == 0.0
    (tmp_path / "answer.txt").write_text("river\n")
    assert harness_task.check(tmp_path, "maple") == 0.0
    (tmp_path / "answer.txt").write_text("maple\n")
    assert harness_task.check(tmp_path, "maple") == 1.0


def test_task_agent_refuses_an_unknown_harness():
    p = subprocess.run([sys.executable, str(ROOT / "examples/agents/harness_task.py"), "vim"], capture_output=True,
                       text=True)
    assert p.returncode != 0 and "usage: harness_task.py codex|opencode-chat|opencode-responses" in p.stderr
