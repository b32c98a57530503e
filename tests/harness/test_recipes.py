"""The harness recipes end to end through the real CLIs (marker `harness`): each recipe's documented commands,
shortened. The warm-up script (examples/agents/warm_harness.py) captures the harness's real prompt in the agent
jail and fine-tunes a few steps; then `python -m pipeline.cli run configs/agent_X.yaml` runs 2 training steps,
every trajectory the real harness in its jail against the proxy. Checked: the run exits 0; both steps trained
(rows with model tokens, the version advanced); every completed trajectory's reward is reward.fn's grade of
the report of what the harness left in answer.txt; no request of any harness got an error status (the proxy notes
each one with the trajectory). Whether the recipes learn takes longer runs: benchmarks/harness_recipes.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stages.reward import agent_answers

pytestmark = pytest.mark.harness
ROOT = Path(__file__).resolve().parents[2]
RECIPES = [("agent_claude_code", "claude-code"), ("agent_codex", "codex"), ("agent_opencode", "opencode-chat")]
BIN = ROOT / ".cache" / "harness" / "node_modules" / ".bin"


def _run(cmd: list[str], timeout: float) -> str:
    p = subprocess.run(cmd, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(cmd[1:4])} exited {p.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.parametrize("recipe, harness", RECIPES)
def test_recipe_warms_and_trains_two_steps_through_the_real_harness(tmp_path, recipe, harness):
    exe = {"claude-code": "claude", "codex": "codex"}.get(harness, "opencode")
    if not (BIN / exe).exists():
        pytest.skip(f"{exe} is not installed: run tests/harness/install.sh")
    model, run_dir = tmp_path / "warm", tmp_path / "run"
    # a short warm-up on one task's prompt: the model calls the tool now and then; learning is not the point here
    _run([sys.executable, "examples/agents/warm_harness.py", harness, str(model), "--steps", "6", "--tasks", "1"],
         timeout=600)
    _run([sys.executable, "-m", "pipeline.cli", "run", f"configs/{recipe}.yaml", "run.steps=2",
          f"model.path={model}", "--run-dir", str(run_dir)], timeout=900)

    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [m for m in steps if "train/samples" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["train/skipped_steps"] == 0 and m["train/samples"] > 0 for m in steps), steps
    assert steps[-1]["version"] == 2
    rows = pq.read_table(run_dir / "rollouts").to_pylist()
    done = [r for r in rows if r["status"] != "failed"]
    assert len(done) >= len(rows) // 2, [r["error"] for r in rows if r["status"] == "failed"]
    for r in done:      # the report of what the harness left (it never saw the answer), graded outside the jail
        report = json.loads(r["agent_info"])
        assert "harness_exit" in report and len(report["answers"]) == 1, report
        assert r["reward"] == agent_answers("", "", r["answer"], r) and r["agent_reward"] is None
    errors = [n for r in rows for n in (r["proxy_notes"] or []) if n.startswith("answered HTTP")]
    assert not errors, f"{harness}: error statuses {errors}"
