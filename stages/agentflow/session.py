"""A black-box trajectory as the proxy records it: model calls in, a tree of token segments out.

`Session.call` serves one call of any protocol. A prompt reuses recorded tokens: if its text extends a recorded
stream (a "tip": one per choice of every recent call), it is that tip's ids plus the new text's tokens, so model
tokens are never re-tokenised; if it extends none (an edited history, a template that drops earlier reasoning),
the longest run of a tip's tokens whose text starts it is kept as recorded and only the rest is tokenized.

Calls form a tree of segments: a call continues the segment whose tip it extends if of the same kind and agent
(harness.py), else starts one -- a compaction hangs off the segment it extends, a main call after a compaction
follows it, a subagent's first call hangs off the latest main segment, a branch (history not an extension) off the
one it left. A segment's row is its last call's stream from its first prompt, so no token is trained twice; the
rollout makes a row of each segment of a trained kind.
"""
from __future__ import annotations

import asyncio
import json
import time
from bisect import bisect_left
from dataclasses import dataclass
from functools import cached_property, partial

from stages.agentflow.chat import (
    call_separator,
    cut_at_stop,
    decode,
    decode_continuation,
    encode,
    render,
    split_reasoning,
    tool_call_opening,
)
from stages.agentflow.config import KINDS
from stages.agentflow.harness import request_kind
from stages.agentflow.limits import PromptLimit, RequestRejected, raise_if_failed
from stages.agentflow.protocol import APIError, Generation, Request, bad, custom_input, loads, read_generation
from stages.agentflow.stream import TokenStream

MAX_TIPS = 64           # recent streams kept as extension candidates; older ones are dropped
MAX_SAID = 4096         # tool calls and replies remembered, to restore a re-serialised history
MAX_NOTES = 64          # notes kept per trajectory (the same note once)
THREAD_CHARS = 1 << 16  # a longer prompt is tokenized on a thread (_off_loop)


def turn_seed(seed: int, turn: int, choice: int = 0) -> int:
    """The sampling seed of one model call (and choice) of a trajectory seeded `seed`: the first call uses
    `seed` itself; later turns and other choices must not replay its random stream."""
    return (seed + turn * 2 ** 40 + choice * 2 ** 24) % 2 ** 62


@dataclass
class Choice:
    stream: TokenStream       # the whole stream after this call (prompt, context, this completion)
    ids: list[int]            # this completion's ids (after any stop-string cut)
    logprobs: list[float]
    text: str                 # what the harness reads (special tokens skipped)
    finish_reason: str        # stop | length, as the harness is told
    status: str               # engine status: completed | truncated | aborted
    engine_s: float           # time this call waited on the engine
    prompt_tokens: int = 0
    stop: str | None = None   # the stop string it was cut at
    gen: Generation | None = None   # its reasoning, text and tool calls
    message: dict | None = None     # its chat assistant message, content as sent (Session.call)


@dataclass
class Prompt(TokenStream):
    """A call's prompt stream, with the recorded tip it reuses tokens of."""
    origin: int = -1          # index in Session.tips of that tip (-1: none, every token is fresh)
    shared: int = 0           # tokens taken from it as recorded
    extends: bool = False     # the prompt extends the whole tip (else it branches off at `shared`)
    resent_bytes: int = 0     # bytes of the prompt text the proxy had recorded already
    segment: int = -1         # the segment the call joined (Session.admit)


@dataclass
class Segment:
    """One node of the segment tree: consecutive calls that extend each other's streams."""
    id: int
    kind: str                 # main | compaction | subagent | side
    agent: str                # a subagent's id ("" when its calls sent none)
    parent: int               # the segment it branched from or follows (-1: the root)
    start: int                # tokens it shares with the stream it branched from; its own tokens start here
    stream: TokenStream | None = None   # its last call's stream (choice 0): the segment's training row
    calls: int = 0


