"""Embedded trainer: torch on an HF causal LM, in a Ray actor; its step is stages/update/step.py's.
Log-probs are taken of logits / temperature, the distribution the engine sampled from, so a fresh
on-policy token has ratio 1 up to numerics (reported as the mismatch metrics).
"""
from __future__ import annotations

import contextlib
import math
import os
import resource
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import load_file

from stages import lora as lora_lib
from stages.model import load_model
from stages.token_logprobs import position_stats, split_model
from stages.tokenizer import save_tokenizer
from stages.update.config import AlgorithmConfig, TrainerConfig
from stages.update.correction import mismatch_metrics
from stages.update.distill import apply_distill, gkd_term
from stages.update.losses import policy_loss
from stages.update.microbatch import merge_metrics, token_micro_batches
from stages.update.step import Batch, Trainer, corrected

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
    """`rows` of `b` packed by prompt (trainer.share_prompts), or None when no two of them share one.
    Each token sees the same tokens at the same positions as in the padded batch, so the log-probs
    are equal up to float rounding; a group's prompt is computed once instead of once per sample."""
    r = rows.numpy()
    uniq, inverse = np.unique(b.prompt_key[r], return_inverse=True)
    if len(uniq) == len(r):
        return None
    p_len, r_len = b.prompt_len[r], b.attn[rows].sum(1).numpy() - b.prompt_len[r]
    starts = np.zeros(len(r), dtype=np.int64)        # where each row's response starts in its sequence
    width = np.zeros(len(uniq), dtype=np.int64)
    width[inverse] = p_len              # sequence g: its prompt (its rows share it), then its rows' responses
    for i, g in enumerate(inverse):
        starts[i], width[g] = width[g], width[g] + r_len[i]
    G, W = len(uniq), int(width.max())
    if G * W * W > PACK_MASK_CELLS:     # long prompts: the [G, W, W] mask would cost more than it saves
        return None
    ids = torch.full((G, W), pad_id, dtype=torch.long)
    position = torch.zeros((G, W), dtype=torch.long)
    seg = torch.full((G, W), -1, dtype=torch.long)      # -1 pad, 0 prompt, i + 1 row i's response
    src = b.input_ids[rows]
    for i, g in enumerate(inverse):
        a, n_r, p = int(starts[i]), int(r_len[i]), int(p_len[i])
        ids[g, :p], position[g, :p], seg[g, :p] = src[i, :p], torch.arange(p), 0     # the same for each row
        ids[g, a:a + n_r], seg[g, a:a + n_r] = src[i, p:p + n_r], i + 1
        position[g, a:a + n_r] = torch.arange(p, p + n_r)
    q, k = seg[:, :, None], seg[:, None, :]
    mask = torch.ones(W, W, dtype=torch.bool).tril() & (k >= 0) & ((k == 0) | (k == q))
    mask |= torch.eye(W, dtype=torch.bool)           # a pad attends to itself: no all-masked (NaN) row
    # the position predicting response token t: the prompt's last token for t = 0, else token t - 1
    t = torch.arange(b.resp_pos.shape[1])
    starts_t, p_t = torch.from_numpy(starts), torch.from_numpy(p_len)
    pos = torch.where(t[None, :] == 0, (p_t - 1)[:, None], starts_t[:, None] + t[None, :] - 1)
    pos = pos.clamp(max=W - 1) * (t[None, :] < torch.from_numpy(r_len)[:, None])   # pads: any valid index
    return Packed(ids, position, mask[:, None], torch.from_numpy(inverse), pos)


