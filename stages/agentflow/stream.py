"""One trajectory's token stream: the ids the engine saw, with per-token records.

Model tokens are appended as the engine returned them (ids, logprobs, versions; loss_mask=1); anything else (tool
results, observations, chat-template glue between turns) as loss_mask=0 context. Beside the ids the stream keeps
`text`, what they stand for as rendered or decoded: a later prompt whose text starts with it extends the stream
by its remainder alone, so earlier tokens are never re-tokenised.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenStream:
    prompt_ids: list[int]
    text: str = ""                      # text of prompt + response so far
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)   # -1 for context tokens
    loss_mask: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_context(self, ids: list[int], text: str) -> None:
        """Tokens the model did not produce: context for later turns, never trained on."""
        self._add(ids, [0.0] * len(ids), [-1] * len(ids), 0, text)

    def add_model(self, ids: list[int], logprobs: list[float], versions: list[int], text: str) -> None:
        self._add(ids, logprobs, versions, 1, text)

    def _add(self, ids: list[int], logprobs: list[float], versions: list[int], mask: int, text: str) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.loss_mask += [mask] * len(ids)
        self.text += text

    def copy(self) -> "TokenStream":
        return TokenStream(list(self.prompt_ids), self.text, list(self.response_ids), list(self.logprobs),
                           list(self.versions), list(self.loss_mask))

    def columns(self) -> dict:
        model_versions = [v for v in self.versions if v >= 0]
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
                "response_logprobs": self.logprobs, "token_versions": self.versions, "loss_mask": self.loss_mask,
                "version_start": min(model_versions, default=-1), "version_end": max(model_versions, default=-1)}
