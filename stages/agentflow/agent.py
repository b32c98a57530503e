"""The context every agent runs in. An agent is any object with `async def run(self, ctx, sample) -> None`.

* white-box: Python code that drives the token stream itself --
      gen = await ctx.generate(stop=[...])       model turn (loss_mask=1)
      await ctx.call_tool("calculator", {...})   tool result  (loss_mask=0)
      await ctx.step(env, gen.text)               environment observation (loss_mask=0) + reward
      ctx.add_text(...) / ctx.add_messages([...]) any other context (loss_mask=0)
* black-box: a program that speaks an OpenAI or Anthropic API --
      async with ctx.openai_endpoint() as ep:     ep.base_url, ep.api_key for this trajectory
  the proxy records every call (session.py) and its segments become the trajectory's rows.

Model tokens are never re-tokenised. A turn past `max_turns` raises TurnLimitReached (the rollout keeps what was
made, `truncated`); a context over the limits raises ContextLengthExceeded (limits.py), which fails the
trajectory. A turn gets the budget the context leaves, unless it asks `max_new_tokens` itself, which must fit.
"""
from __future__ import annotations

import asyncio
import math
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from stages.agentflow.chat import cut_at_stop, decode_continuation, encode, normalise_messages, render
from stages.agentflow.config import KINDS
from stages.agentflow.limits import PromptLimit, raise_if_failed
from stages.agentflow.session import Segment, turn_seed
from stages.agentflow.stream import TokenStream
from stages.agentflow.tools import BUILTIN_TOOLS, ToolRegistry


class TurnLimitReached(RuntimeError):
    pass


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    status: str           # completed | truncated | aborted
    text: str             # the turn's text, special tokens skipped
    stopped: bool = False  # ended on one of the `stop` strings


