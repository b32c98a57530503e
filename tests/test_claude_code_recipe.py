"""configs/agent_claude_code.yaml: the recipe loads and validates, its agent command and task file resolve, and
the task's checker (examples/agents/claude_code.py) scores a working directory as the recipe's reward does.
The real run (Claude Code against the proxy, trained) is in tests/harness/ (marker `harness`)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "configs/agent_claude_code.yaml"


def agent_module():
    spec = importlib.util.spec_from_file_location("claude_code_agent", ROOT / "examples/agents/claude_code.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_recipe_loads_and_its_parts_resolve():
    from pipeline.config import load_config
    from stages.agentflow.blackbox import resolve_command
    from stages.prompts import load_prompts

    cfg = load_config(RECIPE, [])
    assert cfg.rollout.agent.startswith("cmd:") and cfg.rollout.proxy_force_sampling
    argv = resolve_command(cfg.rollout.agent.removeprefix("cmd:"))
    assert Path(argv[1]).resolve() == ROOT / "examples/agents/claude_code.py"
    rows = load_prompts(cfg.data).to_pylist()
    assert len(rows) >= 2 and all(r["answer"] and r["answer"] in r["prompt"] for r in rows)
    # the warm script writes the recipe's model.path
    assert cfg.model.path == "runs/claude-code-warm"


def test_recipe_rejects_a_bad_override():
    from pipeline.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="max_turn"):
        load_config(RECIPE, ["rollout.max_turn=3"])


def test_checker_rewards_exactly_the_answer_in_the_file(tmp_path):
    check = agent_module().check
    assert check(tmp_path, "answer.txt", "apple") == 0.0        # no file
    (tmp_path / "answer.txt").write_text("apple\n")
    assert check(tmp_path, "answer.txt", "apple") == 1.0        # echo's newline is fine
    (tmp_path / "answer.txt").write_text("apples\n")
    assert check(tmp_path, "answer.txt", "apple") == 0.0
    assert check(tmp_path, "other.txt", "apple") == 0.0


def test_agent_runs_claude_code_with_only_its_shell_tool_and_no_outside_traffic(tmp_path):
    mod = agent_module()
    argv = mod.claude_argv("claude", "do it")
    assert argv[1:3] == ["-p", "do it"] and argv[argv.index("--tools") + 1] == "Bash"
    env = mod.claude_env(tmp_path, 96)
    assert env["HOME"] == str(tmp_path) and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert env["DISABLE_TELEMETRY"] == "1" and "ANTHROPIC_AUTH_TOKEN" not in env