class TorchTrainer(Trainer):
    """Ray actor: owns the policy, the optimizer and (if KL is on) a frozen reference copy."""

    def __init__(self, model_path: str, cfg: TrainerConfig, algo: AlgorithmConfig, temperature: float = 1.0,
                 max_new_tokens: int = 0, dtype: str = "float32"):
        super().__init__(cfg, algo, temperature, max_new_tokens)
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
        # with LoRA only the adapters (and their Adam state)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # torch's fused AdamW (one kernel per step, CPU included; ~10% of a quickstart update), the loop
        # where no fused kernel covers the device
        kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        try:
            self.opt = torch.optim.AdamW(self.params, fused=True, **kw)
        except (RuntimeError, ValueError):
            self.opt = torch.optim.AdamW(self.params, **kw)

    # ---- weights --------------------------------------------------------------------
    def published(self) -> dict:
        """What a version is: the HF state dict, or with LoRA the adapter alone (saved-adapter names)."""
        return {n: t.detach() for n, t in (self.adapter if self.lora else self.model.state_dict()).items()}

    def memory(self) -> dict:
        """Bytes of the trained parameters and of their optimizer state, and this process's peak RSS."""
        def size(ts):
            return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))

        return {"trainable_bytes": size(self.params), "model_bytes": size(self.model.parameters()),
                "optimizer_state_bytes": size(t for s in self.opt.state.values() for t in s.values()),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def _adopt_shared(self, views: dict) -> None:
        """Keep the weights in the TransferMesh's shared segment (the views hold their values), read in place
        by local engines. Parameters stay the same objects, so the optimizer is unaffected."""
        m = self.model
        tensors = dict(self.adapter) if self.lora else \
            dict(m.named_parameters(remove_duplicate=False)) | dict(m.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, view in views.items():
                if name in tensors:
                    tensors[name].data = view

    def save(self, path: str, tokenizer_dir: str = "", with_state: bool = True, tokenizer_staged: str = "") -> str:
        """HF-format weights (with LoRA the adapter in peft's format) and tokenizer_dir's tokenizer
        (stages/tokenizer.py save_tokenizer); with_state adds what resuming needs: optimizer, RNGs, version."""
        self.model.save_pretrained(path)
        if tokenizer_dir:
            save_tokenizer(path, tokenizer_dir, tokenizer_staged)
        if with_state:
            state = {"optimizer": self.opt.state_dict()} | self.clock_state()
            torch.save(state, os.path.join(path, "trainer_state.pt"))
        return path

    def load_state(self, path: str) -> int:
        """Resume: the weights were loaded from `path` at start; restore optimizer, RNGs and version.
        With LoRA the base was loaded at start; the adapter is the checkpoint's."""
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        if self.lora:
            saved = load_file(os.path.join(path, "adapter_model.safetensors"))
            if wrong := sorted(set(saved) ^ set(self.adapter)):
                raise ValueError(f"{path}: the adapter does not fit trainer.lora's targets ({len(wrong)} tensors "
                                 f"differ, e.g. {wrong[0]})")
            with torch.no_grad():
                for n, p in self.adapter.items():
                    if saved[n].shape != p.shape:
                        raise ValueError(f"{path}: {n} is {tuple(saved[n].shape)}, trainer.lora makes it "
                                         f"{tuple(p.shape)} (a different trainer.lora.rank?)")
                    p.copy_(saved[n])
        self.opt.load_state_dict(state["optimizer"])
        return self.restore_clock(state)

    # ---- the update -----------------------------------------------------------------
    def logprobs(self, model, b: Batch, rows: torch.Tensor | slice = slice(None), with_entropy=False,
                 topk_ids: torch.Tensor | None = None):
        """Log-probs of the sampled tokens [b,T], entropy [b,T] (or None) and, given teacher top-k ids
        [b,T,K], their log-probs (or None) under `model`; 0 past each row's response. The LM head runs on
        response positions only, trainer.logprob_chunk at a time (stages/token_logprobs.py)."""
        idx = torch.arange(len(b.input_ids))[rows]
        T = b.resp_pos.shape[1]
        real = torch.arange(T)[None, :] < b.lengths[idx][:, None]        # [b, T] response tokens
        packed = pack_shared_prompts(b, idx, self.pad_id) if self.cfg.share_prompts else None
        if packed is not None:      # a group's prompt computed once for all its samples
            inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "attention_mask": packed.mask}
            seq, pos = packed.row[:, None].expand(-1, T)[real], packed.pos[real]
        else:
            # Right padding and no attention mask: causal attention alone never lets a real token see a pad
            # (pads come after it), and only real positions are gathered; columns past the longest row go.
            inputs = {"input_ids": b.input_ids[idx][:, :int(b.attn[idx].sum(1).max())]}
            seq, pos = torch.arange(len(idx))[:, None].expand(-1, T)[real], b.resp_pos[idx][real]
        st = position_stats(model, b.resp_ids[idx][real], seq, pos, self.temperature, self.cfg.logprob_chunk,
                            entropy=with_entropy, gather_ids=None if topk_ids is None else topk_ids[real], **inputs)
        return (_scatter(real, st.logprobs), _scatter(real, st.entropy) if with_entropy else None,
                _scatter(real, st.gathered) if topk_ids is not None else None)

    def _micro_batches(self, b: Batch, rows: torch.Tensor) -> list[torch.Tensor]:
        """rows cut by trainer.max_tokens_per_microbatch (one micro-batch when it is 0)."""
        return token_micro_batches(b.attn.sum(1).numpy(), b.prompt_len, b.prompt_key, rows,
                                   self.cfg.max_tokens_per_microbatch, self.cfg.share_prompts)

    def _all_logprobs(self, b: Batch, reference: bool = False) -> torch.Tensor:
        """No-grad log-probs [B, T] of every row under the policy the engine samples (LoRA's dropout off),
        or the reference: the frozen copy, or with LoRA the base (adapter off)."""
        model = self.ref if reference and not self.lora else self.model
        dropout = self.lora is not None and self.lora.dropout > 0
        out = torch.zeros(b.resp_ids.shape)
        with torch.no_grad(), self.model.disable_adapter() if reference and self.lora else contextlib.nullcontext():
            self.model.train(not dropout)
            for rows in self._micro_batches(b, torch.arange(len(b.input_ids))):
                out[rows] = self.logprobs(model, b, rows)[0]
        self.model.train()
        return out

    def _forward_backward(self, b: Batch, rows: torch.Tensor, full: torch.Tensor, old, adv, mask, weights, ref, tb):
        """Forward and backward of `rows` (of mini-batch `full`) by micro-batch, each loss its share of
        the mini-batch's (full_mask), so the accumulated gradient is the one-batch gradient; a non-finite
        loss is not backpropagated. old .. ref: the step's [B, T] loss terms (ref may be None), tb the GKD
        distill.TeacherBatch or None. Returns (loss, loss metrics, log-probs [rows, T] detached)."""
        algo, parts, values, lps = self.algo, [], [], []
        micro = self._micro_batches(b, rows)
        for mrows in micro:
            with self._checkpointing(b, mrows):
                lp, ent, top = self.logprobs(self.model, b, mrows, with_entropy=algo.entropy_coef != 0,
                                             topk_ids=None if tb is None else tb.topk_ids[mrows])
            whole = mrows is full
            loss, m = policy_loss(algo, lp, old[mrows], adv[mrows], mask[mrows],
                                  ref_logprobs=None if ref is None else ref[mrows], entropy=ent,
                                  is_weights=weights[mrows], full_mask=None if whole else mask[full])
            if tb is not None:      # GKD: the top-k KL to the teacher, through the student
                loss, m = gkd_term(algo, loss, m, top, tb, mrows, mask[mrows],
                                   full=None if whole else (full, mask[full]))
            values.append(loss.item())
            if math.isfinite(values[-1]):
                loss.backward()
            parts.append((m, float(mask[mrows].sum())))
            lps.append(lp.detach())
        order = torch.argsort(torch.cat(micro))          # micro-batches back in `rows` order
        return sum(values), merge_metrics(parts), torch.cat(lps)[order]

    @contextlib.contextmanager
    def _checkpointing(self, b: Batch, rows: torch.Tensor):
        """HF activation checkpointing (on a peft model's base) while a pass over `rows` runs, if they lay out
        more than trainer.activation_checkpointing_tokens positions (rows x the longest of them); a model
        without HF's support runs as it is. Non-reentrant checkpoints need no gradient on their inputs, so
        the embedding hook HF adds for them is taken off (it would pile up, one per call)."""
        limit, m = self.cfg.activation_checkpointing_tokens, self.model
        hf = m.get_base_model() if hasattr(m, "peft_config") else m
        if not limit or len(rows) * int(b.attn[rows].sum(1).max()) <= limit or \
                not getattr(hf, "supports_gradient_checkpointing", False):
            yield
            return
        new = hasattr(hf, "activation_checkpointing_enable")       # transformers >= 5.x's name
        (hf.activation_checkpointing_enable if new else hf.gradient_checkpointing_enable)({"use_reentrant": False})
        hf.disable_input_require_grads()
        try:
            yield
        finally:
            (hf.activation_checkpointing_disable if new else hf.gradient_checkpointing_disable)()

    def _prepare(self, table: pa.Table, b: Batch, adv: torch.Tensor, mask: torch.Tensor):
        """The step's log-probs, IS correction and distillation, and its mini-batch (step.Trainer.train_step)."""
        algo, cfg = self.algo, self.cfg
        # decoupled: no recompute pass; the gap is measured on the first mini-batch instead, whose
        # forward runs under the same weights the recompute would have used
        recomputed = None if algo.decoupled else self._all_logprobs(b)
        ref_lp = self._all_logprobs(b, reference=True) if algo.kl_coef > 0 else None
        old, weights, mask, metrics = corrected(algo, b, recomputed, mask, self.version)
        adv, distill_m, tb = apply_distill(algo, table, adv, old, mask, b.resp_ids)   # on-policy distillation
        metrics |= distill_m
        counts = {"rows_not_forwarded": 0}
        # rows with no gradient: every trained token's advantage is 0 and no other term reaches them
        # (the entropy term reaches every row unless algorithm.entropy_rows=trained keeps it to the others)
        live = ((adv * mask) != 0).any(1) if cfg.skip_zero_advantage and ref_lp is None and tb is None and \
            (algo.entropy_coef == 0 or algo.entropy_rows == "trained") else None

        def mini_batch(i: int, idx: np.ndarray):
            rows = full = torch.as_tensor(idx)
            measure = recomputed is None and i == 0     # decoupled: the gap, on every row
            if live is not None and not measure:
                rows = full[live[full]]
            if not mask[rows].any():    # no live row or no trained token: a zero gradient, so no forward;
                rows = rows[:0]         # AdamW still steps, as the full update would
            counts["rows_not_forwarded"] += len(full) - len(rows)
            self.opt.zero_grad(set_to_none=True)
            if len(rows) == 0:
                for p in self.params:
                    p.grad = torch.zeros_like(p)
                self.opt.step()
                return 0.0, None, 0.0, ""
            value, m, lp = self._forward_backward(b, rows, full, old, adv, mask, weights, ref_lp, tb)
            if measure:
                metrics.update(mismatch_metrics(lp, b.engine_lp[rows], mask[rows], b.stale(self.version)[rows]))
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip, foreach=True)) \
                if math.isfinite(value) else math.nan   # the gradients of every micro-batch are in
            if not math.isfinite(gnorm):
                self.opt.zero_grad(set_to_none=True)
                return value, m, gnorm, f"non-finite loss {value}" if not math.isfinite(value) else \
                    f"non-finite grad norm {gnorm} (loss {value})"
            self.opt.step()
            return value, m, gnorm, ""

        return metrics, adv, mask, counts, mini_batch


def _scatter(where: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values [N, ...] laid in order at where's True entries of zeros [b, T, ...]; differentiable."""
    out = values.new_zeros((*where.shape, *values.shape[1:]))
    return out.index_put(torch.nonzero(where, as_tuple=True), values)
