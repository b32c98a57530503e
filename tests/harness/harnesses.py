"""How the harness tier starts each real program against the proxy: command, environment, config files.

Every program runs with HOME (and XDG dirs) in a fresh temp directory holding only the config we
write, with its telemetry, update checks and other network calls off through its own switches, and
its model endpoint set to the served proxy on loopback. docs/harnesses-running.md says the same for
users.
"""
from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "agents"))
import harness_task  # noqa: E402  (the settings a user writes, trimmed prompts: one source with the recipes)

BIN = ROOT / ".cache" / "harness" / "node_modules" / ".bin"
OUTPUT = "loongsage-ok"
TASK = f"Run the shell command `echo {OUTPUT}` and tell me what it printed."
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass
class Harness:
    name: str
    argv: Callable[[str, str, Path], list[str]]           # (base_url, key, home) -> command line
    env: Callable[[str, str, Path], dict] = lambda b, k, h: {}
    files: Callable[[str, str, Path], dict] = lambda b, k, h: {}   # path under home -> text
    tool: str = "bash"                                     # the tool the model calls, and its arguments
    args: Callable[[str], dict] = lambda cmd: {"command": cmd}
    final_call: str = ""                                   # the final turn is this command's call (mini)
    answer: str = f"The command printed {OUTPUT}."
    side_calls: bool = False                               # makes calls besides its main loop (titles, quota)
    outputs: tuple = ()                                    # how it shows a tool's result (warm.py; () = the usual)
    pool: tuple = ()                                       # more such, four drawn anew each warm step
    held: tuple = ()                                       # more such, checked but never taught
    extra: dict = field(default_factory=dict)


def base_env(home: Path) -> dict:
    """What every harness process gets: a private HOME, no proxies, no inherited API credentials."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "SYSTEMROOT", "TMPDIR")}
    return keep | {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                   "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache"),
                   "XDG_STATE_HOME": str(home / ".local/state"), "NO_PROXY": "127.0.0.1,localhost", "CI": "1",
                   "PYTHONPATH": str(ROOT)}


MINI = Harness(
    "mini-swe-agent",
    argv=lambda b, k, h: [sys.executable, "-m", "minisweagent.run.mini", "-y", "--exit-immediately", "-t", TASK,
                          "-m", "openai/loongsage", "-c", "mini.yaml", "-c", f"model.model_kwargs.api_base={b}",
                          "-c", "agent.step_limit=4", "-o", str(h / "traj.json")],
    env=lambda b, k, h: {"OPENAI_API_KEY": k, "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1",
                         "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                         "LITELLM_TELEMETRY": "False"},
    final_call=SUBMIT,
)

AGENTS_SDK = Harness(
    "openai-agents",
    argv=lambda b, k, h: [sys.executable, str(Path(__file__).with_name("agents_sdk_agent.py")), TASK],
    env=lambda b, k, h: {"OPENAI_BASE_URL": b, "OPENAI_API_KEY": k, "OPENAI_AGENTS_DISABLE_TRACING": "1"},
    tool="run_shell",
)

# the completion budget each CLI asks for, set through its own model settings (the proxy clamps a larger one)
MAX_OUT = 96


def _pi_models(b: str, k: str, h: Path) -> dict:
    provider = {"baseUrl": b, "api": "openai-completions", "apiKey": k,
                "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
                "models": [{"id": "loongsage", "contextWindow": 32768, "maxTokens": MAX_OUT}]}
    return {".pi/agent/models.json": json.dumps({"providers": {"loongsage": provider}})}


PI = Harness(
    "pi",
    argv=lambda b, k, h: [str(BIN / "pi"), "-p", "--provider", "loongsage", "--model", "loongsage", "--no-session",
                          "--offline", "--no-extensions", "--no-skills", "--no-context-files", TASK],
    env=lambda b, k, h: {"PI_OFFLINE": "1", "PI_TELEMETRY": "0", "PI_SKIP_VERSION_CHECK": "1"},
    files=_pi_models, side_calls=True,
)


OPENCODE_ENV = harness_task.OPENCODE_ENV
OPENCODE_ARGV = lambda b, k, h: harness_task.HARNESSES["opencode-chat"][2](TASK)  # noqa: E731
# opencode's bash tool shows a command's output as it is
OPENCODE_CHAT = Harness("opencode-chat", argv=OPENCODE_ARGV, env=lambda b, k, h: OPENCODE_ENV,
                        files=harness_task.opencode_files("@ai-sdk/openai-compatible"), side_calls=True,
                        args=lambda cmd: {"command": cmd, "description": "Print the word"}, outputs=("{out}\n",))
OPENCODE_RESPONSES = Harness("opencode-responses", argv=OPENCODE_ARGV, env=lambda b, k, h: OPENCODE_ENV,
                             files=harness_task.opencode_files("@ai-sdk/openai"), side_calls=True,
                             args=lambda cmd: {"command": cmd, "description": "Print the word"}, outputs=("{out}\n",))


# Codex's exec_command result: a random chunk id and the wall time vary per run, so the answer is taught after
# two fixed ones and four a step drawn from 64 more, and checked after eight others it is never taught (fixed by
# a seed: the warm is cached by its examples). Greedy answers to unseen ones: 21 of 30 right when taught after the
# two fixed ones alone, 58 of 60 after eight fixed ones and the check, 240 of 240 as now (benchmarks/harness_warm.py).
def codex_output(rng: random.Random) -> str:
    """One exec_command result as Codex shows it, its chunk id and wall time drawn from `rng`."""
    return (f"Chunk ID: {rng.getrandbits(24):06x}\nWall time: {rng.random() * 0.05:.4f} seconds\nProcess exited "
            "with code 0\nOriginal token count: 4\nOutput:\n{out}\n")


_RNG = random.Random(0)
CODEX_OUTPUTS, CODEX_POOL, CODEX_HELD = (tuple(codex_output(_RNG) for _ in range(n)) for n in (2, 64, 8))


CODEX = Harness(
    "codex",
    argv=lambda b, k, h: harness_task.HARNESSES["codex"][2](TASK),
    env=lambda b, k, h: {"LOONGSAGE_API_KEY": k, "CODEX_HOME": str(h / ".codex")},
    files=harness_task.codex_files, tool="exec_command", args=lambda cmd: {"cmd": cmd}, outputs=CODEX_OUTPUTS,
    pool=CODEX_POOL, held=CODEX_HELD,
)


CLAUDE = Harness(
    "claude-code",
    argv=lambda b, k, h: harness_task.HARNESSES["claude-code"][2](TASK),     # --tools Bash: its shell tool only
    env=lambda b, k, h: harness_task.claude_env(b, k, h) | {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUT)},
    files=harness_task.claude_files,
    tool="Bash", args=lambda cmd: {"command": cmd, "description": "Print the word"}, side_calls=True,
)

ALL = {h.name: h for h in (MINI, AGENTS_SDK, PI, OPENCODE_CHAT, OPENCODE_RESPONSES, CODEX, CLAUDE)}
