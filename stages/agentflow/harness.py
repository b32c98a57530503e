"""What a proxy call is part of (stages/agentflow/session.py: main | compaction | subagent | side), in one place.

A call may name it with `x-loongsage-request-kind` (always wins) and, for one subagent among several,
`x-loongsage-agent-id`; else the harness's own signals say, else it is main:

    Claude Code   `x-claude-code-agent-id: ID` on a subagent's calls           -> subagent ID
    Codex CLI     `x-codex-turn-metadata` (JSON): request_kind compaction     -> compaction
                  ... subagent_kind set, or agent_name other than /root       -> subagent (agent_name)
                  `x-openai-subagent: NAME` (compact -> compaction)           -> subagent NAME
    opencode      system prompt "You are a title generator"                   -> side (a title for its UI)
    opencode, pi  system prompt "You are a context summarization ..."        -> compaction

A `side` call is not part of the agent's work: its own segment, not trained by default. The system prompts were
read from requests the real programs sent (tests/fixtures/harness_requests/).
"""
from __future__ import annotations

import json

from stages.agentflow.config import KINDS
from stages.agentflow.protocol import bad

KIND_HEADER = "x-loongsage-request-kind"
AGENT_HEADER = "x-loongsage-agent-id"
CLAUDE_AGENT_HEADER = "x-claude-code-agent-id"
CODEX_METADATA_HEADER = "x-codex-turn-metadata"
CODEX_SUBAGENT_HEADER = "x-openai-subagent"
CODEX_ROOT_AGENT = "/root"
SYSTEM_PROMPT_KINDS = (     # how a system prompt opens -> the kind of call it makes
    ("You are a title generator", "side"),                      # opencode: the session's title
    ("You are a context summarization agent", "compaction"),    # opencode: summary that replaces history
    ("You are a context summarization assistant", "compaction"),  # pi: compaction and branch summaries
)


def request_kind(headers, messages: list[dict] | None) -> tuple[str, str]:
    """(kind, agent id) of a call; a request-kind header this proxy does not know is a 400."""
    kind = (headers.get(KIND_HEADER) or "").strip().lower()
    agent = (headers.get(AGENT_HEADER) or "").strip()
    if not kind:
        found = _claude(headers) or _codex(headers) or _by_system_prompt(messages or [])
        return (found[0], agent or found[1]) if found else ("main", agent)
    if kind not in KINDS:
        raise bad(f"header {KIND_HEADER}: {kind!r} is not one of {', '.join(KINDS)}", "headers")
    return kind, agent


def _claude(headers) -> tuple[str, str] | None:
    agent = (headers.get(CLAUDE_AGENT_HEADER) or "").strip()
    return ("subagent", agent) if agent else None


def _codex(headers) -> tuple[str, str] | None:
    sub = (headers.get(CODEX_SUBAGENT_HEADER) or "").strip()
    if sub:
        return ("compaction", "") if sub in ("compact", "compaction") else ("subagent", sub)
    try:
        meta = json.loads(headers.get(CODEX_METADATA_HEADER) or "{}")
    except ValueError:
        return None
    if not isinstance(meta, dict):
        return None
    if meta.get("request_kind") in ("compaction", "compact"):
        return "compaction", ""
    name = meta.get("agent_name")
    if meta.get("subagent_kind") or (isinstance(name, str) and name not in ("", CODEX_ROOT_AGENT)):
        return "subagent", str(name or meta.get("thread_id") or "")
    return None


def _by_system_prompt(messages: list[dict]) -> tuple[str, str] | None:
    first = messages[0] if messages else None
    if first is None or first.get("role") != "system" or not isinstance(first.get("content"), str):
        return None
    text = first["content"].lstrip()
    return next(((kind, "") for opening, kind in SYSTEM_PROMPT_KINDS if text.startswith(opening)), None)
