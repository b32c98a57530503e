"""On-policy distillation: the teachers' scores (stages/teacher) of the tokens y ~ pi_S the student
sampled -> a training signal, two ways, both pure functions of [B,T] tensors:

* pg (policy-gradient OPD): the per-token advantage log pi_T(y_t) - log pi_S(y_t), the one-sample
  estimate of minus the reverse KL(pi_S || pi_T): pushing log pi_S(y_t) up in proportion to it
  descends the reverse KL. Alone (task_coef 0) pure distillation, else added to the task advantage.
* gkd (over the teacher's top-k): per token, the forward KL from the teacher's k most likely tokens
  (renormalised) to the student's log-probs at those ids, added to the loss through the student.

Rows without teacher scores get no distillation signal; their task advantage is kept as is.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch

from stages.update.losses import masked, token_mean


@dataclass
class TeacherBatch:
    """Teacher columns as right-padded tensors aligned with the trainer's Batch."""
    logprobs: torch.Tensor               # [B,T] teacher log-prob of each response token (0 where absent)
    has: torch.Tensor                    # [B] bool: the row has teacher scores
    topk_ids: torch.Tensor | None        # [B,T,K] long, teacher's top-k token ids per position
    topk_logprobs: torch.Tensor | None   # [B,T,K] their teacher log-probs
    sources: list[str]


def teacher_batch(table: pa.Table, T: int) -> TeacherBatch:
    """Read teacher_logprobs (+ top-k columns when present) into [B,T(,K)] tensors."""
    n = table.num_rows
    lens = [len(r) for r in table.column("response_ids").to_pylist()]
    tlp = table.column("teacher_logprobs").to_pylist() if "teacher_logprobs" in table.column_names else [None] * n
    has = torch.tensor([lp is not None and len(lp) == k and k > 0 for lp, k in zip(tlp, lens)])
    lp = torch.zeros((n, T))
    for i in range(n):
        if has[i]:
            lp[i, : lens[i]] = torch.tensor(tlp[i])
    ids = top = None
    if "teacher_topk_ids" in table.column_names:
        rows_ids = table.column("teacher_topk_ids").to_pylist()
        rows_lp = table.column("teacher_topk_logprobs").to_pylist()
        K = max((len(r[0]) for r in rows_ids if r), default=0)
        if K:
            ids = torch.zeros((n, T, K), dtype=torch.long)
            top = torch.zeros((n, T, K))   # finite padding: a nan there would reach the grads as 0 * nan
            for i in range(n):
                if has[i] and rows_ids[i]:
                    ids[i, : lens[i]] = torch.tensor(rows_ids[i])
                    top[i, : lens[i]] = torch.tensor(rows_lp[i])
            has &= torch.tensor([bool(r) for r in rows_ids])
    sources = table.column("data_source").to_pylist() if "data_source" in table.column_names else [""] * n
    return TeacherBatch(lp, has, ids, top, [s or "" for s in sources])


def opd_advantages(task_adv: torch.Tensor, teacher_lp: torch.Tensor, student_lp: torch.Tensor, mask: torch.Tensor,
                   distill_coef: float = 1.0, task_coef: float = 1.0) -> torch.Tensor:
    """task_coef * task advantage + distill_coef * (log pi_T - log pi_S), per token [B,T]. `mask` marks the
    tokens with teacher scores: a row without a teacher still learns from reward."""
    return task_coef * task_adv + distill_coef * masked(teacher_lp - student_lp, mask)


def topk_kl(student_topk_lp: torch.Tensor, teacher_topk_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token KL(T~ || S) over the teacher's top-k support, [B,T]: T~ is the teacher's top-k
    renormalised to sum to 1; S is the student's *actual* log-probs at those ids, not
    renormalised, so mass the student puts outside the support is penalised too
    (sum_k T~_k log(T~_k / S_k) >= -log sum_k S_k >= 0, and = 0 only when S = T~ on the
    support). Renormalising the student as well would let it drift off the support freely."""
    t = torch.log_softmax(teacher_topk_lp, -1)
    return masked((t.exp() * (t - student_topk_lp)).sum(-1), mask)


def distill_metrics(teacher_lp: torch.Tensor, student_lp: torch.Tensor, mask: torch.Tensor, sources: list[str],
                    resp_ids: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None) -> dict:
    """Overall and per data source: reverse_kl = mean (log pi_S - log pi_T) over the student's
    tokens (the one-sample estimate of KL(pi_S || pi_T)); with top-k, agree = fraction of
    tokens the student sampled that are the teacher's argmax; without, logprob_gap =
    mean |log pi_T - log pi_S|."""
    out = {}
    groups = {"": torch.ones(len(sources), dtype=torch.bool)}
    groups |= {f"/{s}": torch.tensor([x == s for x in sources]) for s in sorted(set(sources))}
    for suffix, rows in groups.items():
        m = mask * rows[:, None]
        if m.sum() == 0:
            continue
        out[f"distill/reverse_kl{suffix}"] = float(token_mean(student_lp - teacher_lp, m))
        if topk_ids is not None and resp_ids is not None:
            out[f"distill/agree{suffix}"] = float(token_mean((resp_ids == topk_ids[..., 0]).to(m.dtype), m))
        else:
            out[f"distill/logprob_gap{suffix}"] = float(token_mean((teacher_lp - student_lp).abs(), m))
    return out


def apply_distill(algo, table: pa.Table, adv: torch.Tensor, student_lp: torch.Tensor, mask: torch.Tensor,
                  resp_ids: torch.Tensor | None = None):
    """The trainer's hook: (advantages, metrics, TeacherBatch for GKD or None). student_lp is the
    pre-update policy's log-probs of the sampled tokens (the trainer's `old`)."""
    if not algo.distill_coef:
        return adv, {}, None
    tb = teacher_batch(table, adv.shape[1])
    dmask = mask * tb.has[:, None].to(mask.dtype)
    metrics = distill_metrics(tb.logprobs, student_lp, dmask, tb.sources, resp_ids, tb.topk_ids)
    metrics["distill/rows_with_teacher"] = int(tb.has.sum())
    if algo.distill == "pg":
        return opd_advantages(adv, tb.logprobs, student_lp, dmask, algo.distill_coef, algo.task_coef), metrics, None
    if tb.topk_ids is None:
        raise ValueError("algorithm.distill=gkd: the batch has no teacher_topk_ids (set teacher.top_k > 0)")
    return algo.task_coef * adv, metrics, tb


def gkd_term(algo, loss: torch.Tensor, metrics: dict, student_topk_lp: torch.Tensor, tb: TeacherBatch, rows,
             mask: torch.Tensor, full: tuple | None = None):
    """loss + distill_coef * token-mean top-k KL on rows `rows` (student_topk_lp carries grads).
    full: (rows, mask) of the whole mini-batch when `rows` is one micro-batch of it: the mean is
    then over the mini-batch's tokens, so the micro-batches' terms add up to the mini-batch's."""
    m = mask * tb.has[rows][:, None].to(mask.dtype)
    denom = m.sum() if full is None else (full[1] * tb.has[full[0]][:, None].to(mask.dtype)).sum()
    kl = topk_kl(student_topk_lp, tb.topk_logprobs[rows], m).sum() / denom.clamp(min=1)
    return loss + algo.distill_coef * kl, metrics | {"gkd_kl": kl.item()}