class AgentContext:
    """Per-trajectory state: one token stream, tools, the turn limit and, for black-box agents, a proxy."""

    def __init__(self, client, tokenizer, prompt_ids: list[int], sampling: dict, *, prompt_text: str = "",
                 messages: list[dict] | None = None, max_turns: int = 0, proxy=None, limit: PromptLimit | None = None,
                 max_tokens: int = 0):
        self.client, self.tokenizer, self.sampling = client, tokenizer, sampling
        self.max_tokens = max_tokens        # black-box: completion tokens the trajectory may generate (0 = no budget)
        self.proxy_notes: list[str] = []    # black-box: what its requests asked that the proxy did not honour
        self.limit = limit or PromptLimit()     # the model's context and sampling.max_prompt_tokens
        self.stream = TokenStream(list(prompt_ids), prompt_text)
        self.messages = messages            # chat history when the prompt is chat messages, else None
        self.max_turns = max_turns
        self.tools = ToolRegistry(BUILTIN_TOOLS)
        self.proxy = proxy
        self.status = "completed"
        self.turns = self.tool_calls = 0
        self.tree: list[Segment] = [Segment(0, "main", "", -1, 0, self.stream)]   # white-box: a chain of main
        self.segment_stats: dict = {}       # black-box: segments by kind, prefix reuse (from the proxy's Session)
        self.gen_s = 0.0                    # time spent waiting on the engines
        self.reward: float | None = None    # set by environments or black-box agents; overrides reward.fn
        self.info: dict = {}
        self.transcript: list[dict] = list(messages) if messages else [{"role": "user", "content": prompt_text}]
        self.detail = ""                    # diagnostics (a subprocess's stderr tail) for a failure message
        self.turn_limited = False           # the turn limit stopped this trajectory

    @property
    def segments(self) -> int:
        return len(self.tree)

    # ---- model turns -------------------------------------------------------------------
    async def generate(self, stop: list[str] | None = None, **overrides) -> Generation:
        """Continue the stream with one model turn. `stop` strings end the turn (kept in the stream: the model
        produced them and later turns see them); `overrides` change sampling for this turn."""
        if self.max_turns and self.turns >= self.max_turns:
            self.turn_limited = True
            raise TurnLimitReached(f"turn limit reached: {self.max_turns} model turns")
        context = self.stream.ids
        req = {**self.sampling, **overrides, "prompt_ids": context}
        req["max_new_tokens"] = self.limit.budget(len(context), int(req["max_new_tokens"]),
                                                  explicit="max_new_tokens" in overrides)
        if "seed" in self.sampling and "seed" not in overrides:
            req["seed"] = turn_seed(self.sampling["seed"], self.turns)
        t0 = time.perf_counter()
        (out,) = await self.client.generate([req])
        self.gen_s += time.perf_counter() - t0
        raise_if_failed(out)
        ids, stop_hit = cut_at_stop(self.tokenizer, context, out["response_ids"], stop or [], keep_stop=True)
        lps, vers = out["logprobs"][: len(ids)], out["versions"][: len(ids)]
        self.stream.add_model(ids, lps, vers, decode_continuation(self.tokenizer, context, ids))
        self.status = "completed" if stop_hit is not None else out["status"]
        self.turns += 1
        text = decode_continuation(self.tokenizer, context, ids, skip_special=True)
        self.transcript.append({"role": "assistant", "content": text})
        if self.messages is not None:
            self.messages.append({"role": "assistant", "content": text})
        return Generation(ids, lps, vers, self.status, text, stop_hit is not None)

    # ---- context the model did not write (loss_mask=0) ----------------------------------
    def add_text(self, text: str, role: str = "context") -> None:
        self.limit.check_text(text, known=len(self.stream.ids))    # a hopeless text is not tokenized
        self.stream.add_context(encode(self.tokenizer, text), text)
        self.transcript.append({"role": role, "content": text})

    def add_messages(self, messages: list[dict]) -> None:
        """Chat prompts only: append messages through the chat template, tokenising only the new text. If the
        template renders the history differently (not append-only) the stream restarts from the rendered text:
        a new segment, never a silent re-tokenisation."""
        if self.messages is None:
            raise ValueError("add_messages needs a chat prompt (the row's prompt as a JSON list of messages); "
                             "use add_text for plain-text prompts")
        new = normalise_messages(messages)
        self.messages += new
        self.transcript += new
        text = render(self.tokenizer, self.messages)
        if text.startswith(self.stream.text):
            delta = text[len(self.stream.text):]
            self.stream.add_context(encode(self.tokenizer, delta), delta)
        else:       # the finished segment keeps its row; the next one starts at the new render
            self.stream = TokenStream(encode(self.tokenizer, text), text)
            self.tree.append(Segment(len(self.tree), "main", "", len(self.tree) - 1, 0, self.stream))

    async def call_tool(self, name: str, args: dict | str | None = None) -> str:
        """Run a registered tool; its result text joins the stream (a `tool` message in chat mode)."""
        result = await self.tools.call(name, args)
        self.tool_calls += 1
        self._observe(result, "tool")
        return result

    async def step(self, env, action: str):
        """One environment step: the observation joins the stream, the reward adds to ctx.reward."""
        res = env.step(action)
        if asyncio.iscoroutine(res):
            res = await res
        if not math.isfinite(float(res.reward)):     # NaN / inf would reach the advantages: fail the row
            raise ValueError(f"environment {type(env).__name__} returned a non-finite reward {res.reward!r}")
        self.reward = (self.reward or 0.0) + float(res.reward)
        self.info.update(res.info)
        if not res.done and res.observation:
            self._observe(res.observation, "user")
        return res

    def _observe(self, text: str, role: str) -> None:
        if self.messages is not None:
            self.add_messages([{"role": role, "content": text}])
        else:
            self.add_text(text, role=role)

    # ---- black-box agents ------------------------------------------------------------
    @asynccontextmanager
    async def openai_endpoint(self):
        """An OpenAI/Anthropic-compatible base URL and key for this trajectory only. On exit the recorded calls
        become the trajectory; an agent that never called the model fails."""
        if self.proxy is None:
            raise RuntimeError("this context has no proxy: black-box agents run inside AgentFlowRollout")
        ep = await self.proxy.open(self.client, self.sampling, self.max_turns, self.max_tokens)
        try:
            yield ep
        finally:
            self.proxy.close(ep)
            self._adopt(ep.session)
        if ep.session.calls == 0:
            raise RuntimeError("the agent made no model calls")

    def _adopt(self, session) -> None:
        self.turns, self.gen_s = session.calls, self.gen_s + session.gen_s
        self.turn_limited = session.truncated
        self.proxy_notes = list(session.notes)
        self.segment_stats = session.kind_counts() | {"reused_tokens": session.reused_tokens,
                                                      "fresh_tokens": session.fresh_tokens,
                                                      "resent_bytes": session.resent_bytes}
        if session.final is not None:
            self.stream, self.tree = session.final.stream, session.rows()
            self.transcript, self.status = session.transcript, session.status

    # ---- rows ------------------------------------------------------------------------
    def results(self, kinds: tuple[str, ...] = KINDS) -> list[dict]:
        """One row per segment of the given kinds, in the order they started, each with its place in the tree."""
        return [(s.stream or self.stream).columns() | {"status": self.status, "segment": {
            "id": s.id, "kind": s.kind, "parent": s.parent, "start": s.start, "agent": s.agent}}
            for s in self.tree if s.kind in kinds]


class SingleTurnAgent:
    """The simplest white-box agent: one model turn answering the prompt."""

    async def run(self, ctx: AgentContext, sample: dict) -> None:
        await ctx.generate()
