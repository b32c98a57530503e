"""A black-box trajectory as the proxy records it: calls in, a tree of token segments out.

Every model call of one trajectory lands here. A call's prompt (chat-template text, or
completion text / ids) is matched against the streams recorded so far (the "tips": one
per choice of every recent call). If it extends a tip, the new prompt is that tip's ids
plus the tokens of the new text only, so the model's earlier tokens are reused, never
re-tokenised. If it extends none (the agent edited or summarised its history, or a chat
template that rewrites earlier turns, e.g. dropping their <think> reasoning), the longest
run of a tip's recorded tokens whose text starts the prompt is kept as it was recorded and
only the rest is tokenized: the call starts a new segment from there.

Segments form a tree (`Session.tree`). A call says what it is with the request-kind header
`x-loongsage-request-kind: main | compaction | subagent | side` (KIND_HEADER) and, for one
subagent among several, `x-loongsage-agent-id: NAME`; without it, the harness's own signals say
(stages/agentflow/harness.py: Claude Code's agent id, Codex's turn metadata, title and summary
prompts); without either, the call is main. A call continues the segment whose tip it extends if
it is of the same kind and agent; otherwise it starts one:

    compaction   the agent asks for a summary of its history: a child of the segment it extends
    main after a compaction   follows the compaction segment (its prompt holds the summary)
    subagent     its first call hangs off the latest main segment; later calls extend it
    side         a call the harness makes for itself (a title): its own segment, not trained by default
    a branch     (history not an extension) a child of the segment it branched from

Harnesses send the history back re-serialised (tool-call arguments as `{"command":"x"}` where the
model wrote `{"command": "x"}`; reasoning split into `reasoning_content`; an Anthropic tool_use's
input as an object). `restore` puts back what the proxy sent, per tool-call id and per reply, where
it means the same, so the history still extends the recorded tokens.

Each segment records its parent, kind, agent and token span (`start`: tokens shared with
the stream it branched from); its row is its last call's stream (choice 0), whose prompt is
the segment's first prompt, so tokens another segment trains are never trained twice. The
rollout turns every segment of a trained kind (rollout.train_segments) into its own row.

Assembling a prompt has no side effect: the proxy checks its length first, and only a call
it admits (`admit`) counts as a turn and takes its place in the tree.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from stages.agentflow.chat import cut_at_stop, decode, decode_continuation, encode, split_reasoning
from stages.agentflow.config import KINDS
from stages.agentflow.harness import harness_kind
from stages.agentflow.limits import raise_if_failed
from stages.agentflow.protocol import custom_input
from stages.agentflow.stream import TokenStream

MAX_TIPS = 64   # recent streams kept as extension candidates; older ones are dropped
KIND_HEADER = "x-loongsage-request-kind"   # main | compaction | subagent: what a call is part of
AGENT_HEADER = "x-loongsage-agent-id"      # names one subagent among several (optional)
MAX_SAID = 4096     # tool calls and replies remembered per trajectory, to restore a re-serialised history


class KindError(ValueError):
    """A request-kind header with a value this proxy does not know."""


def request_kind(headers, messages: list[dict] | None = None) -> tuple[str, str]:
    """(kind, agent id) of a call: its request-kind header, else the harness's own signals, else main."""
    kind = (headers.get(KIND_HEADER) or "").strip().lower()
    agent = (headers.get(AGENT_HEADER) or "").strip()
    if not kind:
        found = harness_kind(headers, messages)
        if found is not None:
            return found[0], agent or found[1]
        kind = "main"
    if kind not in KINDS:
        raise KindError(f"header {KIND_HEADER}: {kind!r} is not one of {', '.join(KINDS)}")
    return kind, agent


class TurnLimitReached(RuntimeError):
    pass


class BudgetSpent(TurnLimitReached):
    """The trajectory's token budget (rollout.max_trajectory_tokens) is spent: it ends as the turn limit ends it."""


MAX_NOTES = 64  # notes kept per trajectory (the same note is kept once)


def turn_seed(seed: int, turn: int, choice: int = 0) -> int:
    """The sampling seed of one model call (and choice) of a trajectory seeded `seed`: the first
    call uses `seed` itself; later turns and other choices must not replay its random stream."""
    return (seed + turn * 2 ** 40 + choice * 2 ** 24) % 2 ** 62


@dataclass
class Choice:
    stream: TokenStream       # the whole stream after this call (prompt, context, this completion)
    ids: list[int]            # this completion's ids (after any stop-string cut)
    logprobs: list[float]
    versions: list[int]
    text: str                 # what the agent sees (special tokens skipped)
    finish_reason: str        # stop | length
    status: str               # engine status: completed | truncated | aborted
    engine_s: float           # time this call waited on the engine


