"""Policy losses: per-token log-probs and advantages -> one scalar to backpropagate.

`policy_loss` builds the objective: a per-token surrogate (ppo_clip | gspo | cispo) times optional IS
weights (correction.py), aggregated over tokens (token_mean | seq_mean_token_mean | seq_mean_token_sum_norm),
+ kl_coef * KL(policy || reference) - entropy_coef * entropy. `shape_overlong` is DAPO's overlong handling
of rewards and mask, before the advantages. docs/algorithms.md lists every option with its paper.
"""
from __future__ import annotations

from typing import Callable

import torch

from stages.update.config import AlgorithmConfig

# ---- per-token surrogates: (cfg, logprobs, old, adv, mask) -> (loss [B,T], clipped [B,T] bool)

def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # `where`, not a product: padding may hold inf/nan and 0 * inf would poison the sum and grads.
    return torch.where(mask > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _clipped_objective(ratio, adv, low, high, dual_c=0.0):
    pg = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - low, 1 + high)
    loss = torch.maximum(pg, pg_clipped)
    if dual_c:
        # Dual-clip (Ye et al. 2020): with A < 0 the clipped term is unbounded as the ratio
        # grows, so one stale token with a huge ratio could dominate the batch.
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_c), loss)
    return loss, pg_clipped > pg


def ppo_clip(cfg, logprobs, old, adv, mask):
    """PPO-clip (Schulman et al. 2017) with asymmetric band (DAPO clip-higher) and dual-clip."""
    ratio = torch.exp(masked(logprobs - old, mask))
    return _clipped_objective(ratio, adv, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)


def gspo(cfg, logprobs, old, adv, mask):
    """GSPO (Zheng et al. 2025, 2507.18071), in its GSPO-token form: every token carries the
    sequence ratio s_i = exp(mean_t log(pi/pi_old)) as its value and s_i * grad log pi_t as its
    gradient. With one advantage per sequence this equals sequence-level GSPO exactly."""
    logprobs = masked(logprobs, mask)
    n = mask.sum(1, keepdim=True).clamp(min=1)
    seq_log_ratio = (masked(logprobs - old, mask).sum(1, keepdim=True) / n).detach()
    # clamp keeps exp finite for a badly stale sequence; its loss is clipped anyway
    ratio = torch.exp(logprobs - logprobs.detach() + seq_log_ratio.clamp(max=10.0))
    return _clipped_objective(ratio, adv, cfg.clip_low, cfg.clip_high)


def cispo(cfg, logprobs, old, adv, mask):
    """CISPO (MiniMax-M1, 2506.13585): REINFORCE with a clipped, stop-gradient IS weight.
    Unlike PPO no token loses its gradient: clipping bounds the weight, not the update."""
    ratio = torch.exp(masked(logprobs - old, mask)).detach()
    weight = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    return -weight * adv * masked(logprobs, mask), weight != ratio


SURROGATES: dict[str, Callable] = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}


# ---- aggregation over tokens: (x [B,T], mask, norm_length) -> scalar

def token_mean(x, mask, norm_length=0):
    return masked(x, mask).sum() / mask.sum().clamp(min=1)


def _n_seqs(mask):
    """Sequences with at least one trained token (fully masked rows do not dilute the mean)."""
    return (mask.sum(1) > 0).sum().clamp(min=1)


def _seq_mean_token_mean(x, mask, norm_length):
    per_seq = masked(x, mask).sum(1) / mask.sum(1).clamp(min=1)
    return per_seq.sum() / _n_seqs(mask)


def _seq_mean_token_sum_norm(x, mask, norm_length):
    # Dr.GRPO: one constant length for every sequence, so long answers are not down-weighted
    # (and long wrong answers not favoured) as with a per-sequence 1/|o_i|.
    return masked(x, mask).sum() / (_n_seqs(mask) * (norm_length or mask.shape[1]))


def _denominator(loss_agg, mask):
    """What an aggregation divides its sum by, up to a constant: trained tokens, or sequences."""
    return mask.sum().clamp(min=1) if loss_agg == "token_mean" else _n_seqs(mask)


