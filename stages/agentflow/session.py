"""A black-box trajectory as the proxy records it: calls in, one token stream out.

Every model call of one trajectory lands here. A call's prompt (chat-template text, or
completion text / ids) is matched against the streams recorded so far (the "tips": one
per choice of every recent call). If it extends a tip, the new prompt is that tip's ids
plus the tokens of the new text only, so the model's earlier tokens are reused, never
re-tokenised. If it extends none (the agent edited or summarised its history, or the
chat template is not append-only), the call starts a new segment from scratch; segments
are counted. The trajectory a row trains on is the stream of the last call (choice 0).

Assembling a prompt has no side effect: the proxy checks its length first, and only a call
it admits (`admit`) counts as a turn and, if it extends no recorded stream, as a segment.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from stages.agentflow.chat import cut_at_stop, decode_continuation, encode
from stages.agentflow.limits import raise_if_failed
from stages.agentflow.stream import TokenStream

MAX_TIPS = 64   # recent streams kept as extension candidates; older ones are dropped
KIND_HEADER = "x-loongsage-request-kind"   # main | compaction | subagent: what a call is part of
AGENT_HEADER = "x-loongsage-agent-id"      # names one subagent among several (optional)
KINDS = ("main", "compaction", "subagent")


class KindError(ValueError):
    """A request-kind header with a value this proxy does not know."""


def request_kind(headers) -> tuple[str, str]:
    """(kind, agent id) of a call, from its headers; no header means the main agent."""
    kind = (headers.get(KIND_HEADER) or "main").strip().lower()
    if kind not in KINDS:
        raise KindError(f"header {KIND_HEADER}: {kind!r} is not one of {', '.join(KINDS)}")
    return kind, (headers.get(AGENT_HEADER) or "").strip()


class TurnLimitReached(RuntimeError):
    pass


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


class Session:
    def __init__(self, client, tok, sampling: dict, max_turns: int = 0):
        self.client, self.tok, self.sampling, self.max_turns = client, tok, sampling, max_turns
        self.tips: list[TokenStream] = []
        self.final: Choice | None = None
        self.transcript: list[dict] = []
        self.calls = self.segments = 0
        self.gen_s = 0.0
        self.truncated = False      # the turn limit cut the agent off
        self.closed = False

    # ---- prompt assembly -----------------------------------------------------------
    def base_for_text(self, text: str) -> TokenStream:
        """The stream a prompt text continues: a recorded tip plus the new text's tokens, or a new segment."""
        best = max((t for t in self.tips if text.startswith(t.text)), key=lambda t: len(t.text), default=None)
        if best is None:
            return TokenStream(encode(self.tok, text), text)
        base = best.copy()
        delta = text[len(best.text):]
        base.add_context(encode(self.tok, delta), delta)
        return base

    def base_for_ids(self, ids: list[int]) -> TokenStream:
        """Token-in prompts (completions with a list of ids) match tips id for id."""
        best = max((t for t in self.tips if ids[: len(t.ids)] == t.ids), key=lambda t: len(t.ids), default=None)
        if best is None:
            return TokenStream(list(ids), self.tok.decode(ids, skip_special_tokens=False))
        base = best.copy()
        delta = list(ids[len(best.ids):])
        base.add_context(delta, decode_continuation(self.tok, best.ids, delta))
        return base

    # ---- generation ----------------------------------------------------------------
    def admit(self, base: TokenStream, kind: str = "main", agent: str = "") -> None:
        """Count a call whose prompt is `base` (and a segment if it extends no recorded stream),
        or refuse it past the turn limit."""
        if self.closed:
            raise RuntimeError("the trajectory has ended")
        if self.max_turns and self.calls >= self.max_turns:
            self.truncated = True
            raise TurnLimitReached(f"turn limit reached: this trajectory may make {self.max_turns} model calls")
        self.calls += 1
        ids = base.ids
        if not any(len(t.ids) <= len(ids) and ids[: len(t.ids)] == t.ids for t in self.tips):
            self.segments += 1

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
        self.tips = (self.tips + [c.stream for c in choices])[-MAX_TIPS:]
        if not self.closed:
            self.final = choices[0]
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

    def close(self) -> None:
        self.closed = True
