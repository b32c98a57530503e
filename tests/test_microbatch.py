"""Micro-batches packed by tokens: the cut respects the budget, and gradient accumulation over
the micro-batches gives the one-batch update (same weights after the step, to round-off)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from stages.update.losses import AlgorithmConfig
from stages.update.microbatch import token_micro_batches
from stages.update.step import to_batch
from stages.update.trainer import TorchTrainer, TrainerConfig


def _rows(seed: int = 0) -> list[dict]:
    """4 groups of 4: one group with a long prompt, ragged responses, mixed rewards."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for grp in range(4):
        prompt = torch.randint(3, 14, (40 if grp == 0 else 3 + grp,), generator=g).tolist()
        for i in range(4):
            k = 1 + (3 * i + grp) % 6
            rows.append({"prompt_ids": prompt, "response_ids": torch.randint(3, 14, (k,), generator=g).tolist(),
                         "response_logprobs": [-1.5] * k, "loss_mask": [1] * k, "token_versions": [0] * k,
                         "reward": float((i * 7 + grp) % 3), "group_id": grp, "status": "completed"})
    return rows


@pytest.mark.parametrize("shared", [False, True])
def test_micro_batches_keep_to_the_budget_and_cover_every_row_once(shared):
    b = to_batch(pa.Table.from_pylist(_rows()), 0)
    seq, rows = b.attn.sum(1).numpy(), torch.arange(16)
    assert token_micro_batches(seq, b.prompt_len, b.prompt_key, rows, 0, shared) == [rows]
    for budget in (1, 30, 60, 120, 10_000):
        parts = token_micro_batches(seq, b.prompt_len, b.prompt_key, rows, budget, shared)
        assert sorted(torch.cat(parts).tolist()) == list(range(16))
        for p in parts:
            keys = b.prompt_key[p.numpy()] if shared else np.arange(len(p))
            width = {k: b.prompt_len[p.numpy()][keys == k][0] + (seq[p.numpy()][keys == k] -
                                                                  b.prompt_len[p.numpy()][keys == k]).sum()
                     for k in np.unique(keys)}
            assert len(p) == 1 or len(width) * max(width.values()) <= budget    # a too-long row alone
        if budget == 10_000:
            assert len(parts) == 1
    # the long-prompt group does not pad the short rows: they run apart from it
    parts = token_micro_batches(seq, b.prompt_len, b.prompt_key, rows, 60, shared)
    long_rows = set(range(4))
    assert all(set(p.tolist()) <= long_rows or not set(p.tolist()) & long_rows for p in parts)


@pytest.mark.parametrize("share,extra", [
    (False, {"loss_agg": "token_mean"}),
    (True, {"loss_agg": "seq_mean_token_mean", "entropy_coef": 0.01}),
    (False, {"loss_agg": "seq_mean_token_sum_norm", "kl_coef": 0.05}),
    (True, {"loss_agg": "token_mean", "decoupled": True})])
def test_accumulated_micro_batches_give_the_one_batch_update(raw_model_dir, share, extra):
    table = pa.Table.from_pylist(_rows())
    weights, metrics, widest, grads = {}, {}, {}, {}
    lr = 1e-2
    for budget in (0, 50):
        tr = TorchTrainer(raw_model_dir, TrainerConfig(num_threads=1, lr=lr, mini_batch_size=8, share_prompts=share,
                                                       max_tokens_per_microbatch=budget),
                          AlgorithmConfig(**extra))
        seen, grads[budget] = [], []
        tr.model.model.register_forward_pre_hook(lambda _m, _a, kw, s=seen: s.append(kw["input_ids"].numel()),
                                                 with_kwargs=True)
        step = tr.opt.step

        def keep_grads(*a, _step=step, _g=grads[budget], _tr=tr, **kw):    # the gradient each step applies
            _g.append({n: p.grad.clone() for n, p in _tr.model.named_parameters() if p.grad is not None})
            return _step(*a, **kw)

        tr.opt.step = keep_grads
        metrics[budget] = [tr.train_step(table) for _ in range(2)]
        weights[budget] = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        widest[budget] = max(seen)          # positions laid out by the largest forward pass
    assert widest[0] > 50 >= widest[50]     # without a budget some pass is wider; with it, none
    assert len(grads[0]) == len(grads[50]) == 4          # 2 steps x 2 mini-batches
    for g0, g50 in zip(grads[0], grads[50]):
        assert g0.keys() == g50.keys()
        for name, g in g0.items():
            torch.testing.assert_close(g50[name], g, rtol=1e-4, atol=1e-5, msg=name)
    # AdamW's first steps move each weight by about lr whatever the gradient's size, so float noise in
    # a gradient that is ~0 (below Adam's eps) can move a weight differently: compare at a small part of lr
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[50][name], w, rtol=0, atol=0.05 * lr, msg=name)
    for a, b in zip(metrics[0], metrics[50]):
        for k in ("train/loss", "train/grad_norm", "train/pg_loss", "train/clipfrac", "train/entropy", "train/kl_ref"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def test_a_negative_budget_is_rejected():
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        TrainerConfig(max_tokens_per_microbatch=-1)
    with pytest.raises(ValueError, match="logprob_chunk"):
        TrainerConfig(logprob_chunk=-1)


@pytest.mark.parametrize("share", [False, True])
def test_activation_checkpointing_recomputes_long_passes_and_gives_the_same_gradient(raw_model_dir, share):
    """Above trainer.activation_checkpointing_tokens a pass runs each decoder layer again in the backward
    (it held only the layer's input); the gradient is the one without checkpointing."""
    table = pa.Table.from_pylist(_rows())
    grads, calls = {}, {}
    for limit in (0, 1):        # 0 = never; 1 = every pass is over it
        tr = TorchTrainer(raw_model_dir, TrainerConfig(num_threads=1, mini_batch_size=0, share_prompts=share,
                                                       activation_checkpointing_tokens=limit),
                          AlgorithmConfig(loss_agg="token_mean", entropy_coef=0.01))
        inner = tr.model.model.layers[0].mlp        # inside the layer: the recompute calls it again
        calls[limit] = {"grad": 0, "no_grad": 0}

        def counted(x, _f=inner.forward, _c=calls[limit]):      # (module hooks do not see a recompute)
            _c["grad" if torch.is_grad_enabled() else "no_grad"] += 1
            return _f(x)

        inner.forward = counted
        step, grads[limit] = tr.opt.step, []

        def keep_grads(*a, _step=step, _g=grads[limit], _tr=tr, **kw):
            _g.append({n: p.grad.clone() for n, p in _tr.model.named_parameters() if p.grad is not None})
            return _step(*a, **kw)

        tr.opt.step = keep_grads
        tr.train_step(table)
        assert not tr.model.is_activation_checkpointing     # off again after the pass
    # one forward with grad per step without checkpointing; with it, the backward runs the layer again
    assert calls[0]["grad"] == 1 and calls[1]["grad"] == 2
    assert grads[0][0].keys() == grads[1][0].keys()
    for name, g in grads[0][0].items():
        torch.testing.assert_close(grads[1][0][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_short_passes_are_not_checkpointed(raw_model_dir):
    """The default threshold leaves the quickstart's passes (a few hundred positions) as they were."""
    tr = TorchTrainer(raw_model_dir, TrainerConfig(num_threads=1, mini_batch_size=0), AlgorithmConfig())
    b = to_batch(pa.Table.from_pylist(_rows()), 0)
    assert tr.cfg.activation_checkpointing_tokens > 16 * int(b.attn.sum(1).max())
    with tr._checkpointing(b, torch.arange(16)):
        assert not tr.model.is_activation_checkpointing
