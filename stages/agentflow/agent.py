"""The Agent protocol and the context a white-box agent drives generation through.

An agent is any object with `async def run(ctx, sample) -> None`. It calls
`await ctx.generate(...)` for model turns and `ctx.add_tokens(...)` for tool or
environment text; AgentFlow owns the token stream, so the trajectory is built in token
space (model tokens loss_mask=1, everything else 0) and never re-tokenised.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class Agent(Protocol):
    async def run(self, ctx: "AgentContext", sample: dict) -> None: ...


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    status: str           # completed | truncated | aborted
    text: str


@dataclass
class AgentContext:
    """Per-trajectory state: the prompt, the growing response and its per-token records."""
    client: "object"                  # EngineClient: async generate(list[request]) on the engines
    tokenizer: "object"
    prompt_ids: list[int]
    sampling: dict                    # max_new_tokens, temperature, top_p
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    status: str = "completed"
    turns: int = 0
    info: dict = field(default_factory=dict)

    async def generate(self, **overrides) -> Generation:
        """Continue the token stream (prompt + everything so far) with one model turn."""
        req = {"prompt_ids": self.prompt_ids + self.response_ids, **self.sampling, **overrides}
        (out,) = await self.client.generate([req])
        self.response_ids += out["response_ids"]
        self.logprobs += out["logprobs"]
        self.versions += out["versions"]
        self.loss_mask += [1] * len(out["response_ids"])
        self.status = out["status"]
        self.turns += 1
        text = self.tokenizer.decode(out["response_ids"], skip_special_tokens=True)
        return Generation(out["response_ids"], out["logprobs"], out["versions"], out["status"], text)

    def add_tokens(self, token_ids: list[int]) -> None:
        """Append tool/environment tokens: context for later turns, never trained on."""
        self.response_ids += list(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)

    def add_text(self, text: str) -> None:
        self.add_tokens(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def result(self) -> dict:
        model_versions = [v for v in self.versions if v >= 0]
        return {
            "response_ids": self.response_ids, "response_logprobs": self.logprobs,
            "token_versions": self.versions, "loss_mask": self.loss_mask, "status": self.status,
            "version_start": min(model_versions, default=-1), "version_end": max(model_versions, default=-1),
            "info": json.dumps(self.info),
        }


class SingleTurnAgent:
    """The simplest white-box agent: one model turn answering the prompt."""

    async def run(self, ctx: AgentContext, sample: dict) -> None:
        await ctx.generate()
