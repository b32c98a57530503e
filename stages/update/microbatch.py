"""Micro-batches packed by tokens: one optimizer step's rows cut so that no forward pass holds
more than `max_tokens` positions, their gradients accumulated into the one step. Rows are
right-padded within a pass, so one long row would pad every short row beside it; cut by tokens,
it runs alone. Rows of one prompt are kept together, longest first, so prompt sharing still pays.
"""
from __future__ import annotations

import numpy as np
import torch

ADDITIVE = ("loss", "pg_loss", "kl_ref", "entropy", "gkd_kl")   # scaled by their share: they add up


def token_micro_batches(seq_len: np.ndarray, prompt_len: np.ndarray, prompt_key: np.ndarray,
                        rows: torch.Tensor, max_tokens: int, shared: bool) -> list[torch.Tensor]:
    """`rows` (indices into the step's rows) cut into micro-batches of at most `max_tokens` laid-out
    positions each; a row longer than that alone runs alone. max_tokens = 0: one micro-batch."""
    if max_tokens <= 0 or len(rows) <= 1:
        return [rows]
    r = rows.numpy()
    keys = prompt_key[r] if shared else np.arange(len(r))
    longest = {k: seq_len[r][keys == k].max() for k in np.unique(keys)}
    order = sorted(range(len(r)), key=lambda i: (-longest[keys[i]], keys[i], -seq_len[r[i]]))
    out, cur, width = [], [], {}
    for i in order:
        k, row = keys[i], int(r[i])
        grown = dict(width)
        grown[k] = grown[k] + seq_len[row] - prompt_len[row] if k in grown else seq_len[row]
        if cur and len(grown) * max(grown.values()) > max_tokens:
            out.append(cur)
            cur, grown = [], {k: seq_len[row]}
        cur.append(row)
        width = grown
    out.append(cur)
    return [torch.as_tensor(sorted(c)) for c in out]


def merge_metrics(parts: list[tuple[dict, float]]) -> dict:
    """One mini-batch's loss metrics from its micro-batches' (metrics, trained tokens): the
    additive terms summed (each was scaled by its share already), the rest token-weighted."""
    if len(parts) == 1:
        return parts[0][0]
    total = sum(t for _, t in parts) or 1.0
    return {k: sum(m[k] for m, _ in parts) if k in ADDITIVE else sum(m[k] * t for m, t in parts) / total
            for k in parts[0][0]}
