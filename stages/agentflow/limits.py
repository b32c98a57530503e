"""Prompt-length limits: no single request may stall an engine.

The model's context (`max_position_embeddings`) bounds prompt + completion; `sampling.max_prompt_tokens` (0 = the
context less one token) bounds the prompt alone. Each entry point checks them before tokenizing a long text: the
proxy answers 400 `context_length_exceeded`, a white-box turn raises ContextLengthExceeded (its trajectory fails),
an engine fails the row alone and clips every row's `max_new_tokens` to the room its context leaves. A proxy
call's completion budget is clamped, never refused (`PromptLimit.clamp`, docs/harnesses.md).

The cheap bound: where the longest token is spelled with L characters, no token stands for more than L characters
(byte-level BPE spells a character per byte, SentencePiece one per character, others more), so a text of c
characters has at least c / L tokens; a text over the limit by that bound is refused untokenized (a normalizer
that deletes characters could make it fewer: such a text is refused for its length as sent).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class RequestRejected(ValueError):
    """A model call refused before decoding, with the OpenAI error code and parameter at fault."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None, tokens: int = 0):
        super().__init__(message)
        self.param, self.tokens = param, tokens     # tokens: the prompt's (or a lower bound) refused for its length


class ContextLengthExceeded(RequestRejected):
    code = "context_length_exceeded"


def model_limits(model_path: str) -> tuple[int, int]:
    """(context, vocabulary size) in tokens from the model's HF config; 0 where unknown. Read from config.json
    where its top level states both, else through AutoConfig (a nested text config, other names), whose import
    brings torch into a rollout worker that needs none."""
    try:
        stated = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        stated = {}
    keys = ("max_position_embeddings", "vocab_size")
    if isinstance(stated, dict) and "text_config" not in stated and all(isinstance(stated.get(k), int) for k in keys):
        return stated[keys[0]], stated[keys[1]]
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return 0, 0
    return tuple(int(getattr(cfg.get_text_config(), k, 0) or 0) for k in keys)


def longest_token_chars(tok) -> int:
    """Characters in the vocabulary's longest token string (special tokens included)."""
    try:
        return max(map(len, tok.get_vocab()), default=0)
    except (AttributeError, NotImplementedError):
        return 0


@dataclass(frozen=True)
class PromptLimit:
    context: int = 0       # tokens of prompt + completion (the model's context); 0 = unknown
    max_prompt: int = 0    # tokens of the prompt alone (sampling.max_prompt_tokens); 0 = context - 1
    longest: int = 0       # characters of the longest token: the cheap bound's divisor; 0 = none

    # what bounds a proxy call's completion where several tie: the harness's own limit first (its cut is its
    # own), then the context (the model really ran out of room), the trajectory's budget, the rollout's cap
    BOUNDS = ("request", "context", "budget", "rollout")

    @classmethod
    def for_model(cls, model_path: str, tok, max_prompt: int = 0) -> "PromptLimit":
        return cls(model_limits(model_path)[0], max_prompt, longest_token_chars(tok))

    @property
    def prompt_cap(self) -> int:
        """The most prompt tokens a call may have (0 = no limit): a prompt leaves room for one token."""
        return min([c for c in (self.max_prompt, self.context - 1) if c > 0], default=0)

    def _over(self, n: int, what: str, param: str | None) -> ContextLengthExceeded:
        cap = self.prompt_cap
        why = f"prompts are limited to {cap} tokens (sampling.max_prompt_tokens)" if self.max_prompt == cap else \
            f"this model's maximum context length is {self.context} tokens, so a prompt may have at most {cap}"
        return ContextLengthExceeded(f"{what} {n} tokens, but {why}. Please reduce the length of the prompt.", param, n)

    def check_text(self, text: str, known: int = 0, param: str | None = None) -> None:
        """Refuse, untokenized, a text that cannot fit after `known` tokens even at the longest token's length."""
        cap = self.prompt_cap
        if cap and self.longest and known + len(text) / self.longest > cap:
            least = known + math.ceil(len(text) / self.longest)
            raise self._over(least, f"The prompt ({len(text)} characters) has at least", param)

    def budget(self, prompt_tokens: int, max_new: int, explicit: bool = False, param: str | None = None) -> int:
        """The completion budget for a prompt of `prompt_tokens`: `max_new`, clipped to the room the context
        leaves unless `explicit` (then not fitting is an error)."""
        cap = self.prompt_cap
        if cap and prompt_tokens > cap:
            raise self._over(prompt_tokens, "The prompt has", param)
        if not self.context or prompt_tokens + max_new <= self.context:
            return max_new
        if explicit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context} tokens; however, you requested "
                f"{prompt_tokens + max_new} tokens ({prompt_tokens} in the prompt, {max_new} for the completion). "
                f"Please reduce the length of the prompt or the completion.", param)
        return self.context - prompt_tokens

    def clamp(self, prompt_tokens: int, requested: int | None, rollout: int,
              left: int | None = None) -> tuple[int, str]:
        """A proxy call's completion budget, the least of its limits (None: not set), and which one bound it (of
        BOUNDS). Never an error: a harness asking more gets what can be served (docs/harnesses.md)."""
        room = self.context - prompt_tokens if self.context else None
        limits = {"request": requested, "context": room, "budget": left, "rollout": rollout}
        n = min(v for v in limits.values() if v is not None)
        return max(n, 1), next(b for b in self.BOUNDS if limits[b] == n)