@dataclass
class Prompt(TokenStream):
    """A call's prompt stream, with where it came from: the recorded tip it reuses tokens of."""
    origin: int = -1          # index in Session.tips of that tip (-1: none, every token is fresh)
    shared: int = 0           # tokens taken from it as recorded (the model's own, never re-tokenised)
    extends: bool = False     # the prompt extends the whole tip (else it branches off at `shared`)
    resent_bytes: int = 0     # bytes of the prompt text the proxy had recorded already
    segment: int = -1         # the segment the call joined (set by Session.admit)


@dataclass
class Segment:
    """One node of a trajectory's segment tree: consecutive calls that extend each other's streams."""
    id: int
    kind: str                 # main | compaction | subagent
    agent: str                # a subagent's id ("" when its calls sent none)
    parent: int               # the segment it branched from or follows (-1: the root)
    start: int                # tokens it shares with the stream it branched from; its own tokens start here
    stream: TokenStream | None = None   # its last call's stream (choice 0): the segment's training row
    calls: int = 0

    @property
    def span(self) -> tuple[int, int]:
        return self.start, len(self.stream.ids) if self.stream is not None else self.start


class Session:
    def __init__(self, client, tok, sampling: dict, max_turns: int = 0, max_tokens: int = 0):
        self.client, self.tok, self.sampling, self.max_turns = client, tok, sampling, max_turns
        self.max_tokens = max_tokens    # completion tokens this trajectory may generate in all; 0 = no budget
        self.generated = 0              # completion tokens generated so far (every choice)
        self.notes: list[str] = []      # what its requests asked that was accepted, not honoured (recorded)
        self.said_args: dict[str, str] = {}                 # tool-call id -> its arguments as the model wrote them
        self.said: dict[tuple[str | None, str], str] = {}   # (reasoning, text) of a reply -> its content as sent
        self.tips: list[TokenStream] = []
        self.tip_segs: list[int] = []         # the segment each tip belongs to
        self.tree: list[Segment] = []
        self.final: Choice | None = None
        self.transcript: list[dict] = []
        self.calls = 0
        self.gen_s = 0.0
        self.reused_tokens = self.fresh_tokens = self.resent_bytes = 0
        self.truncated = False      # the turn limit cut the agent off
        self.closed = False

    @property
    def segments(self) -> int:
        return len(self.tree)

    def note(self, *notes: str) -> None:
        """Record what a request asked that the proxy accepted without honouring (each note once)."""
        for n in notes:
            if n not in self.notes and len(self.notes) < MAX_NOTES:
                self.notes.append(n)

    # ---- a history sent back re-serialised ------------------------------------------------------
    def remember(self, content: str | None, calls: list[dict], ids: list[str] | None = None) -> None:
        """What a reply gave the harness: its content (as sent) and each tool call's arguments as the model
        wrote them, under the ids the harness knows them by (`ids`, default the calls' own)."""
        if len(self.said_args) > MAX_SAID or len(self.said) > MAX_SAID:
            self.said_args.clear()
            self.said.clear()
        for c, cid in zip(calls, ids or [c["id"] for c in calls]):
            self.said_args[cid] = c["function"]["arguments"]
        if content:
            self.said[split_reasoning(content, None)] = content

    def restore(self, messages: list[dict]) -> list[dict]:
        """The history with the proxy's own replies put back as sent where the harness re-serialised them:
        a tool call's arguments (same JSON value, other spacing), an assistant turn's content (the same
        reasoning and text, reasoning sent apart as `reasoning_content` or the text trimmed)."""
        out = []
        for m in messages:
            if m.get("role") == "assistant":
                m = self._restored(m)
            out.append(m)
        return out

    def _restored(self, m: dict) -> dict:
        sent = self.said.get(split_reasoning(m.get("content") or "", m.get("reasoning_content")))
        if sent is not None and (sent != m.get("content") or "reasoning_content" in m):
            m = {k: v for k, v in m.items() if k != "reasoning_content"} | {"content": sent}
        if m.get("tool_calls"):
            m = m | {"tool_calls": [self._restored_call(c) for c in m["tool_calls"]]}
        return m

    def _restored_call(self, call: dict) -> dict:
        fn = call.get("function") or {}
        raw = self.said_args.get(call.get("id"))
        args = fn.get("arguments")
        if raw is None or raw == args or not (_same_json(raw, args) or _same_custom_input(raw, args)):
            return call
        return call | {"function": fn | {"arguments": raw}}

    def tokens_left(self) -> int | None:
        """Completion tokens left in the trajectory's budget (None: no budget)."""
        return max(self.max_tokens - self.generated, 0) if self.max_tokens else None

    # ---- prompt assembly -----------------------------------------------------------
    def base_for_text(self, text: str) -> Prompt:
        """The stream a prompt text continues: a recorded tip plus the new text's tokens; or, when no tip's
        text is a prefix of it (edited history, a template that rewrites earlier turns), the longest run of
        some tip's tokens whose text starts it, plus the rest tokenized: a new segment from there."""
        full = [i for i, t in enumerate(self.tips) if text.startswith(t.text)]
        if full:
            best = max(full, key=lambda i: len(self.tips[i].text))
            k, head = len(self.tips[best].ids), self.tips[best].text
        else:
            best = max(range(len(self.tips)), key=lambda i: _common_chars(self.tips[i].text, text), default=-1)
            k, head = self._tokens_within(self.tips[best], text) if best >= 0 else (0, "")
        if k == 0:
            return Prompt(encode(self.tok, text), text)
        tip = self.tips[best]
        rest = text[len(head):]
        if k == len(tip.ids):       # extends the whole tip: its records carry over (model tokens stay trained)
            base = Prompt(list(tip.prompt_ids), tip.text, list(tip.response_ids), list(tip.logprobs),
                          list(tip.versions), list(tip.loss_mask), origin=best, shared=k, extends=True)
            base.add_context(encode(self.tok, rest), rest)
        else:                       # branches off: the shared tokens as recorded, then the rest fresh
            base = Prompt(tip.ids[:k] + encode(self.tok, rest), text, origin=best, shared=k)
        base.resent_bytes = len(head.encode())
        return base

    def _tokens_within(self, tip: TokenStream, text: str) -> tuple[int, str]:
        """The most leading tokens of `tip` whose decoded text starts `text` (binary search on the count;
        a cut inside a multi-byte character decodes to U+FFFD and does not match)."""
        lo, hi, head = 0, len(tip.ids), ""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            piece = decode(self.tok, tip.ids[:mid])
            if text.startswith(piece):
                lo, head = mid, piece
            else:
                hi = mid - 1
        return lo, head

    def base_for_ids(self, ids: list[int]) -> Prompt:
        """Token-in prompts (completions with a list of ids) match tips id for id: the longest common prefix."""
        best, k = -1, 0
        for i, t in enumerate(self.tips):
            n = _common_ids(t.ids, ids)
            if n > k:
                best, k = i, n
        if best < 0:
            return Prompt(list(ids), self.tok.decode(ids, skip_special_tokens=False))
        tip = self.tips[best]
        if k == len(tip.ids):
            base = Prompt(list(tip.prompt_ids), tip.text, list(tip.response_ids), list(tip.logprobs),
                          list(tip.versions), list(tip.loss_mask), origin=best, shared=k, extends=True)
            delta = list(ids[k:])
            base.add_context(delta, decode_continuation(self.tok, tip.ids, delta))
        else:
            base = Prompt(list(ids), self.tok.decode(ids, skip_special_tokens=False), origin=best, shared=k)
        return base

    # ---- generation ----------------------------------------------------------------
    def admit(self, base: TokenStream, kind: str = "main", agent: str = "") -> int:
        """Count a call whose prompt is `base` and place it in the segment tree (its segment's id), or
        refuse it past the turn limit. A call continues the segment of the tip it extends when it is of the
        same kind (and subagent id); otherwise it starts a segment: after a compaction call, a main call
        follows the compaction segment (its prompt holds the summary); a branch's parent is the segment it
        branched from; a subagent's first call hangs off the latest main segment."""
        if self.closed:
            raise RuntimeError("the trajectory has ended")
        if self.max_turns and self.calls >= self.max_turns:
            self.truncated = True
            raise TurnLimitReached(f"turn limit reached: this trajectory may make {self.max_turns} model calls")
        if self.tokens_left() == 0:
            self.truncated = True
            raise BudgetSpent(f"token budget spent: this trajectory may generate {self.max_tokens} tokens "
                              f"(rollout.max_trajectory_tokens)")
        self.calls += 1
        origin = getattr(base, "origin", -1)
        shared = getattr(base, "shared", 0) if origin >= 0 else 0
        self.reused_tokens += shared
        self.fresh_tokens += len(base.ids) - shared
        self.resent_bytes += getattr(base, "resent_bytes", 0)
        seg = self.tree[self.tip_segs[origin]] if origin >= 0 else None
        if seg is not None and getattr(base, "extends", False) and (seg.kind, seg.agent) == (kind, agent):
            seg.calls += 1
            base.segment = seg.id
            return seg.id
        if base.response_ids:   # a new segment's row starts at its first prompt: what it inherits is not
            base.prompt_ids, base.response_ids = base.ids, []   # trained again (its own segment trains it)
            base.logprobs, base.versions, base.loss_mask = [], [], []
        last = self.tree[-1] if self.tree else None
        if kind == "main" and last is not None and last.kind == "compaction":
            parent = last.id
        elif seg is not None:
            parent = seg.id
        elif kind == "subagent":
            parent = next((s.id for s in reversed(self.tree) if s.kind == "main"), -1)
        else:
            parent = last.id if last is not None else -1
        new = Segment(len(self.tree), kind, agent, parent, shared, calls=1)
        self.tree.append(new)
        base.segment = new.id
        return new.id

    async def complete(self, base: TokenStream, n: int, max_tokens: int, temperature: float, top_p: float,
                       stop: list[str], seed: int | None = None) -> list[Choice]:
        """Generate `n` choices continuing `base` (the call was admitted) and record them as tips."""
        req = {**self.sampling, "prompt_ids": base.ids, "max_new_tokens": max_tokens,
               "temperature": temperature, "top_p": top_p}
        t0 = time.perf_counter()
        if seed is not None:                  # the agent's own seed: choice i samples with seed + i
            reqs = [req | {"seed": seed + i} for i in range(n)]
        elif "seed" in self.sampling:         # the rollout's per-sample seed, spread over calls and choices
            reqs = [req | {"seed": turn_seed(self.sampling["seed"], self.calls - 1, i)} for i in range(n)]
        else:
            reqs = [req] * n
        outs = await self.client.generate(reqs)
        for out in outs:        # a row the engine refused (the proxy's checks should have caught it)
            raise_if_failed(out)
        engine_s = time.perf_counter() - t0
        self.gen_s += engine_s
        choices = [self._choice(base, out, stop, engine_s) for out in outs]
        self.generated += sum(len(c.ids) for c in choices)
        sid = getattr(base, "segment", -1)
        if sid < 0:         # a caller that skipped admit(): the call continues the latest segment
            sid = self.tree[-1].id if self.tree else self.admit(base)
        self.tips = (self.tips + [c.stream for c in choices])[-MAX_TIPS:]
        self.tip_segs = (self.tip_segs + [sid] * len(choices))[-MAX_TIPS:]
        if not self.closed:
            if self.tree[sid].kind != "side" or self.final is None:    # a title call is not the trajectory's end
                self.final = choices[0]
            self.tree[sid].stream = choices[0].stream
        return choices

    def _choice(self, base: TokenStream, out: dict, stop: list[str], engine_s: float) -> Choice:
        ids, stopped = cut_at_stop(self.tok, base.ids, out["response_ids"], stop, keep_stop=False)
        k = len(ids)
        stream = base.copy()
        stream.add_model(ids, out["logprobs"][:k], out["versions"][:k], decode_continuation(self.tok, base.ids, ids))
        status = "completed" if stopped else out["status"]
        text = decode_continuation(self.tok, base.ids, ids, skip_special=True)
        return Choice(stream, ids, out["logprobs"][:k], out["versions"][:k], text,
                      "stop" if status == "completed" else "length", status, engine_s)

    # ---- the trajectory ----------------------------------------------------------------
    @property
    def status(self) -> str:
        if self.truncated:
            return "truncated"
        return self.final.status if self.final else "failed"

    def rows(self) -> list[Segment]:
        """The segments that have a recorded stream, in the order they started."""
        return [s for s in self.tree if s.stream is not None]

    def kind_counts(self) -> dict[str, int]:
        return {k: sum(s.kind == k for s in self.tree) for k in KINDS}

    def close(self) -> None:
        self.closed = True


def _same_json(a, b) -> bool:
    """Whether two tool-call arguments (JSON texts, or a decoded value) mean the same JSON value."""
    try:
        a = json.loads(a) if isinstance(a, str) else a
        b = json.loads(b) if isinstance(b, str) else b
    except ValueError:
        return False
    return a == b


def _same_custom_input(raw: str, args) -> bool:
    """A custom tool's call sent back as {"input": X} (stages/agentflow/responses_api.py) for a call whose
    input we read as X from the model's own arguments `raw`."""
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return False
    return isinstance(value, dict) and list(value) == ["input"] and value["input"] == custom_input(raw)


def _common_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (binary search on C-level startswith)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_ids(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
