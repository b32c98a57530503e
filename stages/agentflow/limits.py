"""Prompt-length limits: no single request may stall an engine.

Two numbers bound a model call. The model's context (its HF config's
`max_position_embeddings`) bounds prompt + completion; `rollout.max_prompt_tokens`
(0 = the context less one token) bounds the prompt alone. Every entry point checks them
before tokenizing a long text or decoding anything:

* the proxy: a cheap bound on the text's characters first, then the exact token count;
  over the limit it answers 400 `context_length_exceeded`;
* a white-box `ctx.generate` / `ctx.add_text`: ContextLengthExceeded, which fails the trajectory;
* the engines, per row: a row that cannot fit fails alone (status `failed`, `error`) and the
  rest of the batch is served; every row's `max_new_tokens` is clipped to the room its
  context leaves, so one call's decode work is at most rows x context tokens.

A proxy call's completion budget is clamped, never refused (`PromptLimit.clamp`: the least of the
harness's own max_tokens, rollout.max_new_tokens, what is left of rollout.max_trajectory_tokens and
the room the context leaves; docs/harnesses.md says what the harness then sees). A white-box
`max_new_tokens` override that does not fit is an error; the default budget is clipped to the room
left, and the completion ends `length` / `truncated`.

The cheap bound: in a vocabulary whose longest token is spelled with L characters, no
token stands for more than L characters of text (byte-level BPE spells one character per
byte, SentencePiece one per character, WordPiece and byte-fallback pieces more), so a
text of c characters has at least c / L tokens. A text over the limit by that bound is
refused without being tokenized; any other text is tokenized and counted exactly.
(A normalizer that deletes characters, e.g. one that drops control characters, could
make a refused text shorter than it reads: such a text is refused for its length as sent.)
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

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(RequestRejected):
    code = "context_length_exceeded"


def model_limits(model_path: str) -> tuple[int, int]:
    """(context, vocabulary size) in tokens from the model's HF config (max_position_embeddings,
    vocab_size); 0 where unknown.

    Read from config.json where it states both at its top level (the values AutoConfig would
    read); AutoConfig otherwise (a nested text config, a model type that names them differently).
    Importing AutoConfig imports torch: ~170 MB more in a rollout worker that needs neither."""
    stated = _config_json(model_path)
    if "text_config" not in stated and all(isinstance(stated.get(k), int)
                                           for k in ("max_position_embeddings", "vocab_size")):
        return stated["max_position_embeddings"], stated["vocab_size"]
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return 0, 0
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(text, "max_position_embeddings", 0) or 0), int(getattr(text, "vocab_size", 0) or 0)


def _config_json(model_path: str) -> dict:
    try:
        stated = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return stated if isinstance(stated, dict) else {}


def longest_token_chars(tok) -> int:
    """Characters in the vocabulary's longest token string (special tokens included)."""
    try:
        return max(map(len, tok.get_vocab()), default=0)
    except (AttributeError, NotImplementedError):
        return 0


@dataclass(frozen=True)
class PromptLimit:
    context: int = 0       # tokens of prompt + completion (the model's context); 0 = unknown
    max_prompt: int = 0    # tokens of the prompt alone (rollout.max_prompt_tokens); 0 = context - 1
    longest: int = 0       # characters of the longest token: the cheap bound's divisor; 0 = none

    @classmethod
    def for_model(cls, model_path: str, tok, max_prompt: int = 0) -> "PromptLimit":
        return cls(model_limits(model_path)[0], max_prompt, longest_token_chars(tok))

    @property
    def prompt_cap(self) -> int:
        """The most prompt tokens a call may have (0 = no limit): a prompt leaves room for one token."""
        caps = [c for c in (self.max_prompt, self.context - 1) if c > 0]
        return min(caps, default=0)

    def _over(self, n: int, what: str, param: str | None) -> ContextLengthExceeded:
        cap = self.prompt_cap
        if self.max_prompt and self.max_prompt == cap:
            why = f"prompts are limited to {cap} tokens (rollout.max_prompt_tokens)"
        else:
            why = f"this model's maximum context length is {self.context} tokens, so a prompt may have at most {cap}"
        return ContextLengthExceeded(f"{what} {n} tokens, but {why}. Please reduce the length of the prompt.", param)

    def check_text(self, text: str, known: int = 0, param: str | None = None) -> None:
        """Refuse, without tokenizing it, a text that cannot fit after `known` tokens even at the
        longest token's length."""
        cap = self.prompt_cap
        if cap and self.longest and known + len(text) / self.longest > cap:
            least = known + math.ceil(len(text) / self.longest)
            raise self._over(least, f"The prompt ({len(text)} characters) has at least", param)

    def budget(self, prompt_tokens: int, max_new: int, explicit: bool = False, param: str | None = None) -> int:
        """The completion budget for a prompt of `prompt_tokens`: `max_new`, clipped to the room the
        context leaves unless `explicit` (then not fitting is an error)."""
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


    # what bounds a proxy call's completion, when several bounds tie: the harness's own limit first (its cut is
    # its own), then the context (the model really ran out of room), then the trajectory budget, then the cap
    BOUNDS = ("request", "context", "budget", "rollout")

    def clamp(self, prompt_tokens: int, requested: int | None, rollout: int,
              left: int | None = None) -> tuple[int, str]:
        """A proxy call's completion budget and what bound it (one of BOUNDS): the least of the harness's own
        limit (`requested`, None if it set none), the rollout's per-call cap, the trajectory's token budget
        `left` (None: no budget) and the room the context leaves. Never an error: a harness asking for more
        than can be served (Claude Code asks 32k-128k) gets what can be."""
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
    ids = r.get("prompt_ids")
    if not isinstance(ids, list) or not ids:
        return "invalid_request", "'prompt_ids' must be a non-empty list of token ids"
    prefix = r.get("prefix_ids", [])
    if not isinstance(prefix, list):
        return "invalid_request", "'prefix_ids' must be a list of token ids"
    for key, seq in (("prompt_ids", ids), ("prefix_ids", prefix)):
        if seq and not (_integers(seq) and min(seq) >= 0 and max(seq) < vocab):
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


def _integers(seq: list) -> bool:
    # one pass in C over the list; the distinct types are few (int, or numpy ints from Arrow)
    return all(issubclass(t, (int, np.integer)) and t is not bool for t in set(map(type, seq)))


def room(r: dict, context: int, reserve: int = 0) -> int:
    """Tokens a row may still generate: its budget, clipped to what its context leaves."""
    seq = len(r["prompt_ids"]) + len(r.get("prefix_ids", []))
    budget = int(r["max_new_tokens"]) - len(r.get("prefix_ids", []))
    return min(budget, context - reserve - seq) if context else budget


def failed_row(code: str, message: str) -> dict:
    return {"response_ids": [], "logprobs": [], "versions": [], "status": "failed", "error": message, "code": code}


def raise_if_failed(out: dict, param: str | None = None) -> None:
    """A white-box or proxy caller's view of an engine row it refused."""
    if out.get("status") == "failed":
        cls = ContextLengthExceeded if out.get("code") == ContextLengthExceeded.code else RequestRejected
        raise cls(f"the engine refused this request: {out.get('error', '')}", param)
