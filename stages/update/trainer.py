"""Embedded trainer: torch on an HF causal LM, in a Ray actor.

One `train_step(table)` = one RL update from one step's trajectories:
rewards -> (overlong shaping) -> advantages -> [recompute old log-probs] -> IS correction
-> mini-batches of the policy loss -> optimizer steps. Log-probs are taken of
logits / temperature, the distribution the engine sampled from, so a fresh on-policy
token has ratio 1 up to numerics (reported as the mismatch metrics).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from stages import lora as lora_lib
from stages.model import load_model
from stages.token_logprobs import position_stats, split_model
from stages.update.advantages import compute_advantages
from stages.update.config import AlgorithmConfig, TrainerConfig
from stages.update.correction import is_weights, mismatch_metrics, old_policy_logprobs
from stages.update.distill import apply_distill, gkd_term
from stages.update.losses import policy_loss, shape_overlong
from stages.update.microbatch import merge_metrics, token_micro_batches

TRAINABLE = ("completed", "truncated")   # failed/aborted rows are recorded, never trained


class NonFiniteUpdate(FloatingPointError):
    """trainer.on_nonfinite=stop and a mini-batch's loss or gradient norm was NaN / inf."""


def on_nonfinite(cfg: TrainerConfig, step: int, mini_batch: int, what: str) -> None:
    """A mini-batch's loss or gradients were NaN / inf (`what` says which): its update is not applied
    (trainer.on_nonfinite=skip; the caller counts it), or NonFiniteUpdate naming the step (stop)."""
    if cfg.on_nonfinite == "stop":
        raise NonFiniteUpdate(f"training step {step} (version {step} -> {step + 1}), mini-batch {mini_batch}: "
                              f"{what}; the weights were not updated (trainer.on_nonfinite=stop; "
                              "'skip' drops such mini-batches and goes on)")


def finite_metrics(metrics: dict) -> dict:
    """The step's metrics without NaN / inf values (a skipped mini-batch's own numbers)."""
    return {k: v for k, v in metrics.items() if not (isinstance(v, float) and not math.isfinite(v))}


