"""What a proxy call is part of (stages/agentflow/session.py: main | compaction | subagent | side), in one place.

A call may name it with `x-loongsage-request-kind` (always wins) and, for one subagent among several,
`x-loongsage-agent-id`; else the harness's own signals say (the table in docs/harnesses.md, read from requests the
real programs sent, tests/fixtures/harness_requests/), else it is main. A `side` call (opencode's session title) is
not the agent's work: its own segment, not trained by default.
"""
from __future__ import annotations

from stages.agentflow.config import KINDS
from stages.agentflow.protocol import bad, loads

KIND_HEADER = "x-loongsage-request-kind"
AGENT_HEADER = "x-loongsage-agent-id"
SYSTEM_PROMPT_KINDS = (     # how a system prompt opens -> the kind of call it makes
    ("You are a title generator", "side"),                      # opencode: the session's title
    ("You are a context summarization agent", "compaction"),    # opencode: summary that replaces history
    ("You are a context summarization assistant", "compaction"),  # pi: compaction and branch summaries
)


def request_kind(headers, messages: list[dict] | None) -> tuple[str, str]:
    """(kind, agent id) of a call; a request-kind header this proxy does not know is a 400."""
    kind = (headers.get(KIND_HEADER) or "").strip().lower()
    agent = (headers.get(AGENT_HEADER) or "").strip()
    if kind and kind not in KINDS:
        raise bad(f"header {KIND_HEADER}: {kind!r} is not one of {', '.join(KINDS)}", "headers")
    if kind:
        return kind, agent
    claude = (headers.get("x-claude-code-agent-id") or "").strip()     # on a Claude Code subagent's calls
    system = messages[0].get("content") if messages and messages[0].get("role") == "system" else None
    system = system.lstrip() if isinstance(system, str) else ""
    found = ("subagent", claude) if claude else _codex(headers) or next(
        ((kind, "") for opening, kind in SYSTEM_PROMPT_KINDS if system.startswith(opening)), None)
    return (found[0], agent or found[1]) if found else ("main", agent)


def _codex(headers) -> tuple[str, str] | None:
    sub = (headers.get("x-openai-subagent") or "").strip()
    if sub:
        return ("compaction", "") if sub in ("compact", "compaction") else ("subagent", sub)
    meta = loads(headers.get("x-codex-turn-metadata") or "{}", None)
    if not isinstance(meta, dict):
        return None
    if meta.get("request_kind") in ("compaction", "compact"):
        return "compaction", ""
    name = meta.get("agent_name")
    if meta.get("subagent_kind") or (isinstance(name, str) and name not in ("", "/root")):    # /root: the main agent
        return "subagent", str(name or meta.get("thread_id") or "")
    return None
