"""A real coding harness (Claude Code, Codex CLI or opencode), unmodified, on a file task: one trajectory.

Run by AgentFlow once per trajectory (`agent.name: "cmd:python examples/agents/harness_task.py codex"`;
configs/agent_claude_code.yaml, configs/agent_codex.yaml, configs/agent_opencode.yaml), or by hand against
`loongsage serve`:

    OPENAI_BASE_URL=... OPENAI_API_KEY=... \\
    LOONGSAGE_SAMPLE='{"prompt": "Write the word maple into the file answer.txt."}' \\
    python examples/agents/harness_task.py claude-code|codex|opencode-chat|opencode-responses

It does what a user does to point the harness at a model: writes the harness's own config into $HOME
(the endpoint from OPENAI_BASE_URL / OPENAI_API_KEY; telemetry, update checks and model lists off through
the harness's own switches; Claude Code takes its endpoint and switches from its environment, and only
the Bash tool), makes a fresh working directory ($HOME/work), runs the harness there with the task (its
shell tool runs in that directory), then reports what `answer.txt` there holds, as the last stdout
line ({"answers": [...]}, with the harness's exit status and output tail). It never sees the answer:
the recipe's reward.fn, `agent_answers`, grades the report (1 if it is exactly the answer). In a
rollout the whole process runs in the agent jail (agent.jail, stages/agentflow/sandbox/jail.py):
HOME is a private /tmp/home, and the jail holds the system's programs, the interpreter, this
directory and the harness installs (`agent.binds: [.cache/harness]`), nothing else of the
host's, so the harness's commands can change nothing but its own /tmp.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".cache" / "harness" / "node_modules" / ".bin"    # tests/harness/install.sh puts them there
ANSWER_FILE = "answer.txt"
MAX_OUT = 64            # the completion budget each harness asks for (the rollout clamps it anyway)
TIMEOUT_S = 240
JAIL_HOME = "/tmp/home"  # HOME in the agent jail (stages/agentflow/sandbox/jail.py): private, fresh per trajectory


INSTRUCTIONS = ("You are a coding agent working in the current directory. Use the shell tool to run commands; when "
                "the task is done, say so in one short sentence.\n")


def codex_files(base_url: str, key: str, home: Path) -> dict[str, str]:
    # the prompt trimmed through Codex's own settings to the agent and its shell (every call prefills it, and the
    # trainer runs every row's prompt): short instructions; no environment, permission or skills preambles,
    # web search, goals or subagent tools
    toml = f"""model = "loongsage"
model_provider = "loongsage"
model_context_window = 32768
check_for_update_on_startup = false
approval_policy = "never"
sandbox_mode = "danger-full-access"
web_search = "disabled"
model_instructions_file = "{home / '.codex' / 'instructions.md'}"
include_permissions_instructions = false
include_apps_instructions = false
include_environment_context = false
project_doc_max_bytes = 0

[features]
goals = false
multi_agent = false

[skills]
include_instructions = false

[analytics]
enabled = false

[model_providers.loongsage]
name = "LoongSage"
base_url = "{base_url}"
env_key = "LOONGSAGE_API_KEY"
wire_api = "responses"
"""
    return {".codex/config.toml": toml, ".codex/instructions.md": INSTRUCTIONS}


def opencode_files(npm: str):
    def files(base_url: str, key: str, home: Path) -> dict[str, str]:
        # the prompt trimmed through opencode's own settings: the build agent's prompt replaced, only its bash tool
        tools = {t: False for t in ("edit", "glob", "grep", "read", "skill", "task", "todowrite", "webfetch", "write")}
        cfg = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
               "model": "loongsage/loongsage", "small_model": "loongsage/loongsage", "tools": tools,
               "agent": {"build": {"prompt": INSTRUCTIONS}},
               "provider": {"loongsage": {"npm": npm, "name": "LoongSage",
                                          "options": {"baseURL": base_url, "apiKey": key},
                                          "models": {"loongsage": {"limit": {"context": 32768, "output": MAX_OUT}}}}}}
        return {".config/opencode/opencode.json": json.dumps(cfg)}
    return files


OPENCODE_ENV = {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
                "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
                "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1", "OPENCODE_PERMISSION": json.dumps({"bash": "allow"})}


def claude_files(base_url: str, key: str, home: Path) -> dict[str, str]:
    return {".claude.json": json.dumps({"hasCompletedOnboarding": True})}     # starts without asking


def claude_env(base_url: str, key: str, home: Path) -> dict[str, str]:
    # its endpoint (Messages: the base URL without /v1); telemetry, error reports, update checks and other
    # non-essential traffic off
    return {"ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": key,
            "ANTHROPIC_SMALL_FAST_MODEL": "loongsage", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUT),
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_BUG_COMMAND": "1"}


# name -> (config files, extra environment, command line for a task)
HARNESSES = {
    # --tools Bash: its shell tool alone (its default 24 tools make a ~19k-token prompt; Bash alone ~2.1k)
    "claude-code": (claude_files, claude_env,
                    lambda task: [str(BIN / "claude"), "-p", task, "--model", "loongsage", "--tools", "Bash",
                                  "--allowedTools", "Bash", "--no-session-persistence"]),
    "codex": (codex_files, lambda base_url, key, home: {"CODEX_HOME": str(home / ".codex"), "LOONGSAGE_API_KEY": key},
              lambda task: [str(BIN / "codex"), "exec", "--skip-git-repo-check", task]),
    "opencode-chat": (opencode_files("@ai-sdk/openai-compatible"), lambda base_url, key, home: OPENCODE_ENV,
                      lambda task: [str(BIN / "opencode"), "run", task]),
    "opencode-responses": (opencode_files("@ai-sdk/openai"), lambda base_url, key, home: OPENCODE_ENV,
                           lambda task: [str(BIN / "opencode"), "run", task]),
}


def answer_file(work: Path) -> str:
    """What the harness left in the working directory's answer.txt ("" if nothing), at most 1 KiB."""
    try:
        with open(work / ANSWER_FILE, errors="replace") as f:
            return f.read(1024).strip()
    except OSError:
        return ""


def run(name: str, task: str, home: Path, base_url: str, key: str) -> dict:
    files, extra_env, argv = HARNESSES[name]
    for rel, text in files(base_url, key, home).items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep} | {
        "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
        "NO_PROXY": "127.0.0.1,localhost", "CI": "1"} | extra_env(base_url, key, home)
    try:
        p = subprocess.run(argv(task), cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-600:]
    except subprocess.TimeoutExpired:
        rc, tail = None, "timed out"
    return {"answers": [answer_file(work)], "harness_exit": rc, "harness_tail": tail}


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    if name not in HARNESSES:
        sys.exit(f"usage: harness_task.py {'|'.join(HARNESSES)}")
    sample = json.loads(os.environ["LOONGSAGE_SAMPLE"])
    # jailed: the private HOME, the same path in every trajectory (so is the harness's prompt); unjailed: a fresh
    # temporary one, never the user's own (its harness config would be overwritten)
    jailed = os.environ.get("HOME") == JAIL_HOME
    home = Path(JAIL_HOME if jailed else tempfile.mkdtemp(prefix="loongsage-harness-"))
    try:
        out = run(name, sample["prompt"], home, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])
    finally:
        if not jailed:
            shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
