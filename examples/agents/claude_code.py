"""Claude Code, unmodified, on one shell task in a working directory of its own; the task's checker is the reward.

Run by AgentFlow once per trajectory (configs/agent_claude_code.yaml:
`rollout.agent: "cmd:python examples/agents/claude_code.py"`). It reads

    ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY   this trajectory's proxy endpoint (set by AgentFlow)
    LOONGSAGE_SAMPLE                        the task row as JSON: prompt (the task), answer (what the
                                            checker expects in the task's file)

makes an empty working directory, runs the real `claude -p TASK` in it (Claude Code's shell tool runs
there), then checks the directory: reward 1 if FILE (default answer.txt) holds exactly the answer,
else 0, printed as the last stdout line {"reward": ..., "info": {...}}.

Where it runs. Under the rollout's jail (rollout.agent_sandbox, stages/agentflow/jail.py) /tmp is a
private tmpfs per trajectory, so the working directory is the same path, /tmp/claude-code/work, in
every trajectory: Claude Code writes its working directory into its system prompt, and a fixed one
keeps that prompt the same from one trajectory to the next (the model is not shown random names).
Unjailed, a /tmp/claude-code that exists already (another trajectory's) means a fresh temporary
directory instead. HOME is home/ beside work/, holding only the settings Claude Code needs to start
without asking (onboarding done).

Claude Code's own switches keep it on loopback: no telemetry, error reports, update checks or other
non-essential traffic; its only tool is Bash (`--tools Bash`), allowed without asking
(`--allowedTools Bash`); sessions are not saved. `claude` is found as $LOONGSAGE_CLAUDE, then the
pinned install of tests/harness/install.sh (.cache/harness/node_modules/.bin/claude), then PATH.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = Path("/tmp/claude-code")          # work/ (the task's directory) and home/ (Claude Code's HOME)
QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_BUG_COMMAND": "1"}


def claude_binary() -> str:
    for cand in (os.environ.get("LOONGSAGE_CLAUDE"), str(ROOT / ".cache/harness/node_modules/.bin/claude"),
                 shutil.which("claude")):
        if cand and os.access(cand, os.X_OK):
            return cand
    sys.exit("claude not found: run tests/harness/install.sh, or set LOONGSAGE_CLAUDE")


def base_dir() -> Path:
    """The fixed directory where it is free (always in a jail: /tmp is the trajectory's own), else a fresh one."""
    try:
        BASE.mkdir()
        return BASE
    except FileExistsError:
        return Path(tempfile.mkdtemp(prefix="claude-code-"))


def claude_argv(claude: str, task: str) -> list[str]:
    return [claude, "-p", task, "--model", "loongsage", "--tools", "Bash", "--allowedTools", "Bash",
            "--no-session-persistence"]


def claude_env(home: Path, max_tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "ANTHROPIC_AUTH_TOKEN")}
    return env | QUIET | {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                          "ANTHROPIC_SMALL_FAST_MODEL": "loongsage", "NO_PROXY": "127.0.0.1,localhost",
                          "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_tokens)}


def check(work: Path, file: str, answer: str) -> float:
    """The task's checker: the file holds the answer (surrounding whitespace aside)."""
    path = work / file
    return float(path.is_file() and path.read_text(errors="replace").strip() == answer.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="answer.txt", help="the file the checker reads, in the working directory")
    ap.add_argument("--max-tokens", type=int, default=96, help="the completion budget Claude Code asks per call")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds Claude Code may run")
    args = ap.parse_args()
    sample = json.loads(os.environ.get("LOONGSAGE_SAMPLE") or "{}")
    task, answer = sample.get("prompt") or "", sample.get("answer") or ""
    if not task:
        sys.exit("LOONGSAGE_SAMPLE has no prompt")
    base = base_dir()
    work, home = base / "work", base / "home"
    try:
        work.mkdir()
        home.mkdir()
        (home / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True}))
        proc = subprocess.run(claude_argv(claude_binary(), task), cwd=work, env=claude_env(home, args.max_tokens),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=args.timeout)
        reward = check(work, args.file, answer)
        print(proc.stderr[-2000:], file=sys.stderr)
        if proc.returncode != 0:
            sys.exit(f"claude exited {proc.returncode}: {proc.stdout[-1000:]}")
        files = sorted(p.name for p in work.iterdir())
        print(json.dumps({"reward": reward, "info": {"files": files[:20], "said": proc.stdout.strip()[-300:]}}))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
