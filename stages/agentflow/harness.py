"""Harness quirks, each in one named place: what the real CLIs send that says what a call is part of.

The proxy reads a call's kind (stages/agentflow/session.py: main | compaction | subagent | side)
from the harness's own signals when the call does not name it with `x-loongsage-request-kind`
(which always wins):

    Claude Code   `x-claude-code-agent-id: ID` on a subagent's calls           -> subagent ID
    Codex CLI     `x-codex-turn-metadata` (JSON): request_kind compaction     -> compaction
                  ... subagent_kind set, or agent_name other than /root       -> subagent (agent_name)
                  `x-openai-subagent: NAME` (compact -> compaction)           -> subagent NAME
    opencode      system prompt "You are a title generator"                   -> side (a title for its UI)
    opencode, pi  system prompt "You are a context summarization ..."        -> compaction

A `side` call (a session title, a summary for display) is not part of the agent's work: it gets
its own segment, and rollout.train_segments leaves it out by default. The system prompts were read
from requests the real programs sent (tests/fixtures/harness_requests/).
"""
from __future__ import annotations

import json

CLAUDE_AGENT_HEADER = "x-claude-code-agent-id"
CODEX_METADATA_HEADER = "x-codex-turn-metadata"
CODEX_SUBAGENT_HEADER = "x-openai-subagent"
CODEX_ROOT_AGENT = "/root"
# how a system prompt opens -> the kind of call it makes
SYSTEM_PROMPT_KINDS = (
    ("You are a title generator", "side"),                      # opencode: the session's title
    ("You are a context summarization agent", "compaction"),    # opencode: summary that replaces history
    ("You are a context summarization assistant", "compaction"),  # pi: compaction and branch summaries
)


def harness_kind(headers, messages: list[dict] | None) -> tuple[str, str] | None:
    """(kind, agent id) from a harness's own signals, or None when it sent none."""
    agent = (headers.get(CLAUDE_AGENT_HEADER) or "").strip()
    if agent:
        return "subagent", agent
    found = _codex(headers)
    if found is not None:
        return found
    return _by_system_prompt(messages or [])


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
