"""Per-token log-probs and entropy from vocab-parallel logits (each TP rank holds a slice
of the vocabulary), without gathering the full [.., vocab] tensor on any rank.

  log p(y) = z_y - log sum_v exp(z_v)          megatron's vocab_parallel_cross_entropy
  H        = log S - (sum_v exp(z_v) z_v) / S   partial sums all-reduced over TP

where z = logits / temperature. Vocabulary rows megatron pads (to a multiple of TP)
are pushed to -1e30 first, so they carry no probability: the distribution is HF's.
"""
from __future__ import annotations

import torch

from stages.token_logprobs import chunked

_PAD_LOGIT = -1e30       # finite, so exp() gives 0 and 0 * logit stays 0 in the entropy


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab: int, temperature: float = 1.0,
                   with_entropy: bool = False):
    """(log-probs, entropy or None) of global target ids from this rank's vocab slice of the logits."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    z = logits.float() / temperature
    start = ps.get_tensor_model_parallel_rank() * z.shape[-1]
    if start + z.shape[-1] > vocab:     # this slice holds padded rows
        z = z.masked_fill(torch.arange(start, start + z.shape[-1], device=z.device) >= vocab, _PAD_LOGIT)
    ent = _entropy(z) if with_entropy else None
    # vocab_parallel_cross_entropy shifts its input in place: give it its own copy
    lp = -vocab_parallel_cross_entropy(z.clone() if with_entropy else z, targets)
    return lp, ent


def _entropy(z: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as all_reduce

    zmax = z.detach().max(-1, keepdim=True).values
    dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = z - zmax
    e = z.exp()
    # forward: sum over ranks; backward: identity, which is right because every rank
    # computes the same loss from the reduced sums and owns the gradient of its own slice
    s = all_reduce(e.sum(-1))
    ez = all_reduce((e * z).sum(-1))
    return s.log() - ez / s


def defer_head(gpt):
    """Make `gpt` return its last hidden states [b, s, H] instead of logits and return head(h [N, H])
    -> this rank's logits [N, V/tp] (the real layer, with the weight megatron hands it), for the loss
    to run on response positions only, in chunks. None without an output layer (not the last pipeline
    stage) or with sequence parallel (the states are split along the sequence)."""
    layer = getattr(gpt, "output_layer", None)
    if layer is None or getattr(layer, "sequence_parallel", False):
        return None
    real, held = layer.forward, {}

    def passthrough(hidden, weight=None, **_):
        held["w"] = weight
        return hidden, None

    layer.forward = passthrough

    def head(h: torch.Tensor) -> torch.Tensor:
        z, _ = real(h[:, None, :], weight=held.get("w"))
        return z[:, 0, :]

    return head


def chunked_token_logprobs(hidden: torch.Tensor, head, targets: torch.Tensor, vocab: int, temperature: float,
                           chunk: int, with_entropy: bool = False):
    """token_logprobs of `targets` [N] from hidden states [N, H], the head applied `chunk` positions
    at a time (stages/token_logprobs.chunked). Every TP rank runs the same chunks (same rows), so the
    collectives inside match up, in the forward and in the recomputation."""
    return chunked(lambda h, t: token_logprobs(head(h), t, vocab, temperature, with_entropy),
                   hidden.shape[0], chunk, hidden, targets)