AGGREGATIONS: dict[str, Callable] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


# ---- KL to the reference policy, per token, sampled from the policy (Schulman 2020)

def _log_ref_ratio(logprobs, ref):
    return (ref - logprobs).clamp(-20.0, 20.0)  # log(pi_ref / pi); clamped so exp stays finite


KL_ESTIMATORS: dict[str, Callable] = {
    "k1": lambda lp, ref: -_log_ref_ratio(lp, ref),
    "k2": lambda lp, ref: 0.5 * _log_ref_ratio(lp, ref) ** 2,
    "k3": lambda lp, ref: torch.expm1(_log_ref_ratio(lp, ref)) - _log_ref_ratio(lp, ref),
}


def policy_loss(cfg: AlgorithmConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, is_weights: torch.Tensor | None = None,
                full_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss and its metrics. All tensors are [B,T]; only `logprobs` (and `entropy`)
    carry gradients. `is_weights` (correction.is_weights) scale each token's surrogate.
    `full_mask`: the mini-batch's mask when these rows are a subset of it whose left-out rows add
    0 to every term (zero advantage, no KL or entropy): the loss is the full mini-batch's (their
    tokens stay in the denominator); clipfrac and approx_kl are over the given rows' tokens."""
    cfg = cfg.resolved()
    mask = mask.to(logprobs.dtype)
    old, adv = old_logprobs.detach(), advantages.detach()
    per_token, clipped = SURROGATES[cfg.loss](cfg, logprobs, old, adv, mask)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()

    share = 1.0 if full_mask is None else float(_denominator(cfg.loss_agg, mask) /
                                                _denominator(cfg.loss_agg, full_mask.to(mask.dtype)))

    def agg(x):
        return AGGREGATIONS[cfg.loss_agg](x, mask, cfg.norm_length) * share

    loss = pg_loss = agg(per_token)
    with torch.no_grad():
        log_ratio = masked(logprobs - old, mask)
        metrics = {"pg_loss": pg_loss.item(),
                   "clipfrac": token_mean(clipped.to(mask.dtype), mask).item(),
                   # k3 estimate of KL(pi_old || pi) on tokens sampled from pi_old, with r = pi / pi_old:
                   # E_old[r - 1 - log r] (unbiased: E_old[r] = 1). How far this update moved the policy.
                   "approx_kl": token_mean(torch.expm1(log_ratio) - log_ratio, mask).item()}
    if ref_logprobs is not None:
        kl = agg(KL_ESTIMATORS[cfg.kl_estimator](masked(logprobs, mask), masked(ref_logprobs.detach(), mask)))
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = kl.item()
    if entropy is not None:
        if cfg.entropy_rows == "trained":   # rows with a policy gradient only (a nonzero advantage)
            entropy = entropy * ((adv * mask) != 0).any(1, keepdim=True)
        ent = agg(entropy)
        loss = loss - cfg.entropy_coef * ent
        metrics["entropy"] = ent.item()
    metrics["loss"] = loss.item()
    return loss, metrics


# ---- DAPO overlong handling: rewards [B], mask [B,T] -> shaped rewards, mask

def shape_overlong(cfg: AlgorithmConfig, rewards: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor,
                   truncated: torch.Tensor, max_response_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO (2503.14476) overlong handling; max_response_len is the rollout's token limit."""
    cfg = cfg.resolved()
    if cfg.overlong == "mask":      # overlong filtering: a truncated answer was cut, not wrong; do not teach from it
        return rewards, mask * (~truncated.bool()).to(mask.dtype)[:, None]
    if cfg.overlong == "soft":      # soft punishment: 0 up to max_len - buffer, then linear down to -penalty at max_len
        buffer = cfg.overlong_buffer or max(max_response_len // 5, 1)
        excess = (lengths.to(rewards.dtype) - (max_response_len - buffer)).clamp(0, buffer) / buffer
        return rewards - cfg.overlong_penalty * excess, mask
    return rewards, mask