def lr_at(cfg: TrainerConfig, step: int) -> float:
    """The learning rate of training step `step` (0-based; the trainer's version before the step):
    linear warm-up over lr_warmup_steps, then constant or a linear / cosine decay that reaches
    lr * lr_min_ratio at lr_decay_steps and stays there. A function of the step alone, so a
    resumed run (its version restored) continues the schedule where it stopped."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.lr_decay_steps - cfg.lr_warmup_steps)
    progress = min(1.0, (step - cfg.lr_warmup_steps) / span)
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
    weights: torch.Tensor | None = None   # [B] a row's share of its sample (1/rows of that sample): a trajectory
                                          # that made several segment rows counts once in its group's statistics
    prompt_len: np.ndarray | None = None  # [B] prompt tokens of each row
    prompt_key: np.ndarray | None = None  # [B] rows with the same prompt tokens have the same key


def to_batch(table: pa.Table, pad_id: int) -> Batch:
    """One step's rows as right-padded tensors, filled column-wise from Arrow's flat buffers."""
    n = table.num_rows
    p_ids, r_ids = _lists(table, "prompt_ids", np.int64), _lists(table, "response_ids", np.int64)
    p_len, r_len = np.diff(p_ids[1]), np.diff(r_ids[1])
    seq_len = p_len + r_len
    L, T = int(seq_len.max(initial=0)) or 1, int(r_len.max(initial=0)) or 1
    rows_p, cols_p = _coords(p_len)            # row, column of each prompt token
    rows_r, cols_r = _coords(r_len)            # row, index in the response of each response token
    ids = np.full((n, L), pad_id, dtype=np.int64)
    ids[rows_p, cols_p] = p_ids[0]
    ids[rows_r, p_len[rows_r] + cols_r] = r_ids[0]
    attn = (np.arange(L)[None, :] < seq_len[:, None]).astype(np.int64)
    pos = np.zeros((n, T), dtype=np.int64)
    pos[rows_r, cols_r] = p_len[rows_r] - 1 + cols_r
    rid = np.zeros((n, T), dtype=np.int64)
    rid[rows_r, cols_r] = r_ids[0]
    status = table.column("status").to_pylist()
    trainable = np.array([s in TRAINABLE for s in status], dtype=np.float32)
    mask = np.zeros((n, T), dtype=np.float32)
    mask[rows_r, cols_r] = _lists(table, "loss_mask", np.float32)[0] * trainable[rows_r]
    elp = np.zeros((n, T), dtype=np.float32)
    elp[rows_r, cols_r] = _lists(table, "response_logprobs", np.float32)[0]
    ver = np.full((n, T), -1, dtype=np.int64)
    ver[rows_r, cols_r] = _lists(table, "token_versions", np.int64)[0]
    t = torch.from_numpy
    return Batch(t(ids), t(attn), t(pos), t(rid), t(mask), t(elp), t(ver),
                 torch.tensor(table.column("reward").to_pylist(), dtype=torch.float),
                 torch.tensor(table.column("group_id").to_pylist(), dtype=torch.long), t(r_len.astype(np.int64)),
                 torch.tensor([s == "truncated" for s in status]), _sample_weights(table), p_len,
                 _prompt_keys(p_ids, n))


def _prompt_keys(p_ids: tuple[np.ndarray, np.ndarray], n: int) -> np.ndarray:
    """One integer per row, equal for rows whose prompt tokens are equal (a group's samples)."""
    flat, off = p_ids
    seen: dict[bytes, int] = {}
    return np.array([seen.setdefault(flat[off[i]:off[i + 1]].tobytes(), len(seen)) for i in range(n)], dtype=np.int64)


@dataclass
class Terms:
    """What a step's loss reads besides the log-probs: per-token [B, T] tensors of the whole step."""
    old: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    ref: torch.Tensor | None = None
    tb: object | None = None        # distill.TeacherBatch (GKD) or None


# Prompt packing needs a [G, 1, W, W] attention mask, which attention may widen to float: past this
# many cells (a 8k-token packed sequence) the rows run padded, under the causal mask alone.
PACK_MASK_CELLS = 8192 * 8192


@dataclass
class Packed:
    """Rows that share a prompt laid out as one sequence: the prompt once, then each row's response,
    every response attending to the prompt and to itself only (positions continue from the prompt)."""
    input_ids: torch.Tensor      # [G, W]
    position_ids: torch.Tensor   # [G, W]
    mask: torch.Tensor           # [G, 1, W, W] bool: may attend
    row: torch.Tensor            # [n] packed sequence of each given row
    pos: torch.Tensor            # [n, T] position in it predicting each response token


def pack_shared_prompts(b: Batch, rows: torch.Tensor, pad_id: int) -> Packed | None:
    """`rows` of `b` packed by prompt, or None when no two of them share one (nothing to save).
    Log-probs through it equal the padded batch's up to float rounding: each token sees the same
    tokens at the same positions; a group's prompt is computed once instead of once per sample."""
    r = rows.numpy()
    keys = b.prompt_key[r]
    uniq, inverse = np.unique(keys, return_inverse=True)
    if len(uniq) == len(r):
        return None
    p_len = b.prompt_len[r]
    r_len = b.attn[rows].sum(1).numpy() - p_len
    # packed layout: per sequence g, its prompt (from its first row) then its rows' responses in order
    starts = np.zeros(len(r), dtype=np.int64)        # where each row's response starts in its sequence
    width = np.zeros(len(uniq), dtype=np.int64)
    first = np.full(len(uniq), -1)
    for i, g in enumerate(inverse):
        if first[g] < 0:
            first[g], width[g] = i, p_len[i]
        starts[i] = width[g]
        width[g] += r_len[i]
    W = int(width.max())
    G = len(uniq)
    if G * W * W > PACK_MASK_CELLS:     # long prompts: the [G, W, W] mask would cost more than it saves
        return None
    ids = torch.full((G, W), pad_id, dtype=torch.long)
    position = torch.zeros((G, W), dtype=torch.long)
    seg = torch.full((G, W), -1, dtype=torch.long)      # -1 pad, 0 prompt, i + 1 row i's response
    src = b.input_ids[rows]
    for g in range(G):
        i = int(first[g])
        ids[g, :p_len[i]] = src[i, :p_len[i]]
        position[g, :p_len[i]] = torch.arange(int(p_len[i]))
        seg[g, :p_len[i]] = 0
    for i, g in enumerate(inverse):
        a, n_r, p = int(starts[i]), int(r_len[i]), int(p_len[i])
        ids[g, a:a + n_r] = src[i, p:p + n_r]
        position[g, a:a + n_r] = torch.arange(p, p + n_r)
        seg[g, a:a + n_r] = i + 1
    q, k = seg[:, :, None], seg[:, None, :]
    causal = torch.ones(W, W, dtype=torch.bool).tril()
    mask = causal & (k >= 0) & ((k == 0) | (k == q))
    mask |= torch.eye(W, dtype=torch.bool)           # a pad attends to itself: no all-masked (NaN) row
    # the position predicting response token t: the prompt's last token for t = 0, else token t - 1
    t = torch.arange(b.resp_pos.shape[1])
    starts_t, p_t = torch.from_numpy(starts), torch.from_numpy(p_len)
    pos = torch.where(t[None, :] == 0, (p_t - 1)[:, None], starts_t[:, None] + t[None, :] - 1)
    pos = pos.clamp(max=W - 1) * (t[None, :] < torch.from_numpy(r_len)[:, None])   # pads: any valid index
    return Packed(ids, position, mask[:, None], torch.from_numpy(inverse), pos)


@contextlib.contextmanager
def activation_checkpointing(model):
    """HF activation checkpointing on `model` (a peft model: its base) while the block runs: each
    decoder layer keeps its input only and is run again in the backward. Non-reentrant checkpoints
    need no gradient on their inputs, so the embedding hook HF adds for them is taken off again (it
    would pile up, one per call). The backward's recompute needs no flag (torch holds the layer's
    function), so it may run after the block. A model without HF's support runs as it is."""
    hf = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    if not getattr(hf, "supports_gradient_checkpointing", False):
        yield
        return
    if hasattr(hf, "activation_checkpointing_enable"):       # transformers >= 5.x's name
        hf.activation_checkpointing_enable({"use_reentrant": False})
        off = hf.activation_checkpointing_disable
    else:
        hf.gradient_checkpointing_enable({"use_reentrant": False})
        off = hf.gradient_checkpointing_disable
    hf.disable_input_require_grads()
    try:
        yield
    finally:
        off()


def _sample_weights(table: pa.Table) -> torch.Tensor | None:
    """1 / (rows of the row's sample) when some sample made several rows (segments), else None."""
    if "sample_idx" not in table.column_names:
        return None
    keys = list(zip(table.column("group_id").to_pylist(), table.column("sample_idx").to_pylist()))
    counts: dict = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    if len(counts) == len(keys):
        return None
    return torch.tensor([1.0 / counts[k] for k in keys], dtype=torch.float)


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
    starts = np.cumsum(lengths) - lengths
    return rows, np.arange(int(lengths.sum())) - starts[rows]


def task_advantages(algo: AlgorithmConfig, b: Batch, max_new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlong shaping of rewards and mask, then the estimator's per-token advantages [B,T]
    (both trainers start every update here)."""
    rewards, mask = shape_overlong(algo, b.rewards, b.mask, b.lengths, b.truncated,
                                   max_new_tokens or int(b.lengths.max()))
    return compute_advantages(algo.advantage, rewards, b.group_ids, mask, weights=b.weights), mask


def skipped_step(n: int, lr: float, version: int, skipped_steps: int, t0: float) -> dict:
    """The metrics of a step with no trainable token (every row failed before its first model
    call, or every token was masked out): nothing to forward and no optimizer step. The caller
    still advances the version (the clock counts steps; the weights are unchanged), so the
    window moves on, the lr schedule keeps its place and the run goes on to its end.
    `skipped_steps` counts such steps over the run, this one included."""
    return {"train/skipped_steps": skipped_steps, "train/tokens": 0, "train/samples": n,
            "train/rows_not_forwarded": n, "train/nonfinite_skipped": 0, "train/seconds": time.time() - t0,
            "train/lr": lr, "version": version}


def mini_batches(cfg: TrainerConfig, rng: np.random.Generator, b: Batch, n: int, mb: int) -> list[np.ndarray]:
    """Row indices of each mini-batch: n // mb of them, of random rows or of whole random groups."""
    if cfg.mini_batch_split == "rows":
        return np.array_split(rng.permutation(n), max(1, n // mb))
    groups = b.group_ids.numpy()
    ids = np.unique(groups)
    chunks = np.array_split(rng.permutation(ids), max(1, min(len(ids), n // mb)))
    return [np.flatnonzero(np.isin(groups, c)) for c in chunks]


def adamw(params: list, cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW, fused into one kernel per step where torch has one for these parameters
    (measured 7-10% of a quickstart update saved on CPU against the per-tensor loop)."""
    kw = {"lr": cfg.lr, "betas": tuple(cfg.betas), "weight_decay": cfg.weight_decay}
    if cfg.fused_optimizer:
        try:
            return torch.optim.AdamW(params, fused=True, **kw)
        except (RuntimeError, ValueError):      # a device or dtype the fused kernel does not cover
            pass
    return torch.optim.AdamW(params, **kw)


class TorchTrainer:
    """Ray actor: owns the policy, the optimizer and (if KL is on) a frozen reference copy."""

    def __init__(self, model_path: str, cfg: TrainerConfig, algo: AlgorithmConfig, temperature: float = 1.0,
                 max_new_tokens: int = 0, dtype: str = "float32"):
        torch.set_num_threads(max(1, cfg.num_threads))
        torch.manual_seed(cfg.seed)
        self.cfg, self.algo = cfg, algo.resolved().for_generation_limit(max_new_tokens)
        self.temperature = temperature if temperature > 0 else 1.0
        self.max_new_tokens = max_new_tokens
        self.lora = cfg.lora if cfg.lora.enabled else None
        self.model = load_model(model_path, dtype)
        self.pad_id = self.model.config.pad_token_id or 0
        if self.lora:   # peft's layers around the base; the reference policy is the base itself (adapter off)
            self.model = lora_lib.wrap(self.model, self.lora, model_path)
            self.adapter = lora_lib.adapter_params(self.model)
        self.model.train()
        self.ref = load_model(model_path, dtype) if self.algo.kl_coef > 0 and not self.lora else None
        for m in (self.model, self.ref):    # how logits are made, checked once now, not in the first step
            if m is not None:
                split_model(m)
        # walked once: clipping uses it every mini-batch; with LoRA only the adapters (and their Adam state)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = adamw(self.params, cfg)
        self.version = 0
        self.skipped_steps = 0      # steps with no trainable token over the run (skipped_step)
        self.mesh_endpoint = None
        self.rng = np.random.default_rng(cfg.seed)

    # ---- weights --------------------------------------------------------------------
    def published(self) -> dict:
        """What a version is: the HF state dict, or with LoRA the adapter alone (saved-adapter names)."""
        if self.lora:
            return {n: p.detach() for n, p in self.adapter.items()}
        return {n: t.detach() for n, t in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        return {n: t.clone() for n, t in self.published().items()}

    def info(self) -> dict:
        return {"pid": os.getpid(), "version": self.version}

    def memory(self) -> dict:
        """Bytes of the trained parameters and of their optimizer state, and this process's peak RSS."""
        import resource

        state = sum(t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values()
                    if torch.is_tensor(t))
        return {"trainable_bytes": sum(p.numel() * p.element_size() for p in self.params),
                "model_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
                "optimizer_state_bytes": state,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def mesh(self, method: str, *args, **kwargs):
        if self.mesh_endpoint is None:
            import transfer

            self.mesh_endpoint = transfer.Sender(state_fn=self.published, adopt_fn=self._adopt_shared)
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

    def _adopt_shared(self, views: dict) -> None:
        """Keep the weights in the TransferMesh's shared segment (views hold their current
        values): local engines then read each version in place and publishing copies
        nothing here. Parameters stay the same objects, so the optimizer is unaffected."""
        if self.lora:
            tensors = dict(self.adapter)
        else:
            tensors = dict(self.model.named_parameters(remove_duplicate=False))
            tensors |= dict(self.model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, view in views.items():
                if name in tensors:
                    tensors[name].data = view

    def save(self, path: str, tokenizer_dir: str = "", with_state: bool = True, tokenizer_staged: str = "") -> str:
        """HF-format weights (+ tokenizer_dir's tokenizer, copied from tokenizer_staged when this host has
        it: stages/tokenizer.py save_tokenizer); with_state adds what resuming needs: optimizer, RNGs,
        version. With LoRA: the adapter in peft's format (adapter_model.safetensors, adapter_config.json
        whose base_model_name_or_path is the HF base it was trained on)."""
        self.model.save_pretrained(path)
        if tokenizer_dir:
            from stages.tokenizer import save_tokenizer

            save_tokenizer(path, tokenizer_dir, tokenizer_staged)
        if with_state:
            torch.save({"optimizer": self.opt.state_dict(), "torch_rng": torch.get_rng_state(),
                        "np_rng": self.rng.bit_generator.state, "version": self.version,
                        "skipped_steps": self.skipped_steps},
                       os.path.join(path, "trainer_state.pt"))
        return path

    def load_state(self, path: str) -> int:
        """Resume: the weights were loaded from `path` at start; restore optimizer, RNGs and version."""
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        if self.lora:   # the base was loaded at start; the adapter is the checkpoint's
            self._load_adapter(path)
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.rng.bit_generator.state = state["np_rng"]
        self.version = int(state["version"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        return self.version

    def _load_adapter(self, path: str) -> None:
        from safetensors.torch import load_file

        saved = load_file(os.path.join(path, "adapter_model.safetensors"))
        wrong = sorted(set(saved) ^ set(self.adapter))
        if wrong:
            raise ValueError(f"{path}: the adapter does not fit trainer.lora's targets ({len(wrong)} tensors "
                             f"differ, e.g. {wrong[0]})")
        with torch.no_grad():
            for n, p in self.adapter.items():
                if saved[n].shape != p.shape:
                    raise ValueError(f"{path}: {n} is {tuple(saved[n].shape)}, trainer.lora makes it "
                                     f"{tuple(p.shape)} (a different trainer.lora.rank?)")
                p.copy_(saved[n])

    def _ref_logprobs(self, b: Batch):
        """The reference policy's log-probs (KL term): the frozen copy, or with LoRA the base (adapter off)."""
        if self.lora:
            with self.model.disable_adapter(), self._no_dropout():
                return self._all_logprobs(self.model, b)
        return self._all_logprobs(self.ref, b)

    def _all_logprobs(self, model, b: Batch) -> torch.Tensor:
        """Log-probs [B, T] of every row of the step (no grad), micro-batch by micro-batch."""
        micro = self._micro_batches(b, torch.arange(len(b.input_ids)))
        if len(micro) == 1:
            return self.logprobs(model, b)[0]
        out = torch.zeros(b.resp_ids.shape)
        for rows in micro:
            out[rows] = self.logprobs(model, b, rows)[0]
        return out

    def _no_dropout(self):
        """No-grad passes (recompute, reference) see the policy the engine samples: LoRA's dropout off."""
        if not (self.lora and self.lora.dropout):
            return contextlib.nullcontext()
        return _eval_mode(self.model)

    # ---- the update -----------------------------------------------------------------
    def logprobs(self, model, b: Batch, rows: torch.Tensor | slice = slice(None), with_entropy=False,
                 topk_ids: torch.Tensor | None = None):
        """Log-probs of the sampled tokens [b,T], entropy [b,T] (or None) and, given teacher
        top-k ids [b,T,K], the log-probs of those ids [b,T,K] (or None), all under `model`; 0 past
        each row's response. The LM head runs on response positions only, trainer.logprob_chunk
        of them at a time (stages/token_logprobs.py): no [T, V] tensor over whole sequences."""
        idx = torch.arange(len(b.input_ids))[rows]
        T = b.resp_pos.shape[1]
        real = torch.arange(T)[None, :] < b.lengths[idx][:, None]        # [b, T] response tokens
        packed = pack_shared_prompts(b, idx, self.pad_id) \
            if self.cfg.share_prompts and b.prompt_key is not None else None
        if packed is not None:      # a group's prompt computed once for all its samples
            inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                      "attention_mask": packed.mask}
            seq, pos = packed.row[:, None].expand(-1, T)[real], packed.pos[real]
        else:
            width = int(b.attn[idx].sum(1).max())      # right padding: columns past the longest row are all padding
            # No attention mask: with right padding, causal attention alone never lets a real token see
            # a pad (pads come after it), and only real positions are gathered. Bit-identical
            # log-probs, and the model builds no padding mask (~6% of a quickstart mini-batch).
            inputs = {"input_ids": b.input_ids[idx][:, :width]}
            seq, pos = torch.arange(len(idx))[:, None].expand(-1, T)[real], b.resp_pos[idx][real]
        st = position_stats(model, b.resp_ids[idx][real], seq, pos, self.temperature, self.cfg.logprob_chunk,
                            entropy=with_entropy, gather_ids=None if topk_ids is None else topk_ids[real], **inputs)
        lp = _scatter(real, st.logprobs)
        ent = _scatter(real, st.entropy) if with_entropy else None
        top = _scatter(real, st.gathered) if topk_ids is not None else None
        return lp, ent, top

    def _micro_batches(self, b: Batch, rows: torch.Tensor) -> list[torch.Tensor]:
        """rows cut by trainer.max_tokens_per_microbatch (one micro-batch when it is 0)."""
        return token_micro_batches(b.attn.sum(1).numpy(), b.prompt_len, b.prompt_key, rows,
                                   self.cfg.max_tokens_per_microbatch, self.cfg.share_prompts)

    def _forward_backward(self, b: Batch, rows: torch.Tensor, full: torch.Tensor, t: Terms):
        """Forward and backward of one optimizer step's `rows` (of mini-batch `full`), micro-batch by
        micro-batch, gradients accumulated: (loss value, loss metrics, log-probs [rows, T] detached).
        Each micro-batch's loss is its share of the mini-batch's (policy_loss's full_mask), so the
        accumulated gradient is the one-batch gradient. A non-finite loss is not backpropagated."""
        algo, parts, values, lps = self.algo, [], [], []
        micro = self._micro_batches(b, rows)
        for mrows in micro:
            with self._checkpointing(b, mrows):
                lp, ent, top = self.logprobs(self.model, b, mrows, with_entropy=algo.entropy_coef != 0,
                                             topk_ids=None if t.tb is None else t.tb.topk_ids[mrows])
            whole = mrows is full
            loss, m = policy_loss(algo, lp, t.old[mrows], t.adv[mrows], t.mask[mrows],
                                  ref_logprobs=None if t.ref is None else t.ref[mrows], entropy=ent,
                                  is_weights=t.weights[mrows], full_mask=None if whole else t.mask[full])
            if t.tb is not None:      # GKD: the top-k KL to the teacher, through the student
                loss, m = gkd_term(algo, loss, m, top, t.tb, mrows, t.mask[mrows],
                                   full=None if whole else (full, t.mask[full]))
            values.append(loss.item())
            if math.isfinite(values[-1]):
                loss.backward()
            parts.append((m, float(t.mask[mrows].sum())))
            lps.append(lp.detach())
        order = torch.argsort(torch.cat(micro))          # micro-batches back in `rows` order
        return sum(values), merge_metrics(parts), torch.cat(lps)[order] if len(lps) > 1 else lps[0]

    def _checkpointing(self, b: Batch, rows: torch.Tensor):
        """Activation checkpointing on while a pass over `rows` runs, if they lay out more than
        trainer.activation_checkpointing_tokens positions (rows x the longest of them)."""
        limit = self.cfg.activation_checkpointing_tokens
        if not limit or len(rows) * b.attn.shape[1] <= limit:      # the batch's width bounds the longest row
            return contextlib.nullcontext()
        if len(rows) * int(b.attn[rows].sum(1).max()) <= limit:
            return contextlib.nullcontext()
        return activation_checkpointing(self.model)

    def _mini_batches(self, b: Batch, n: int, mb: int) -> list[np.ndarray]:
        return mini_batches(self.cfg, self.rng, b, n, mb)

    def _zero_step(self):
        """The optimizer step of a mini-batch whose gradient is exactly zero (no forward needed)."""
        self.opt.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.opt.step()

    def train_step(self, table: pa.Table) -> dict:
        t0 = time.time()
        b = to_batch(table, self.pad_id)
        algo = self.algo
        adv, mask = task_advantages(algo, b, self.max_new_tokens)
        if not mask.any():      # every row failed or was masked out: nothing to train on
            self.version, self.skipped_steps = self.version + 1, self.skipped_steps + 1
            return skipped_step(len(b.rewards), lr_at(self.cfg, self.version - 1), self.version,
                                self.skipped_steps, t0)
        with torch.no_grad():
            with self._no_dropout():
                recomputed = None if algo.decoupled else self._all_logprobs(self.model, b)
            ref_lp = self._ref_logprobs(b) if algo.kl_coef > 0 else None
        old = old_policy_logprobs(algo, recomputed, b.engine_lp)
        stale = (b.versions >= 0) & (b.versions < self.version)
        # decoupled: no recompute pass; the gap is measured on the first mini-batch instead,
        # whose forward runs under the same weights the recompute would have used
        metrics = {} if recomputed is None else mismatch_metrics(recomputed, b.engine_lp, mask, stale)
        weights, mask, is_m = is_weights(algo, old, b.engine_lp, mask)
        metrics |= is_m
        adv, distill_m, tb = apply_distill(algo, table, adv, old, mask, b.resp_ids)   # on-policy distillation
        metrics |= distill_m
        n = b.input_ids.shape[0]
        mb = self.cfg.mini_batch_size or n
        lr = lr_at(self.cfg, self.version)
        for group in self.opt.param_groups:
            group["lr"] = lr
        losses, gnorms, parts, skipped, mb_i = [], [], [], 0, 0
        # rows with no gradient: every trained token's advantage is 0 and no other term reaches them
        # (the entropy term reaches every row, unless algorithm.entropy_rows=trained keeps it to the others)
        live = ((adv * mask) != 0).any(1) if (self.cfg.skip_zero_advantage and ref_lp is None and tb is None
                                                and (algo.entropy_coef == 0 or algo.entropy_rows == "trained")) \
            else None
        not_forwarded = 0
        for _ in range(self.cfg.ppo_epochs):
            for idx in self._mini_batches(b, n, mb):
                rows = full = torch.as_tensor(np.sort(idx))
                measure = recomputed is None and mb_i == 0      # the mismatch metrics see every row
                if live is not None and not measure:
                    rows = full[live[full]]
                if not mask[rows].any():    # no live row, or no trained token (failed rows): a zero gradient,
                    rows = rows[:0]         # so no forward; AdamW still steps, as the full update would
                not_forwarded += len(full) - len(rows)
                if len(rows) == 0:
                    self._zero_step()
                    mb_i += 1
                    losses.append(0.0)
                    gnorms.append(0.0)
                    continue
                self.opt.zero_grad(set_to_none=True)
                value, m, lp = self._forward_backward(b, rows, full, Terms(old, adv, mask, weights, ref_lp, tb))
                mb_i += 1
                if measure:
                    metrics |= mismatch_metrics(lp, b.engine_lp[rows], mask[rows], stale[rows])
                bad = "" if math.isfinite(value) else f"non-finite loss {value}"
                if not bad:     # the gradients of every micro-batch are in
                    gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True))
                    bad = "" if math.isfinite(gnorm) else f"non-finite grad norm {gnorm} (loss {value})"
                if bad:         # never applied: weights and optimizer state stay as they were
                    on_nonfinite(self.cfg, self.version, mb_i, bad)
                    self.opt.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                self.opt.step()
                losses.append(value)
                gnorms.append(gnorm)
                parts.append(m)
        self.version += 1
        trained = mask.sum().item()
        if parts:       # no loss metrics when every mini-batch was skipped: there was no finite loss
            metrics |= {f"train/{k}": float(np.mean([p[k] for p in parts])) for k in parts[0]}
            metrics |= {"train/loss": float(np.mean(losses)), "train/grad_norm": float(np.mean(gnorms))}
        metrics |= {"train/nonfinite_skipped": skipped, "train/tokens": trained, "train/samples": n,
                    "train/rows_not_forwarded": not_forwarded, "train/skipped_steps": self.skipped_steps,
                    "train/seconds": time.time() - t0,
                    "train/adv_abs_mean": float((adv.abs() * mask).sum() / max(trained, 1)),
                    "train/lr": lr, "version": self.version}
        return finite_metrics(metrics)


def _scatter(where: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values [N, ...] laid into a zero tensor of where's shape [b, T] (+ values' trailing dims)
    at where's True entries, in order; differentiable through values."""
    out = values.new_zeros((*where.shape, *values.shape[1:]))
    return out.index_put(torch.nonzero(where, as_tuple=True), values)


@contextlib.contextmanager
def _eval_mode(model):
    model.eval()
    try:
        yield
    finally:
        model.train()
