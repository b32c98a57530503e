"""Advantage estimators: one outcome reward per response -> one advantage per token.

Every estimator, a pure function in `ESTIMATORS`, takes rewards [B], group ids [B] (groups may
differ in size and need not be contiguous) and the loss mask [B,T], and returns advantages [B,T],
zero on masked tokens. The group-relative ones (GRPO, Dr.GRPO, RLOO) give zero advantage to a
group of one sample or of equal rewards: neither says which answer was better.
"""
from __future__ import annotations

from typing import Callable

import torch


def _group_moments(rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor | None = None):
    """Per-row group size, group mean and unbiased group std (0 for a group of one). With `weights`
    (a row's share of its sample) a sample that made several rows counts once: sizes count samples."""
    _, row_group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(row_group.max()) + 1 if row_group.numel() else 0

    def group_sum(x):
        return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, row_group, x)[row_group]

    w = torch.ones_like(rewards) if weights is None else weights.to(rewards.dtype)
    size = group_sum(w)
    mean = group_sum(w * rewards) / size
    var = group_sum(w * (rewards - mean) ** 2) / (size - 1).clamp(min=1)
    return size, mean, var.sqrt()


def grpo(rewards, group_ids, mask, eps: float = 1e-6, weights=None) -> torch.Tensor:
    """GRPO (Shao et al. 2024, 2402.03300), outcome supervision: (r - mean_g) / (std_g + eps)."""
    _, mean, std = _group_moments(rewards, group_ids, weights)
    return ((rewards - mean) / (std + eps))[:, None] * mask


def dr_grpo(rewards, group_ids, mask, eps: float = 1e-6, weights=None) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025, 2503.20783): r - mean_g. Dividing by the std up-weights
    prompts that are too easy or too hard, so Dr.GRPO drops it (and the length norm, in the loss)."""
    _, mean, _ = _group_moments(rewards, group_ids, weights)
    return (rewards - mean)[:, None] * mask


def rloo(rewards, group_ids, mask, eps: float = 1e-6, weights=None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, 2402.14740): r_i minus the mean of the *other* samples'
    rewards, an unbiased baseline since it does not depend on sample i."""
    size, mean, _ = _group_moments(rewards, group_ids, weights)
    others_mean = (mean * size - rewards) / (size - 1).clamp(min=1)
    return torch.where(size > 1, rewards - others_mean, 0.0)[:, None] * mask


def _whiten_over_tokens(returns: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise by the mean and (population) std over every valid token of the batch."""
    n = mask.sum().clamp(min=1)
    mean = (returns * mask).sum() / n
    std = ((((returns - mean) * mask) ** 2).sum() / n).sqrt()
    return (returns - mean) / (std + eps) * mask


def reinforce_pp(rewards, group_ids, mask, eps: float = 1e-6, weights=None):
    """REINFORCE++ (Hu et al. 2025, 2501.03262): the token return (the outcome reward; KL to the reference
    enters through the loss), normalised over the whole batch's tokens instead of per group, which keeps
    the estimate unbiased for a prompt whose group happens to agree."""
    return _whiten_over_tokens(rewards[:, None] * mask, mask, eps)


def reinforce_pp_baseline(rewards, group_ids, mask, eps: float = 1e-6, weights=None):
    """REINFORCE++-baseline (same paper): the group mean reward subtracted first, then as REINFORCE++."""
    _, mean, _ = _group_moments(rewards, group_ids, weights)
    return _whiten_over_tokens((rewards - mean)[:, None] * mask, mask, eps)


ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                       eps: float = 1e-6, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages [B,T] by estimator `name`; `weights` [B]: a row's share of its sample (agent segments)."""
    dtype = torch.promote_types(rewards.dtype, mask.dtype)     # the estimators take both in one float dtype
    with torch.no_grad():
        return ESTIMATORS[name](rewards.to(dtype), group_ids, mask.to(dtype), eps=eps, weights=weights)