# ---- the engines' side: one row at a time -----------------------------------------------------
def row_error(r, context: int, vocab: int, reserve: int = 0) -> tuple[str, str] | None:
    """Why an engine refuses one request row, as (code, message), or None if it can be decoded.
    `reserve`: context tokens the engine keeps back (SGLang wants input + max_new < context)."""
    if not isinstance(r, dict):
        return "invalid_request", f"a request must be a dict, got {type(r).__name__}"
    ids, prefix = r.get("prompt_ids"), r.get("prefix_ids", [])
    if not isinstance(ids, list) or not ids:
        return "invalid_request", "'prompt_ids' must be a non-empty list of token ids"
    if not isinstance(prefix, list):
        return "invalid_request", "'prefix_ids' must be a list of token ids"
    for key, seq in (("prompt_ids", ids), ("prefix_ids", prefix)):
        # one pass in C over the list; the distinct types are few (int, or numpy ints from Arrow)
        if seq and not (all(issubclass(t, (int, np.integer)) and t is not bool for t in set(map(type, seq)))
                        and min(seq) >= 0 and max(seq) < vocab):
            return "invalid_request", f"'{key}' must be token ids in [0, {vocab})"
    m = r.get("max_new_tokens")
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
        return "invalid_request", f"'max_new_tokens' must be an integer >= 0, got {m!r}"
    for key in ("temperature", "top_p"):
        v = r.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not v >= 0:
            return "invalid_request", f"'{key}' must be a number >= 0, got {v!r}"
    seed = r.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        return "invalid_request", f"'seed' must be an integer, got {seed!r}"
    if context and len(ids) >= context - reserve:
        return "context_length_exceeded", (f"the prompt has {len(ids)} tokens: it does not fit the model's context "
                                           f"of {context} tokens with room for a completion")
    return None


def room(r: dict, context: int, reserve: int = 0) -> int:
    """Tokens a row may still generate: its budget, clipped to what its context leaves."""
    seq = len(r["prompt_ids"]) + len(r.get("prefix_ids", []))
    budget = int(r["max_new_tokens"]) - len(r.get("prefix_ids", []))
    return min(budget, context - reserve - seq) if context else budget


def failed_row(code: str, message: str) -> dict:
    return {"response_ids": [], "logprobs": [], "versions": [], "status": "failed", "error": message, "code": code}


def raise_if_failed(out: dict) -> None:
    """A white-box or proxy caller's view of an engine row it refused."""
    if out.get("status") == "failed":
        cls = ContextLengthExceeded if out.get("code") == ContextLengthExceeded.code else RequestRejected
        raise cls(f"the engine refused this request: {out.get('error', '')}")