def assistant_message(gen: Generation, separator: str = "") -> dict:
    """A choice as a chat assistant message. Its content is the model's text byte for byte, less the
    `separator` the template writes itself before a tool call: rendered back, the turn spells the same text."""
    if not gen.calls:
        return {"role": "assistant", "content": gen.raw}
    content = gen.raw[:gen.raw.index("<tool_call>")].removesuffix(separator)
    return {"role": "assistant", "content": content or None, "tool_calls": gen.calls}


class Session:
    def __init__(self, client, tok, sampling: dict, limit: PromptLimit, max_turns: int = 0, max_tokens: int = 0,
                 force_sampling: bool = False):
        self.client, self.tok, self.sampling, self.limit = client, tok, sampling, limit
        self.max_turns, self.max_tokens = max_turns, max_tokens     # max_tokens: completion tokens in all (0: any)
        self.force_sampling = force_sampling    # the rollout's temperature, top_p and seeds override the agent's
        self.notes: list[str] = []          # what its requests asked that was accepted, not honoured
        self.said_args: dict[str, str] = {}                 # tool-call id -> its arguments as the model wrote them
        self.said: dict[tuple[str | None, str], str] = {}   # (reasoning, text) of a reply -> its content as sent
        self.responses: dict[str, list[dict]] = {}          # stored Responses (previous_response_id) -> items
        self.tips: list[TokenStream] = []
        self.tip_segs: list[int] = []       # the segment each tip belongs to
        self.tree: list[Segment] = []
        self.final: Choice | None = None
        self.transcript: list[dict] = []
        self.calls = self.generated = self.reused_tokens = self.fresh_tokens = self.resent_bytes = 0
        self.gen_s = 0.0
        self.truncated = self.closed = False    # truncated: the turn limit or the token budget cut the agent off

    separator = cached_property(lambda self: call_separator(self.tok))
    opening = cached_property(lambda self: tool_call_opening(self.tok) or "")

    # ---- one model call ------------------------------------------------------------------------------
    async def call(self, req: Request, headers) -> list[Choice]:
        kind, agent = request_kind(headers, req.messages)
        prefill = self._prefill(req.forced)
        if req.messages is not None:
            req.messages = self.restore(req.messages)
            req.prompt = self._render(req) + prefill
        base = await self._prompt(req)
        req.max_tokens, req.bound = self.limit.clamp(len(base.ids), req.requested, self.sampling["max_new_tokens"],
                                                     self.tokens_left())
        self.admit(base, kind, agent)
        self.note(*req.notes)
        choices = await self._complete(base, req)
        for c in choices:
            c.gen = gen = read_generation(prefill + c.text, req.tools is not None, req.reasoning and not prefill,
                                          req.call_prefix)
            gen.offset, c.message = len(prefill), assistant_message(gen, self.separator if gen.calls else "")
            if req.messages is not None:
                self.remember(c.message["content"], gen.calls)
        c = choices[0]
        if not self.closed:     # a reply with reasoning apart: as the history would send it back
            self.transcript = [{"role": "prompt", "content": base.text}, {"role": "assistant", "content": c.text}] \
                if req.messages is None else req.messages + [c.gen.turn() if req.reasoning else c.message]
        return choices

    async def count(self, req: Request) -> int:
        return len(await _off_loop(partial(encode, self.tok), self._render(req)))

    def _render(self, req: Request) -> str:
        try:
            return render(self.tok, req.messages, req.tools)
        except Exception as e:  # noqa: BLE001 - jinja raises template-specific errors for unsupported histories
            raise bad(f"the chat template cannot render these messages: {e}", req.param) from None

    def _prefill(self, forced: str | None) -> str:
        """The prompt's ending that makes the model call a tool ("" = any tool, else the named one)."""
        if forced is None:
            return ""
        if not self.opening:
            raise bad("this model's chat template writes no <tool_call> block, so a tool call cannot be forced; "
                      "use auto", "tool_choice")
        return self.opening + (json.dumps(forced) if forced else "")

    async def _prompt(self, req: Request) -> Prompt:
        """The call's prompt stream, checked against the limits before anything long is tokenized."""
        prompt, param = req.prompt, req.param
        try:
            if isinstance(prompt, list):
                vocab = len(self.tok)
                if max(prompt) >= vocab:
                    i = next(i for i, t in enumerate(prompt) if t >= vocab)
                    raise bad(f"prompt[{i}] = {prompt[i]} is not a token id: the vocabulary has {vocab} tokens "
                              f"(ids 0..{vocab - 1})", param)
                self.limit.budget(len(prompt), 0, param=param)    # the length alone, before the ids are decoded
                base = self.base_for_ids(prompt)
            elif not prompt:
                raise bad("the prompt is empty: nothing in this request is text the model can read", param)
            else:
                self.limit.check_text(prompt, param=param)    # cheap: no tokenizing of a hopeless text
                base = await _off_loop(self.base_for_text, prompt)
            self.limit.budget(len(base.ids), 0, param=param)
        except RequestRejected as e:
            raise APIError(400, str(e), e.param, e.code,
                           tokens=(e.tokens, req.requested or 0, self.limit.prompt_cap, self.limit.context)) from None
        return base

    async def _complete(self, base: Prompt, req: Request) -> list[Choice]:
        """Generate the call's choices and record them as tips."""
        own = {"temperature": self.sampling.get("temperature", 1.0), "top_p": self.sampling.get("top_p", 1.0)}
        req.temperature = own["temperature"] if req.temperature is None else req.temperature
        req.top_p = own["top_p"] if req.top_p is None else req.top_p
        # forced: the rollout's sampling and per-sample seeds (an agent's fixed seed gives a group one answer)
        seed = None if self.force_sampling else req.seed
        row = {**self.sampling, "prompt_ids": base.ids, "max_new_tokens": req.max_tokens,
               **(own if self.force_sampling else {"temperature": req.temperature, "top_p": req.top_p})}
        rows = [row | {"seed": seed + i} if seed is not None else row | {
            "seed": turn_seed(self.sampling["seed"], self.calls - 1, i)} if "seed" in self.sampling else row
            for i in range(req.n)]
        t0 = time.perf_counter()
        outs = await self.client.generate(rows)
        for out in outs:        # a row the engine refused (the checks above should have caught it)
            raise_if_failed(out)
        engine_s = time.perf_counter() - t0
        self.gen_s += engine_s
        choices = [self._choice(base, out, req.stop, engine_s) for out in outs]
        self.generated += sum(len(c.ids) for c in choices)
        self.tips = (self.tips + [c.stream for c in choices])[-MAX_TIPS:]
        self.tip_segs = (self.tip_segs + [base.segment] * len(choices))[-MAX_TIPS:]
        seg = self.tree[base.segment]
        if not self.closed:
            if seg.kind != "side" or self.final is None:    # a title call is not the trajectory's end
                self.final = choices[0]
            seg.stream = choices[0].stream
        if any(c.status == "aborted" for c in choices):
            raise APIError(503, "the engine aborted this request (the run is stopping or the window closed)",
                           kind="server_error")
        if req.bound in ("rollout", "budget") and any(c.finish_reason == "length" for c in choices):
            # our cut, not the context's nor the harness's: reported as stopped, else the harness asks the model to
            # resume; the trajectory keeps the truth (status truncated, this note; docs/harnesses.md)
            what = "sampling.max_new_tokens" if req.bound == "rollout" else "agent.max_trajectory_tokens"
            self.note(f"a completion was cut at {req.max_tokens} tokens by {what}: reported to the harness as stopped")
            for c in choices:
                c.finish_reason = "stop"
        return choices

    def _choice(self, base: Prompt, out: dict, stop: list[str], engine_s: float) -> Choice:
        ids, matched = cut_at_stop(self.tok, base.ids, out["response_ids"], stop, keep_stop=False)
        lps = out["logprobs"][:len(ids)]
        stream = base.copy()
        stream.add_model(ids, lps, out["versions"][:len(ids)], decode_continuation(self.tok, base.ids, ids))
        status = "completed" if matched is not None else out["status"]
        return Choice(stream, ids, lps, decode_continuation(self.tok, base.ids, ids, skip_special=True),
                      "stop" if status == "completed" else "length", status, engine_s, len(base.ids), matched)

    # ---- a history sent back re-serialised ------------------------------------------------------
    def remember(self, content: str | None, calls: list[dict]) -> None:
        """What a reply gave the harness: its content as sent and each tool call's arguments as the model wrote
        them, under the ids the harness knows them by."""
        if len(self.said_args) > MAX_SAID or len(self.said) > MAX_SAID:
            self.said_args.clear()
            self.said.clear()
        self.said_args.update((c["id"], c["function"]["arguments"]) for c in calls)
        if content:
            self.said[split_reasoning(content, None)] = content

    def restore(self, messages: list[dict]) -> list[dict]:
        """The history with the proxy's own replies put back as sent where the harness re-serialised them to the
        same meaning (docs/harnesses.md); a custom tool's {"input": X} matches the X read from its call."""
        return [self._restored(m) if m.get("role") == "assistant" else m for m in messages]

    def _restored(self, m: dict) -> dict:
        sent = self.said.get(split_reasoning(m.get("content") or "", m.get("reasoning_content")))
        if sent is not None and (sent != m.get("content") or "reasoning_content" in m):
            m = {k: v for k, v in m.items() if k != "reasoning_content"} | {"content": sent}
        return m | {"tool_calls": [self._restored_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m

    def _restored_call(self, call: dict) -> dict:
        fn = call.get("function") or {}
        raw, args = self.said_args.get(call.get("id")), fn.get("arguments")
        if raw is None or raw == args:
            return call
        value = loads(args, _INVALID) if isinstance(args, str) else args
        same = value is not _INVALID and value in (loads(raw, _INVALID), {"input": custom_input(raw)})
        return call | {"function": fn | {"arguments": raw}} if same else call

    # ---- prompt assembly -----------------------------------------------------------
    def base_for_text(self, text: str) -> Prompt:
        """The stream a prompt text continues, reusing a tip's tokens (the module's docstring)."""
        full = [i for i, t in enumerate(self.tips) if text.startswith(t.text)]
        if full:
            best = max(full, key=lambda i: len(self.tips[i].text))
            k, head = len(self.tips[best].ids), self.tips[best].text
        else:   # the most leading tokens of the nearest tip whose decoded text starts `text` (a cut inside a
            # multi-byte character decodes to U+FFFD and does not match)
            best = max(range(len(self.tips)), key=lambda i: _common(self.tips[i].text, text), default=-1)
            ids = self.tips[best].ids if best >= 0 else []
            k = _most(lambda k: text.startswith(decode(self.tok, ids[:k])), len(ids))
            head = decode(self.tok, ids[:k])
        rest = text[len(head):]
        base = self._from_tip(best, k, encode(self.tok, rest), rest, text)
        base.resent_bytes = len(head.encode())
        return base

    def base_for_ids(self, ids: list[int]) -> Prompt:
        """Token-in prompts (completions with a list of ids) match tips id for id: the longest common prefix."""
        best, k = max(((i, _common(t.ids, ids)) for i, t in enumerate(self.tips)), key=lambda x: x[1],
                      default=(-1, 0))
        return self._from_tip(best, k, list(ids[k:]), None, None)

    def _from_tip(self, best: int, k: int, rest: list[int], rest_text: str | None, text: str | None) -> Prompt:
        """Tip `best`'s first `k` tokens as recorded, then `rest` (tokens of `rest_text`; the text of the whole
        prompt is `text`, decoded where None). A prompt extending a whole tip keeps its records (the model's
        tokens stay trained); one branching off keeps the shared tokens only."""
        if k == 0:
            return Prompt(rest, decode(self.tok, rest) if text is None else text)
        tip = self.tips[best]
        if k < len(tip.ids):
            ids = tip.ids[:k] + rest
            return Prompt(ids, decode(self.tok, ids) if text is None else text, origin=best, shared=k)
        base = Prompt(**vars(tip.copy()), origin=best, shared=k, extends=True)
        base.add_context(rest, decode_continuation(self.tok, tip.ids, rest) if rest_text is None else rest_text)
        return base

    # ---- turns and the tree ----------------------------------------------------------------
    def admit(self, base: Prompt, kind: str, agent: str) -> None:
        """Count a call as a turn (or refuse it past the turn limit or the token budget) and place it in the tree."""
        if self.closed:
            raise RuntimeError("the trajectory has ended")
        if self.max_turns and self.calls >= self.max_turns:
            self.truncated = True
            raise bad(f"turn limit reached: this trajectory may make {self.max_turns} model calls",
                      code="turn_limit_reached")
        if self.tokens_left() == 0:
            self.truncated = True
            raise bad(f"token budget spent: this trajectory may generate {self.max_tokens} tokens "
                      f"(agent.max_trajectory_tokens)", code="trajectory_budget_spent")
        self.calls += 1
        self.reused_tokens += base.shared
        self.fresh_tokens += len(base.ids) - base.shared
        self.resent_bytes += base.resent_bytes
        seg = self.tree[self.tip_segs[base.origin]] if base.origin >= 0 else None
        if seg is not None and base.extends and (seg.kind, seg.agent) == (kind, agent):
            seg.calls += 1
            base.segment = seg.id
            return
        if base.response_ids:   # a new segment's row starts at its first prompt: what it inherits is not
            base.prompt_ids, base.response_ids = base.ids, []   # trained again (its own segment trains it)
            base.logprobs, base.versions, base.loss_mask = [], [], []
        if seg is not None and not (kind == "main" and self.tree[-1].kind == "compaction"):
            parent = seg.id
        elif kind == "subagent":
            parent = next((s.id for s in reversed(self.tree) if s.kind == "main"), -1)
        else:   # the latest segment (-1: none; an id is its index), as a main call after a compaction follows it
            parent = len(self.tree) - 1
        base.segment = len(self.tree)
        self.tree.append(Segment(base.segment, kind, agent, parent, base.shared, calls=1))

    def tokens_left(self) -> int | None:
        return max(self.max_tokens - self.generated, 0) if self.max_tokens else None

    def note(self, *notes: str) -> None:
        """Record what a request asked that the proxy accepted without honouring (each note once)."""
        for n in notes:
            if n not in self.notes and len(self.notes) < MAX_NOTES:
                self.notes.append(n)

    # ---- the trajectory ----------------------------------------------------------------
    @property
    def status(self) -> str:
        return "truncated" if self.truncated else self.final.status if self.final else "failed"

    def rows(self) -> list[Segment]:
        return [s for s in self.tree if s.stream is not None]

    def kind_counts(self) -> dict[str, int]:
        return {k: sum(s.kind == k for s in self.tree) for k in KINDS}


_INVALID = object()


async def _off_loop(fn, text: str):
    """`fn(text)`, on a thread for a long text: the loop serves other trajectories meanwhile."""
    return await asyncio.to_thread(fn, text) if len(text) > THREAD_CHARS else fn(text)


def _common(a, b) -> int:
    """Length of the longest common prefix of two strings or id lists."""
    return _most(lambda k: a[:k] == b[:k], min(len(a), len(b)))


def _most(holds, hi: int) -> int:
    """The largest k in [0, hi] for which `holds(k)`, true up to some k and false after (a binary search)."""
    return bisect_left(range(1, hi + 1), True, key=lambda k: not holds(k))
