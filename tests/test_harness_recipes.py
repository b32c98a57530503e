"""The harness recipes (configs/agent_claude_code.yaml, agent_codex.yaml, agent_opencode.yaml) load and name a
task agent that exists; the task's checker rewards exactly the file the task asks for; the agent starts each
harness with its telemetry off. Their real runs (the warm-up, then training with the real CLIs) are in the
harness tier: tests/harness/test_recipes.py."""
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

RECIPES = [("agent_claude_code", "claude-code"), ("agent_codex", "codex"), ("agent_opencode", "opencode-chat")]


@pytest.mark.parametrize("recipe, harness", RECIPES)
def test_harness_recipe_loads_and_runs_its_harness_through_the_task_agent(recipe, harness):
    cfg = load_config(str(ROOT / "configs" / f"{recipe}.yaml"))
    assert cfg.agent.name == f"cmd:python examples/agents/harness_task.py {harness}"
    assert harness in harness_task.HARNESSES
    rows = [json.loads(line) for line in (ROOT / cfg.data.path).read_text().splitlines()]
    assert rows and all(r["prompt"].endswith("into the file answer.txt.") and r["answer"] in r["prompt"] for r in rows)
    assert cfg.eval.num_prompts == 0 and cfg.agent.jail == "bwrap" and cfg.proxy.force_sampling
    assert cfg.reward.fn == "agent_answers"
    # the warm-up script writes the recipe's model.path
    assert cfg.model.path == f"runs/warm/{harness}"


def test_recipe_rejects_a_bad_override():
    from pipeline.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="max_turn"):
        load_config(str(ROOT / "configs" / "agent_claude_code.yaml"), ["agent.max_turn=3"])


def test_the_report_holds_only_the_named_file_and_the_reward_fn_grades_it(tmp_path):
    from stages.reward import agent_answers

    def graded() -> float:
        report = {"answers": [harness_task.answer_file(tmp_path)]}
        return agent_answers("", "", "maple", {"agent_info": json.dumps(report)})

    assert harness_task.answer_file(tmp_path) == "" and graded() == 0.0
    (tmp_path / "output.txt").write_text("maple\n")
    assert graded() == 0.0
    (tmp_path / "answer.txt").write_text("river\n")
    assert graded() == 0.0
    (tmp_path / "answer.txt").write_text("maple\n")
    assert harness_task.answer_file(tmp_path) == "maple" and graded() == 1.0


def test_claude_code_runs_with_only_its_shell_tool_and_no_outside_traffic(tmp_path):
    files, env, argv = harness_task.HARNESSES["claude-code"]
    cmd = argv("do it")
    assert cmd[1:3] == ["-p", "do it"] and cmd[cmd.index("--tools") + 1] == "Bash"
    e = env("http://127.0.0.1:9/t/r/v1", "sk-x", tmp_path)
    assert e["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/t/r" and e["ANTHROPIC_API_KEY"] == "sk-x"
    assert e["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and e["DISABLE_TELEMETRY"] == "1"
    assert json.loads(files("", "", tmp_path)[".claude.json"])["hasCompletedOnboarding"] is True


def test_task_agent_refuses_an_unknown_harness():
    p = subprocess.run([sys.executable, str(ROOT / "examples/agents/harness_task.py"), "vim"], capture_output=True,
                       text=True)
    assert p.returncode != 0 and "usage: harness_task.py claude-code|codex|opencode-chat|opencode-responses" in p.stderr
