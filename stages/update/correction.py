"""Train-inference consistency: measure and correct the gap between engine and trainer.

The engine samples with its own kernels, precision and (async) an older weight version, so the
probability it recorded for a token differs from the trainer's. `mismatch_metrics` measures that
gap each step, split by token staleness; `is_weights` corrects for it with importance sampling
from the old policy (trainer) to the behaviour policy (engine):

  TIS  token-level ratio truncated at tis_cap              (Yao et al. 2025)
  MIS  drop tokens / sequences whose ratio leaves a band   (token | sequence | geometric)
  geo  one weight per sequence: geometric mean of ratios, optionally truncated at tis_cap

The returned mask replaces the loss mask, so dropped tokens also leave the normaliser.
"""
from __future__ import annotations

import math

import torch

from stages.update.losses import AlgorithmConfig

_LOG2 = math.log(2.0)
_MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: only guards against overflow, never a real cap


def mismatch_metrics(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                     stale_mask: torch.Tensor | None = None) -> dict[str, float]:
    """Gap statistics on the trained tokens, overall and (with stale_mask) for fresh/stale ones; a subset
    with no tokens is left out. k3_kl estimates KL(engine || trainer): r - 1 - log r, r = pi_trainer / pi_engine."""
    valid = mask > 0
    delta = (trainer_logprobs - engine_logprobs).detach().double()
    subsets = {"": valid}
    if stale_mask is not None:
        subsets |= {"/fresh": valid & ~stale_mask.bool(), "/stale": valid & stale_mask.bool()}
    out: dict[str, float] = {}
    for suffix, sel in subsets.items():
        d = delta[sel]
        if d.numel() == 0:
            continue
        out[f"mismatch/abs_diff_mean{suffix}"] = d.abs().mean().item()
        out[f"mismatch/abs_diff_max{suffix}"] = d.abs().max().item()
        out[f"mismatch/k3_kl{suffix}"] = (torch.expm1(d) - d).mean().item()
        out[f"mismatch/ratio_outside_frac{suffix}"] = (d.abs() > _LOG2).double().mean().item()
    if stale_mask is not None:
        out["mismatch/stale_frac"] = (valid & stale_mask.bool()).sum().item() / max(valid.sum().item(), 1)
    return out


def is_weights(cfg: AlgorithmConfig, old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(weights [B,T] without grad, new mask [B,T], metrics). With no correction configured
    the weights are the mask itself and the mask is unchanged."""
    cfg = cfg.resolved()
    with torch.no_grad():
        valid = mask > 0
        log_ratio = torch.where(valid, old_logprobs - engine_logprobs, 0.0).double()
        n = valid.sum(1, keepdim=True).clamp(min=1)
        per_level = {"token": log_ratio,
                     "sequence": log_ratio.sum(1, keepdim=True).expand_as(log_ratio),
                     "geometric": (log_ratio.sum(1, keepdim=True) / n).expand_as(log_ratio)}
        metrics: dict[str, float] = {}

        keep = valid
        if cfg.mis_high:
            # compare in log space: a sequence-level product of ratios overflows easily
            lo = math.log(cfg.mis_low) if cfg.mis_low > 0 else -math.inf
            level = per_level[cfg.mis_level]
            keep = valid & (level >= lo) & (level <= math.log(cfg.mis_high))
            seqs = valid.any(1)
            metrics["mis/dropped_token_frac"] = (valid & ~keep).sum().item() / max(valid.sum().item(), 1)
            metrics["mis/dropped_seq_frac"] = (seqs & ~keep.any(1)).sum().item() / max(seqs.sum().item(), 1)
        new_mask = mask * keep.to(mask.dtype)

        weights = torch.ones_like(log_ratio)
        if cfg.tis_cap or cfg.geo_is:
            weights = per_level["geometric" if cfg.geo_is else "token"].clamp(max=_MAX_LOG_WEIGHT).exp()
            if cfg.tis_cap:
                metrics["is/truncated_frac"] = _mean_over(weights > cfg.tis_cap, keep)
                weights = weights.clamp(max=cfg.tis_cap)
            metrics["is/weight_mean"] = _mean_over(weights, keep)
            metrics["is/weight_max"] = weights[keep].max().item() if keep.any() else 0.0
        weights = (weights * keep).to(old_logprobs.dtype)
    return weights, new_mask, metrics


def _mean_over(x: torch.Tensor, sel: torch.Tensor) -> float:
    return x[sel].double().mean().item() if sel.any() else 0.0


def old_policy_logprobs(cfg: AlgorithmConfig, recomputed: torch.Tensor | None,
                        engine_logprobs: torch.Tensor) -> torch.Tensor:
    """The log-probs PPO's ratio is taken against. decoupled=true uses the engine's recorded
    ones, so the trainer skips the forward pass that recomputes them (recomputed is None then)."""
    return engine_logprobs if cfg.decoupled else recomputed
