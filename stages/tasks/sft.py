"""Supervised warm-up: teach a fresh tiny model the output format so RL has signal.

Used to make the built-in quickstart policy and, later, specialist teachers. Loss is on
the answer characters and the closing <eos> only (prompt tokens are context). A row with
a `demo` ([(text, trained?), ...], e.g. a tool-use trajectory) is trained on that instead:
loss on the trained pieces and the closing <eos>, the others (tool results) are context.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from transfer.compat.transformers_api import attn_implementation


def encode_sft_rows(tok, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Each row's token ids and labels (-100 = ignored by the loss), unpadded."""
    out = []
    for r in rows:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        seq, lab = list(p), [-100] * len(p)
        # a demonstrated trajectory: [(text, trained?), ...]; otherwise the bare answer
        for text, trained in r.get("demo") or [(r["answer"], True)]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            seq += ids
            lab += ids if trained else [-100] * len(ids)
        out.append((seq + [tok.eos_token_id], lab + [tok.eos_token_id]))
    return out


def pad_sft_batch(encoded: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, ...]:
    """Right-padded input ids, attention mask and labels of encoded rows."""
    width = max(len(s) for s, _ in encoded)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s, _ in encoded])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in encoded])
    lab = torch.tensor([lb + [-100] * (width - len(lb)) for _, lb in encoded])
    return ids, mask, lab


def sft(model, tok, rows: list[dict], steps: int, lr: float = 1e-3, batch_size: int = 64,
        seed: int = 1, warmup: int = 50, label_smoothing: float = 0.0, log=None) -> dict:
    """AdamW with linear warm-up then constant lr; returns the final loss and wall time.

    label_smoothing > 0 trains toward (1 - e) on the demonstrated token and e spread over the
    vocabulary: the model learns which answer is right but samples it with less confidence."""
    model.train()
    # eager attention: faster than sdpa on CPU at these sizes; the saved model loads with the default again
    attn = attn_implementation(model)
    if attn == "sdpa" and next(model.parameters()).device.type == "cpu" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    encoded = encode_sft_rows(tok, rows)      # once, not every step
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    rng = np.random.default_rng(seed)
    t0, loss_v = time.time(), math.nan
    for step in range(steps):
        pick = rng.choice(len(rows), size=min(batch_size, len(rows)), replace=False)
        ids, mask, lab = pad_sft_batch([encoded[i] for i in pick], tok.pad_token_id)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                                                 ignore_index=-100, label_smoothing=label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = loss.item()
        if log and (step % 100 == 0 or step == steps - 1):
            log(f"sft step {step}/{steps} loss {loss_v:.4f}")
    model.eval()
    if attn == "sdpa" and attn_implementation(model) != attn:
        model.set_attn_implementation(attn)
    return {"loss": loss_v, "seconds": time.time() - t0}
