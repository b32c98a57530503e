"""Distillation objectives vs float64 numpy references, on hand-made and random cases."""
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pytest
import torch

from stages.update.distill import (
    apply_distill,
    distill_metrics,
    gkd_term,
    opd_advantages,
    teacher_batch,
    topk_kl,
)
from stages.update.losses import AlgorithmConfig, policy_loss


@dataclass(frozen=True)
class Distill:
    """The three algorithm keys distillation reads (proposed for AlgorithmConfig)."""
    distill_coef: float = 1.0
    task_coef: float = 1.0
    distill: str = "pg"


def _rand(seed, B=4, T=6, K=3):
    g = np.random.default_rng(seed)
    t_lp, s_lp = -g.exponential(1.0, (B, T)), -g.exponential(1.0, (B, T))
    mask = (g.random((B, T)) > 0.3).astype(np.float64)
    return t_lp, s_lp, mask, g.normal(size=(B, T)), g.normal(size=(B, T, K)), g.normal(size=(B, T, K))


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_opd_advantage_sign_and_masking_by_hand():
    teacher = torch.tensor([[-0.1, -3.0, -1.0, 0.0]])
    student = torch.tensor([[-2.0, -0.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    sig = opd_advantages(torch.zeros(1, 4), teacher, student, mask, 1.0, 0.0)
    # teacher likes token 0 more than the student: reinforce; token 1 less: suppress; agreement: 0; pad: 0
    assert sig[0].tolist() == pytest.approx([1.9, -2.5, 0.0, 0.0])
    task = torch.tensor([[0.5, 0.5, 0.5, 0.0]])                   # task advantages come masked already
    assert opd_advantages(task, teacher, student, mask, 2.0, 0.0)[0].tolist() == pytest.approx([3.8, -5.0, 0.0, 0.0])
    assert opd_advantages(task, teacher, student, mask, 1.0, 1.0)[0].tolist() == pytest.approx([2.4, -2.0, 0.5, 0.0])
    inf_pad = torch.tensor([[-0.1, -3.0, -1.0, -torch.inf]])     # -inf in padding never leaks
    assert torch.isfinite(opd_advantages(torch.zeros(1, 4), inf_pad, student, mask, 1.0, 0.0)).all()


@pytest.mark.parametrize("seed", range(3))
def test_opd_advantages_match_numpy(seed):
    t_lp, s_lp, mask, task, _, _ = _rand(seed)
    task = task * mask                                    # the task advantage on trained tokens
    teacher_mask = mask * np.array([[1.0], [0.0], [1.0], [1.0]])   # row 1 has no teacher scores
    got = opd_advantages(*(torch.tensor(x) for x in (task, t_lp, s_lp, teacher_mask)), distill_coef=0.7,
                         task_coef=0.3)
    want = 0.3 * task + 0.7 * (t_lp - s_lp) * teacher_mask
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)


def test_topk_kl_matches_numpy():
    _, _, mask, _, _, t_top = _rand(7)
    g = np.random.default_rng(8)
    student_full = _np_log_softmax(g.normal(size=mask.shape + (10,)))      # a real distribution over 10 ids
    s_top = student_full[..., :3]                                          # the student's log-probs at 3 of them
    got = topk_kl(torch.tensor(s_top), torch.tensor(t_top), torch.tensor(mask)).numpy()
    t = _np_log_softmax(t_top)                                             # the teacher, renormalised on top-k
    want = (np.exp(t) * (t - s_top)).sum(-1) * mask
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert (got >= -1e-12).all()
    # zero only when the student puts exactly the teacher's renormalised mass on the support
    assert topk_kl(torch.tensor(t), torch.tensor(t_top), torch.tensor(mask)).abs().max() < 1e-12
    # mass off the support is penalised: the same shape on the support, half the mass -> KL = log 2
    half = topk_kl(torch.tensor(t + np.log(0.5)), torch.tensor(t_top), torch.tensor(mask)).numpy()
    np.testing.assert_allclose(half, np.log(2) * mask, rtol=0, atol=1e-12)


def test_distill_metrics_per_source_match_numpy():
    t_lp, s_lp, mask, _, _, _ = _rand(3)
    sources = ["add", "mul", "add", "mul"]
    resp = np.array([[1, 2, 3, 4, 5, 6]] * 4)
    top1 = np.array([[1, 0, 3, 0, 5, 0]] * 4)
    topk = np.stack([top1, top1 + 1], -1)
    m = distill_metrics(*(torch.tensor(x) for x in (t_lp, s_lp, mask)), sources, torch.tensor(resp),
                        torch.tensor(topk))
    for name, rows in (("", [0, 1, 2, 3]), ("/add", [0, 2]), ("/mul", [1, 3])):
        mk = mask[rows]
        assert m[f"distill/reverse_kl{name}"] == pytest.approx(((s_lp - t_lp)[rows] * mk).sum() / mk.sum(), abs=1e-12)
        assert m[f"distill/agree{name}"] == pytest.approx(((resp == top1)[rows] * mk).sum() / mk.sum(), abs=1e-12)
    no_top = distill_metrics(*(torch.tensor(x) for x in (t_lp, s_lp, mask)), sources)
    assert no_top["distill/logprob_gap/add"] == pytest.approx(
        (np.abs(t_lp - s_lp)[[0, 2]] * mask[[0, 2]]).sum() / mask[[0, 2]].sum(), abs=1e-12)
    assert "distill/agree" not in no_top


def _table(teacher_lps, top_ids=None, top_lps=None):
    cols = {"data_source": ["add", "mul", "add"], "response_ids": [[5, 6, 1], [7, 1], [8]],
            "teacher_logprobs": teacher_lps}
    if top_ids is not None:
        cols |= {"teacher_topk_ids": top_ids, "teacher_topk_logprobs": top_lps}
    return pa.table(cols)


def test_teacher_batch_pads_and_flags_rows_without_scores():
    tb = teacher_batch(_table([[-0.5, -1.0, -0.25], None, [-2.0, -3.0]]), T=4)
    assert tb.has.tolist() == [True, False, False]                  # null and wrong-length rows: no teacher
    assert tb.logprobs.tolist() == [[-0.5, -1.0, -0.25, 0.0], [0.0] * 4, [0.0] * 4]
    assert tb.topk_ids is None and tb.sources == ["add", "mul", "add"]


def test_apply_distill_pg_keeps_task_signal_on_rows_without_teacher():
    table = _table([[-0.5, -1.0, -0.1], None, [-2.0]])
    adv = torch.full((3, 3), 0.25) * torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    mask = (adv != 0).float()
    student = torch.full((3, 3), -1.0)
    out, m, tb = apply_distill(Distill(distill_coef=1.0, task_coef=1.0), table, adv, student, mask)
    assert tb is None
    assert out[0].tolist() == pytest.approx([0.75, 0.25, 1.15])
    assert out[1].tolist() == pytest.approx([0.25, 0.25, 0.0])     # no teacher: the task advantage only
    assert out[2].tolist() == pytest.approx([-0.75, 0.0, 0.0])
    assert m["distill/rows_with_teacher"] == 2 and "distill/reverse_kl/mul" not in m
    assert apply_distill(Distill(distill_coef=0.0), table, adv, student, mask)[0] is adv   # off: untouched


def test_gkd_term_gradient_is_finite_and_zero_at_the_teacher():
    top_ids = [[[5, 2], [6, 3], [1, 4]], [[7, 2], [1, 3]], [[8, 0]]]
    top_lps = [[[-0.2, -2.0], [-0.1, -3.0], [-0.3, -1.5]], [[-0.5, -1.0], [-0.2, -2.0]], [[-0.1, -2.5]]]
    table = _table([[-0.2, -0.1, -0.3], [-0.5, -0.2], [-0.1]], top_ids, top_lps)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv, _, tb = apply_distill(Distill(distill="gkd", task_coef=0.0), table, torch.ones(3, 3), torch.zeros(3, 3), mask)
    assert tb is not None and adv.abs().sum() == 0 and tb.topk_ids.shape == (3, 3, 2)
    rows = torch.tensor([0, 2])
    student = torch.full((2, 3, 2), float(np.log(0.1)), requires_grad=True)   # 0.1 on each of the top-k ids
    loss, m = gkd_term(Distill(distill="gkd"), torch.tensor(0.0), {}, student, tb, rows, mask[rows])
    loss.backward()
    assert m["gkd_kl"] > 0 and torch.isfinite(student.grad).all()
    assert student.grad[1, 1:].abs().sum() == 0                    # padded positions get no gradient
    at_teacher = torch.log_softmax(tb.topk_logprobs[rows], -1)     # all mass on the teacher's support
    loss0, m0 = gkd_term(Distill(distill="gkd"), torch.tensor(0.0), {}, at_teacher, tb, rows, mask[rows])
    assert abs(m0["gkd_kl"]) < 1e-7


def test_policy_gradient_on_the_opd_advantage_lowers_reverse_kl():
    """A toy categorical student trained with the project's own PPO loss and the OPD advantage
    moves toward a fixed teacher: the sign is right end to end, not just in the formula."""
    torch.manual_seed(0)
    V = 6
    teacher = torch.log_softmax(torch.tensor([3.0, 1.0, 0.0, -1.0, 0.5, -2.0]), -1)
    logits = torch.zeros(V, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)
    algo = AlgorithmConfig(name="grpo")

    def kl():
        s = torch.log_softmax(logits, -1)
        return float((s.exp() * (s - teacher)).sum().detach())

    start = kl()
    for _ in range(60):
        with torch.no_grad():
            tokens = torch.distributions.Categorical(logits=logits).sample((1, 64))
            old = torch.log_softmax(logits, -1)[tokens]
        mask = torch.ones_like(old)
        adv = opd_advantages(torch.zeros_like(old), teacher[tokens], old, mask, distill_coef=1.0, task_coef=0.0)
        loss, _ = policy_loss(algo, torch.log_softmax(logits, -1)[tokens], old, adv, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert kl() < 0.2 * start, (start, kl())


# ---- the trainer hook -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["pg", "gkd"])
def test_trainer_steps_move_the_student_toward_the_teacher(tmp_path, mode):
    from stages.tasks.make_teacher import shared_tokenizer, tiny_qwen2
    from stages.teacher import TeacherConfig, TeacherScoring
    from stages.update.trainer import TorchTrainer, TrainerConfig

    tok = shared_tokenizer()
    for name, seed in (("student", 0), ("teacher", 1)):
        tiny_qwen2(tok, 32, 2, seed).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    enc = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+3=", "4*5=", "7+7=", "9*2=")]
    resp = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in ("15", "20", "14", "18")]
    table = pa.table({"data_source": ["addition", "multiplication"] * 2, "prompt_ids": enc, "response_ids": resp,
                      "status": ["completed"] * 4, "error": [""] * 4})
    top_k = 4 if mode == "gkd" else 0
    table = TeacherScoring(TeacherConfig(teachers={"t": str(tmp_path / "teacher")}, default="t", top_k=top_k),
                           str(tmp_path / "student"))(table)
    table = table.append_column("response_logprobs", pa.array([[0.0] * len(r) for r in resp], pa.list_(pa.float32())))
    for name, values in (("loss_mask", [[1] * len(r) for r in resp]), ("token_versions", [[0] * len(r) for r in resp]),
                         ("reward", [0.0] * 4), ("group_id", [0, 0, 1, 1])):
        table = table.append_column(name, pa.array(values))
    algo = AlgorithmConfig(distill_coef=1.0, task_coef=0.0, distill=mode)
    tr = TorchTrainer(str(tmp_path / "student"), TrainerConfig(lr=3e-3, num_threads=1), algo)
    key = "train/gkd_kl" if mode == "gkd" else "distill/logprob_gap"
    seen = [tr.train_step(table)[key] for _ in range(6)]
    assert seen[-1] < 0.8 * seen[0], seen
