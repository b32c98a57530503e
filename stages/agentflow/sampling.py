"""How the engines sample: the HF engine's sampler, and the row settings the library engines take.

The HF engine (engine.py) samples one token per row by the inverse CDF of the tempered, top-p cut
distribution at one uniform per row; a seeded row's uniform for its t-th response token is
seeded_uniform(seed, t), so it samples the same whatever it is batched with and a resumed row draws
what an uninterrupted one would. vLLM and SGLang seed their own samplers instead (sampling_of).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CDF_CELLS = 2 ** 21                  # rows sampled at a time: rows x vocabulary cells (a float64 CDF: 16 MB)


def sample(logits: torch.Tensor, temp: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor):
    """One token per row and its log-prob under logits / temp (what the trainer computes): greedy where temp <= 0,
    else the inverse CDF at u of the top-p cut distribution. Rows go CDF_CELLS (rows x vocabulary) at a time: the
    math holds a handful of [rows, V] tensors at once."""
    step = max(1, CDF_CELLS // logits.shape[-1])
    if logits.shape[0] > step:
        parts = [sample(logits[i:i + step], temp[i:i + step], top_p[i:i + step], u[i:i + step])
                 for i in range(0, logits.shape[0], step)]
        return torch.cat([t for t, _ in parts]), torch.cat([lp for _, lp in parts])
    greedy = temp <= 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temp)[:, None], -1)
    probs = logp.exp()
    if bool((top_p[~greedy] < 1.0).any()):
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p[:, None]
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    tok = torch.where(greedy, logits.argmax(-1), inverse_cdf(probs, u))
    return tok, logp.gather(-1, tok[:, None])[:, 0]


_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit flips about half the output bits (uint64, wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def seeded_uniform(seeds, steps) -> np.ndarray:
    """A uniform in (0, 1] per (seed, step), a pure function of the pair (float64, 53 random bits)."""
    s = np.array([int(x) % 2 ** 64 for x in seeds], dtype=np.uint64)     # any int: an API caller's seed too
    t = np.asarray(steps, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _mix(_mix(s * _GOLDEN + _GOLDEN) ^ (t * _GOLDEN))
    return ((z >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative probability reaches u x the row's total: a token of
    probability 0 is never chosen (u > 0), and rows need not sum to 1 (a top-p cut)."""
    cdf = probs.double().cumsum(-1)
    return (cdf < (u * cdf[:, -1])[:, None]).sum(-1).clamp(max=probs.shape[-1] - 1)


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    seed: int | None


def sampling_of(r: dict) -> Sampling:
    """A row's sampling settings as a library engine takes them: top_p is moot when greedy; a seeded
    row's sampler is seeded with seed + tokens already in its response, so a resumed row draws a
    stream of its own too."""
    temp = float(r.get("temperature", 1.0))
    top_p = float(r.get("top_p", 1.0)) if temp > 0 else 1.0
    seed = (int(r["seed"]) + len(r.get("prefix_ids", []))) % (2 ** 63) if r.get("seed") is not None else None
    return Sampling(temp, top_p, seed)
