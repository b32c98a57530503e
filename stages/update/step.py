"""One training step, the same for the torch and the Megatron trainer (`Trainer`, their base). The
learning rate is a function of the step alone, so a resumed run continues its schedule where it stopped.
"""
from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from stages.update.advantages import compute_advantages
from stages.update.config import AlgorithmConfig, TrainerConfig
from stages.update.correction import is_weights, mismatch_metrics, old_policy_logprobs
from stages.update.losses import shape_overlong

TRAINABLE = ("completed", "truncated")   # failed/aborted rows are recorded, never trained


class NonFiniteUpdate(FloatingPointError):
    """trainer.on_nonfinite=stop and a mini-batch's loss or gradient norm was NaN / inf."""


def lr_at(cfg: TrainerConfig, step: int) -> float:
    """The learning rate of training step `step` (0-based): linear warm-up over lr_warmup_steps, then
    constant or a linear / cosine decay reaching lr * lr_min_ratio at lr_decay_steps."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.lr_warmup_steps) / max(1, cfg.lr_decay_steps - cfg.lr_warmup_steps))
    shape = 1 - progress if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * shape)


@dataclass
class Batch:
    """Right-padded tensors for one step: sequence = prompt + response."""
    input_ids: torch.Tensor      # [B, L]
    attn: torch.Tensor           # [B, L]
    resp_pos: torch.Tensor       # [B, T] index in the sequence of the position predicting response token t
    resp_ids: torch.Tensor       # [B, T]
    mask: torch.Tensor           # [B, T] float: trained tokens
    engine_lp: torch.Tensor      # [B, T]
    versions: torch.Tensor       # [B, T]
    rewards: torch.Tensor        # [B]
    group_ids: torch.Tensor      # [B]
    lengths: torch.Tensor        # [B]
    truncated: torch.Tensor      # [B] bool
    weights: torch.Tensor | None  # [B] a row's share of its sample (1 / its sample's rows), or None: a
                                  # trajectory that made several segment rows counts once in its group
    prompt_len: np.ndarray       # [B] prompt tokens of each row
    prompt_key: np.ndarray       # [B] rows with the same prompt tokens have the same key

    def stale(self, version: int) -> torch.Tensor:
        """[B, T] tokens an older weight version than `version` generated."""
        return (self.versions >= 0) & (self.versions < version)


def to_batch(table: pa.Table, pad_id: int) -> Batch:
    """One step's rows as right-padded tensors, filled column-wise from Arrow's flat buffers."""
    n = table.num_rows
    p_ids, r_ids = _lists(table, "prompt_ids", np.int64), _lists(table, "response_ids", np.int64)
    p_len, r_len = np.diff(p_ids[1]), np.diff(r_ids[1])
    seq_len = p_len + r_len
    L, T = int(seq_len.max(initial=0)) or 1, int(r_len.max(initial=0)) or 1
    rows_p, cols_p = _coords(p_len)            # row, column of each prompt token
    rows_r, cols_r = _coords(r_len)            # row, index in the response of each response token

    def per_token(flat, fill, dtype):
        out = np.full((n, T), fill, dtype=dtype)
        out[rows_r, cols_r] = flat
        return torch.from_numpy(out)

    ids = np.full((n, L), pad_id, dtype=np.int64)
    ids[rows_p, cols_p] = p_ids[0]
    ids[rows_r, p_len[rows_r] + cols_r] = r_ids[0]
    status = table.column("status").to_pylist()
    trainable = np.array([s in TRAINABLE for s in status], dtype=np.float32)
    keys: dict[bytes, int] = {}
    prompt_key = np.array([keys.setdefault(p_ids[0][p_ids[1][i]:p_ids[1][i + 1]].tobytes(), len(keys))
                           for i in range(n)], dtype=np.int64)
    return Batch(torch.from_numpy(ids), torch.from_numpy((np.arange(L)[None, :] < seq_len[:, None]).astype(np.int64)),
                 per_token(p_len[rows_r] - 1 + cols_r, 0, np.int64), per_token(r_ids[0], 0, np.int64),
                 per_token(_lists(table, "loss_mask", np.float32)[0] * trainable[rows_r], 0, np.float32),
                 per_token(_lists(table, "response_logprobs", np.float32)[0], 0, np.float32),
                 per_token(_lists(table, "token_versions", np.int64)[0], -1, np.int64),
                 torch.tensor(table.column("reward").to_pylist(), dtype=torch.float),
                 torch.tensor(table.column("group_id").to_pylist(), dtype=torch.long),
                 torch.from_numpy(r_len.astype(np.int64)), torch.tensor([s == "truncated" for s in status]),
                 sample_weights(table), p_len, prompt_key)


def sample_weights(table: pa.Table) -> torch.Tensor | None:
    """1 / (rows of the row's sample) when some sample made several rows (segments), else None."""
    if "sample_idx" not in table.column_names:
        return None
    samples = list(zip(table.column("group_id").to_pylist(), table.column("sample_idx").to_pylist()))
    rows_of = Counter(samples)
    return None if len(rows_of) == len(samples) else torch.tensor([1.0 / rows_of[s] for s in samples])


def _lists(table: pa.Table, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets): no Python object per token."""
    col = table.column(name).combine_chunks()
    if isinstance(col, pa.ChunkedArray):    # an empty table
        col = pa.array([], type=col.type)
    offsets = col.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    flat = col.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy(zero_copy_only=False)
    return flat.astype(dtype, copy=False), offsets - offsets[0]


def _coords(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ragged rows of these lengths: each element's row and its index within the row."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    return rows, np.arange(int(lengths.sum())) - (np.cumsum(lengths) - lengths)[rows]


def task_advantages(algo: AlgorithmConfig, b: Batch, max_new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlong shaping of rewards and mask, then the estimator's per-token advantages [B,T]."""
    rewards, mask = shape_overlong(algo, b.rewards, b.mask, b.lengths, b.truncated,
                                   max_new_tokens or int(b.lengths.max()))
    return compute_advantages(algo.advantage, rewards, b.group_ids, mask, weights=b.weights), mask


def corrected(algo: AlgorithmConfig, b: Batch, recomputed: torch.Tensor | None, mask: torch.Tensor, version: int):
    """(old log-probs, IS weights, mask, metrics): the policy the ratio is taken against and its
    correction towards the engine's; the trainer/engine gap is measured when it was recomputed."""
    old = old_policy_logprobs(algo, recomputed, b.engine_lp)
    metrics = {} if recomputed is None else mismatch_metrics(recomputed, b.engine_lp, mask, b.stale(version))
    weights, mask, is_m = is_weights(algo, old, b.engine_lp, mask)
    return old, weights, mask, metrics | is_m


def mini_batches(cfg: TrainerConfig, rng: np.random.Generator, b: Batch) -> list[np.ndarray]:
    """Sorted row indices of each mini-batch: rows // mini_batch_size of them, of random rows or of
    whole random groups (trainer.mini_batch_split)."""
    n = b.input_ids.shape[0]
    count = max(1, n // (cfg.mini_batch_size or n))
    if cfg.mini_batch_split == "rows":
        return [np.sort(idx) for idx in np.array_split(rng.permutation(n), count)]
    groups = b.group_ids.numpy()
    ids = np.unique(groups)
    return [np.flatnonzero(np.isin(groups, c)) for c in np.array_split(rng.permutation(ids), min(len(ids), count))]


def step_metrics(metrics: dict, parts: list[dict], losses: list[float], gnorms: list[float], adv, mask,
                 t0: float, lr: float, version: int, **counts) -> dict:
    """The step's metrics: the mini-batches' means (none when every one was skipped: there was no
    finite loss), `counts` as train/<name>, and no NaN / inf value (a skipped mini-batch's own)."""
    trained = mask.sum().item()
    if parts:
        metrics |= {f"train/{k}": float(np.mean([p[k] for p in parts])) for k in parts[0]}
        metrics |= {"train/loss": float(np.mean(losses)), "train/grad_norm": float(np.mean(gnorms))}
    metrics |= {f"train/{k}": v for k, v in counts.items()}
    metrics |= {"train/tokens": trained, "train/adv_abs_mean": float((adv.abs() * mask).sum() / max(trained, 1)),
                "train/seconds": time.time() - t0, "train/lr": lr, "version": version}
    return {k: v for k, v in metrics.items() if not (isinstance(v, float) and not math.isfinite(v))}


class Trainer:
    """What both trainers share: the set-up, the step around their own mini-batches and the resume clock.
    A trainer gives `published()` (its HF state dict or LoRA adapter), `_prepare` and `opt`."""

    reports = True          # a Megatron rank that does not report the step's metrics returns None
    _adopt_shared = None    # the torch trainer keeps its weights in the mesh's shared segment

    def __init__(self, cfg: TrainerConfig, algo: AlgorithmConfig, temperature: float, max_new_tokens: int):
        torch.set_num_threads(max(1, cfg.num_threads))
        torch.manual_seed(cfg.seed)
        self.cfg, self.algo = cfg, algo.resolved().for_generation_limit(max_new_tokens)
        self.temperature = temperature if temperature > 0 else 1.0
        self.max_new_tokens, self.version, self.skipped_steps = max_new_tokens, 0, 0
        self.mesh_endpoint, self.rng = None, np.random.default_rng(cfg.seed)

    def info(self) -> dict:
        return {"pid": os.getpid(), "version": self.version}

    def state_dict(self) -> dict:
        return {n: t.detach().clone() for n, t in self.published().items()}

    def mesh(self, method: str, *args, **kwargs):
        if self.mesh_endpoint is None:
            import transfer

            self.mesh_endpoint = transfer.Sender(state_fn=self.published, adopt_fn=self._adopt_shared)
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

    def clock_state(self) -> dict:
        """What a resume restores besides weights and optimizer: the RNGs and the clock."""
        return {"torch_rng": torch.get_rng_state(), "np_rng": self.rng.bit_generator.state,
                "version": self.version, "skipped_steps": self.skipped_steps}

    def restore_clock(self, state: dict) -> int:
        torch.set_rng_state(state["torch_rng"])
        self.rng.bit_generator.state = state["np_rng"]
        self.version, self.skipped_steps = int(state["version"]), int(state.get("skipped_steps", 0))
        return self.version

    def train_step(self, table: pa.Table) -> dict | None:
        """One RL update from one step's rows. `_prepare(table, b, adv, mask)` gives (metrics, advantages,
        mask, counts, mini_batch): mini_batch(i, rows) runs the step's i-th mini-batch and returns (loss,
        loss metrics or None, grad norm, why its update was not applied: "" when it was)."""
        t0, cfg = time.time(), self.cfg
        b = to_batch(table, self.pad_id)
        adv, mask = task_advantages(self.algo, b, self.max_new_tokens)
        lr, n = lr_at(cfg, self.version), len(b.rewards)
        if not mask.any():
            # No trainable token (every row failed or was masked out): nothing to forward and no optimizer
            # step, but the version advances (the clock counts steps), so the window and the lr schedule
            # move on. Every Megatron rank holds the same table, so every rank skips it.
            self.version, self.skipped_steps = self.version + 1, self.skipped_steps + 1
            return {"train/skipped_steps": self.skipped_steps, "train/tokens": 0, "train/samples": n,
                    "train/rows_not_forwarded": n, "train/nonfinite_skipped": 0, "train/seconds": time.time() - t0,
                    "train/lr": lr, "version": self.version} if self.reports else None
        metrics, adv, mask, counts, mini_batch = self._prepare(table, b, adv, mask)
        for group in self.opt.param_groups:
            group["lr"] = lr
        losses, gnorms, parts, skipped = [], [], [], 0
        for _ in range(cfg.ppo_epochs):
            for idx in mini_batches(cfg, self.rng, b):
                loss, part, gnorm, failed = mini_batch(len(losses) + skipped, idx)
                if failed:    # a NaN / inf loss or gradient, never applied: skipped and counted, or stop
                    if cfg.on_nonfinite == "stop":
                        raise NonFiniteUpdate(f"training step {self.version} (version {self.version} -> "
                                              f"{self.version + 1}), mini-batch {len(losses) + skipped + 1}: "
                                              f"{failed}; the weights were not updated (trainer.on_nonfinite=stop;"
                                              " 'skip' drops such mini-batches and goes on)")
                    skipped += 1
                    continue
                losses.append(loss)
                gnorms.append(gnorm)
                if part:
                    parts.append(part)
        self.version += 1
        if not self.reports:
            return None
        return step_metrics(metrics, parts, losses, gnorms, adv, mask, t0, lr, self.version, samples=n,
                            nonfinite_skipped=skipped, **counts, skipped_steps=self.skipped_steps)
