"""Log-probs, entropy and top-k of chosen positions only: the LM head applied chunk by chunk.

A causal LM's [B, L, V] logits of one 19k-token prompt on a 151k vocabulary are 11 GB in float32,
yet training and scoring need the distribution only where a response token is predicted. So the
head is applied to the last hidden states ([B, L, H], H small next to V) at those positions only,
`chunk` at a time; with gradients each chunk's [chunk, V] logits are recomputed in the backward
(activation checkpointing), not kept. The arithmetic is the full path's, so the numbers equal it
to float32 round-off. Models whose logits are not `head(last hidden state)` (soft-capping, custom
heads) are detected once, on a two-token input, and take the full forward: correct, only not
memory-bounded.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class TokenStats:
    logprobs: torch.Tensor                    # [N] log-prob of each target token
    entropy: torch.Tensor | None = None       # [N] entropy of each position's distribution
    gathered: torch.Tensor | None = None      # [N, K] log-probs of given ids (a teacher's top-k)
    top_values: torch.Tensor | None = None    # [N, k] the k largest log-probs
    top_indices: torch.Tensor | None = None   # [N, k] their token ids


def _stats(h, head, targets, temperature, entropy, gather_ids, top_k):
    """One chunk: every tensor [c, V] it builds is local, freed (or recomputed) after it."""
    z = head(h).float() / temperature
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1) if entropy else None
    got = logp.gather(-1, gather_ids) if gather_ids is not None else None
    top = logp.topk(min(top_k, logp.shape[-1]), -1) if top_k else None
    return lp, ent, got, None if top is None else top.values, None if top is None else top.indices


def chunked(fn, n: int, chunk: int, *tensors) -> list:
    """fn over `chunk` rows of `tensors` at a time (0 = all at once), its outputs (tensors or None)
    concatenated; with gradients, each chunk under activation checkpointing."""
    step = chunk if 0 < chunk < n else max(n, 1)
    grad = torch.is_grad_enabled() and step < n      # one chunk: nothing to save by recomputing it
    parts = [checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)
             for args in ([t[a:a + step] for t in tensors] for a in range(0, max(n, 1), step))]
    return [x[0] if x[0] is None or len(x) == 1 else torch.cat(x) for x in zip(*parts)]


def token_stats(hidden: torch.Tensor, head, targets: torch.Tensor, temperature: float = 1.0, chunk: int = 0,
                entropy: bool = False, gather_ids: torch.Tensor | None = None, top_k: int = 0) -> TokenStats:
    """hidden [N, H] (the states that predict `targets` [N]), head: H -> V. chunk: positions per
    chunk (0 = all at once). Differentiable through `hidden` and the head's parameters."""
    tensors = (hidden, targets) if gather_ids is None else (hidden, targets, gather_ids)
    return TokenStats(*chunked(lambda h, t, g=None: _stats(h, head, t, temperature, entropy, g, top_k),
                               hidden.shape[0], chunk, *tensors))


def split_model(model):
    """(decoder, head) such that model(x).logits == head(decoder(x).last_hidden_state), or None when
    this model's logits are made otherwise; checked once per model. A peft model is looked through to
    its HF model (its adapter layers live inside decoder and head)."""
    cached = getattr(model, "_loongsage_split", None)
    if cached is not None:
        return cached or None
    hf = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    decoder = getattr(hf, getattr(hf, "base_model_prefix", ""), None)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    found = (decoder, head) if decoder is not None and head is not None and _agrees(model, decoder, head) else ()
    with contextlib.suppress(AttributeError):
        object.__setattr__(model, "_loongsage_split", found)
    return found or None


def _agrees(model, decoder, head) -> bool:
    ids = torch.tensor([[0, 1]], device=next(model.parameters()).device)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits.float()
            mine = head(decoder(input_ids=ids, use_cache=False).last_hidden_state).float()
    except Exception:  # noqa: BLE001 - any model that cannot run split: the full path serves it
        return False
    finally:
        model.train(was)
    return full.shape == mine.shape and torch.allclose(full, mine, rtol=1e-4, atol=1e-5)


def position_stats(model, targets: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, temperature: float,
                   chunk: int, entropy: bool = False, gather_ids: torch.Tensor | None = None, top_k: int = 0,
                   **inputs) -> TokenStats:
    """Stats of `targets` [N] predicted at (rows [N], positions [N]) of the sequences `inputs`
    describe (input_ids, and position_ids / attention_mask as the model takes them)."""
    split = split_model(model)
    if split is None:       # logits made otherwise: the full forward, then the same per-position math
        states, head = model(use_cache=False, **inputs).logits, torch.nn.Identity()
    else:
        states, head = split[0](use_cache=False, **inputs).last_hidden_state, split[1]
    return token_stats(states[rows, positions], head, targets, temperature, chunk, entropy, gather_ids, top_k)
