"""Policy losses against float64 NumPy references (value and analytic gradient) written from
the papers' formulas, autograd.gradcheck where the loss has no stop-gradient, and the config."""
import dataclasses

import numpy as np
import pytest
import torch

from stages.update.config import PRESETS
from stages.update.losses import AGGREGATIONS, SURROGATES, AlgorithmConfig, policy_loss, shape_overlong

B, T = 7, 6


def random_inputs(seed: int, noise=0.3):
    """Log-probs, old log-probs far enough to clip, per-token advantages, a mask with holes,
    a length-1 response and a fully masked row."""
    rng = np.random.default_rng(seed)
    lp = np.log(rng.uniform(0.05, 1.0, size=(B, T)))
    old = lp + rng.normal(scale=noise, size=(B, T))
    adv = rng.normal(size=(B, T))
    mask = (rng.random((B, T)) > 0.2).astype(float)
    mask[0] = 0.0
    mask[1] = 0.0
    mask[1, 0] = 1.0
    return lp, old, adv, mask


# ---- references ----------------------------------------------------------------------

def ref_agg(x, m, mode, L=0):
    rows = [i for i in range(B) if m[i].sum() > 0]
    if mode == "token_mean":        # DAPO: every token counts the same
        return (x * m).sum() / m.sum()
    if mode == "seq_mean_token_mean":  # GRPO paper: 1/G sum_i 1/|o_i| sum_t
        return np.mean([(x[i] * m[i]).sum() / m[i].sum() for i in rows])
    return np.mean([(x[i] * m[i]).sum() / (L or T) for i in rows])  # Dr.GRPO: constant length


def agg_weights(m, mode, L=0):
    """d agg / d x_it, read off by aggregating unit vectors."""
    W = np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            e = np.zeros((B, T))
            e[i, t] = 1.0
            W[i, t] = ref_agg(e, m, mode, L)
    return W


def ref_ppo(lp, old, A, lo, hi, c):
    """PPO-clip per token (loss, dloss/dlp, clipped), with dual-clip for A < 0 when c > 0."""
    r = np.exp(lp - old)
    unclipped, clipped = -A * r, -A * np.clip(r, 1 - lo, 1 + hi)
    loss = np.maximum(unclipped, clipped)
    grad = np.where(unclipped >= clipped, -A * r, 0.0)
    if c:
        capped = (A < 0) & (loss > -A * c)
        loss = np.where(capped, -A * c, loss)
        grad = np.where(capped, 0.0, grad)
    return loss, grad, clipped > unclipped


def ref_cispo(lp, old, A, lo, hi):
    """MiniMax-M1 eq. 4: -sg(clip(r, 1-lo, 1+hi)) * A * log pi."""
    r = np.exp(lp - old)
    w = np.clip(r, 1 - lo, 1 + hi)
    return -w * A * lp, -w * A, w != r


def ref_gspo(lp, old, A_seq, m, lo, hi):
    """GSPO eq. 5/7, sequence level: loss = mean_i max(-A_i s_i, -A_i clip(s_i)), with
    s_i = exp(mean_t log(pi/pi_old)); returns (loss, grad [B,T], clipped rows)."""
    rows = [i for i in range(B) if m[i].sum() > 0]
    loss, grad, clipped = 0.0, np.zeros((B, T)), []
    for i in rows:
        n = m[i].sum()
        s = np.exp(((lp[i] - old[i]) * m[i]).sum() / n)
        a, b = -A_seq[i] * s, -A_seq[i] * np.clip(s, 1 - lo, 1 + hi)
        loss += max(a, b) / len(rows)
        if a >= b:
            grad[i] = -A_seq[i] * s / n * m[i] / len(rows)
        clipped.append(b > a)
    return loss, grad, clipped


REF_KL = {  # Schulman, "Approximating KL divergence": value and d/dlp, with r = pi_ref / pi
    "k1": (lambda lp, ref: lp - ref, lambda lp, ref: np.ones_like(lp)),
    "k2": (lambda lp, ref: 0.5 * (lp - ref) ** 2, lambda lp, ref: lp - ref),
    "k3": (lambda lp, ref: np.exp(ref - lp) - (ref - lp) - 1, lambda lp, ref: 1 - np.exp(ref - lp)),
}


def run(cfg, lp, old, adv, mask, **kw):
    lp_t = torch.tensor(lp, requires_grad=True)
    kw = {k: torch.tensor(v, requires_grad=(k == "entropy")) for k, v in kw.items()}
    loss, metrics = policy_loss(cfg, lp_t, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), **kw)
    loss.backward()
    return loss.item(), lp_t.grad.numpy(), metrics, kw


# ---- surrogates ----------------------------------------------------------------------

@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("lo,hi,c", [(0.2, 0.2, 3.0), (0.2, 0.28, 0.0), (0.1, 0.3, 1.5)])
@pytest.mark.parametrize("seed", range(3))
def test_ppo_clip_matches_reference(agg, lo, hi, c, seed):
    lp, old, adv, mask = random_inputs(seed)
    cfg = AlgorithmConfig(loss_agg=agg, clip_low=lo, clip_high=hi, clip_ratio_c=c, norm_length=9 * (seed == 1))
    loss, grad, metrics, _ = run(cfg, lp, old, adv, mask)
    per_tok, dtok, clipped = ref_ppo(lp, old, adv, lo, hi, c)
    W = agg_weights(mask, agg, cfg.norm_length)
    np.testing.assert_allclose(loss, ref_agg(per_tok, mask, agg, cfg.norm_length), rtol=1e-10)
    np.testing.assert_allclose(grad, W * dtok, rtol=1e-9, atol=1e-12)
    assert 0 < metrics["clipfrac"] < 1
    np.testing.assert_allclose(metrics["clipfrac"], clipped[mask > 0].mean())
    rho = np.exp(lp - old)[mask > 0]          # pi / pi_old on tokens sampled from pi_old
    np.testing.assert_allclose(metrics["approx_kl"], np.mean(rho - 1 - np.log(rho)))
    assert metrics["loss"] == metrics["pg_loss"] == pytest.approx(loss)


@pytest.mark.parametrize("seed", range(3))
def test_dual_clip_bounds_negative_advantage_tokens(seed):
    lp, old, adv, mask = random_inputs(seed, noise=2.0)   # stale: some ratios far above 3
    adv = -np.abs(adv)
    _, grad, _, _ = run(AlgorithmConfig(clip_ratio_c=3.0), lp, old, adv, mask)
    exploded = (np.exp(lp - old) > 3.0) & (mask > 0)
    assert exploded.any() and np.all(grad[exploded] == 0)


@pytest.mark.parametrize("lo", [1.0, 0.2])
@pytest.mark.parametrize("seed", range(3))
def test_cispo_matches_reference(lo, seed):
    lp, old, adv, mask = random_inputs(seed)
    cfg = AlgorithmConfig(name="cispo", clip_low=lo)
    loss, grad, metrics, _ = run(cfg, lp, old, adv, mask)
    per_tok, dtok, clipped = ref_cispo(lp, old, adv, lo, 0.28)
    np.testing.assert_allclose(loss, (per_tok * mask).sum() / mask.sum(), rtol=1e-10)
    # stop-gradient on the weight: every token keeps a gradient, clipped or not
    np.testing.assert_allclose(grad, dtok * mask / mask.sum(), rtol=1e-9, atol=1e-12)
    assert np.all(grad[(mask > 0) & (adv != 0)] != 0)
    np.testing.assert_allclose(metrics["clipfrac"], clipped[mask > 0].mean())


@pytest.mark.parametrize("seed", range(4))
def test_gspo_matches_sequence_level_reference(seed):
    rng = np.random.default_rng(seed)
    lp, _, _, mask = random_inputs(seed)
    # per-row drift: tiny for some rows (inside the 3e-4/4e-4 band), large for others
    old = lp + rng.normal(size=(B, T)) * np.array([1e-5, 1e-5, 1e-5, 1e-2, 1e-2, 1e-5, 1e-2])[:, None]
    A_seq = rng.normal(size=B)
    cfg = AlgorithmConfig(name="gspo")
    loss, grad, metrics, _ = run(cfg, lp, old, A_seq[:, None] * mask, mask)
    ref_loss, ref_grad, clipped = ref_gspo(lp, old, A_seq, mask, 3e-4, 4e-4)
    assert any(clipped) and not all(clipped)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-10)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)


# ---- KL, entropy, IS weights -----------------------------------------------------------

@pytest.mark.parametrize("est", sorted(REF_KL))
@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_kl_entropy_and_is_weights_terms(est, agg):
    rng = np.random.default_rng(11)
    lp, old, adv, mask = random_inputs(11)
    ref, ent, w = lp + rng.normal(scale=0.5, size=(B, T)), rng.uniform(0, 3, (B, T)), rng.uniform(0, 2, (B, T))
    cfg = AlgorithmConfig(loss_agg=agg, kl_coef=0.1, kl_estimator=est, entropy_coef=0.01)
    loss, grad, metrics, kw = run(cfg, lp, old, adv, mask, ref_logprobs=ref, entropy=ent, is_weights=w)
    kl_val, kl_grad = REF_KL[est]
    per_tok, dtok, _ = ref_ppo(lp, old, adv, 0.2, 0.2, 3.0)
    W = agg_weights(mask, agg)
    kl = ref_agg(kl_val(lp, ref), mask, agg)
    np.testing.assert_allclose(metrics["kl_ref"], kl, rtol=1e-10)
    np.testing.assert_allclose(metrics["entropy"], ref_agg(ent, mask, agg), rtol=1e-10)
    np.testing.assert_allclose(loss, ref_agg(w * per_tok, mask, agg) + 0.1 * kl - 0.01 * ref_agg(ent, mask, agg),
                               rtol=1e-10)
    np.testing.assert_allclose(grad, W * (w * dtok + 0.1 * kl_grad(lp, ref)), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(kw["entropy"].grad.numpy(), -0.01 * W, atol=1e-15)


# ---- gradcheck (float64) where autograd and finite differences must agree --------------

@pytest.mark.parametrize("loss,agg", [("ppo_clip", "token_mean"), ("ppo_clip", "seq_mean_token_mean"),
                                      ("ppo_clip", "seq_mean_token_sum_norm"), ("gspo", "seq_mean_token_mean"),
                                      ("gspo", "token_mean")])
def test_gradcheck(loss, agg):
    # CISPO is left out on purpose: its weight is stop-gradient, so autograd is *meant* to
    # differ from finite differences; test_cispo_matches_reference checks its gradient.
    lp, old, adv, mask = (torch.tensor(x) for x in random_inputs(3, noise=0.1 if loss == "ppo_clip" else 1e-4))
    if loss == "gspo":   # GSPO's gradient is the sequence objective's when A is per sequence
        adv = adv[:, :1] * mask
    ref, ent = lp.detach() + 0.3, torch.rand(B, T, dtype=torch.float64)
    cfg = AlgorithmConfig(loss=loss, loss_agg=agg, kl_coef=0.05, entropy_coef=0.01)

    def f(lp_, ent_):
        return policy_loss(cfg, lp_, old, adv, mask, ref_logprobs=ref, entropy=ent_)[0]

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(), ent.requires_grad_()), eps=1e-7, atol=1e-7)


@pytest.mark.parametrize("loss", sorted(SURROGATES))
def test_padding_garbage_never_reaches_loss_or_grad(loss):
    lp, old, adv, mask = random_inputs(4)
    lp, old, adv = (np.where(mask > 0, x, np.nan) for x in (lp, old, adv))
    cfg = AlgorithmConfig(loss=loss, kl_coef=0.1)
    value, grad, metrics, _ = run(cfg, lp, old, np.nan_to_num(adv), mask, ref_logprobs=np.full((B, T), np.inf))
    assert np.isfinite(value) and np.all(np.isfinite(grad)) and np.all(grad[mask == 0] == 0)
    assert all(np.isfinite(v) for v in metrics.values())


# ---- config --------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_resolve_completely(name):
    cfg = AlgorithmConfig(name=name).resolved()
    assert all(getattr(cfg, f.name) not in ("", None) for f in dataclasses.fields(cfg))
    assert cfg.resolved() == cfg
    for key, value in PRESETS[name].items():
        assert getattr(cfg, key) == value


def test_preset_values():
    dapo = AlgorithmConfig(name="dapo").resolved()
    assert (dapo.clip_low, dapo.clip_high, dapo.loss_agg, dapo.overlong) == (0.2, 0.28, "token_mean", "soft")
    gspo = AlgorithmConfig(name="grpo", loss="gspo").resolved()    # clip band follows the loss
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    assert AlgorithmConfig().resolved().overlong == "none"
    assert AlgorithmConfig(name="dr_grpo").resolved().advantage == "dr_grpo"


def test_explicit_keys_win_over_preset():
    cfg = AlgorithmConfig(name="dapo", clip_high=0.3, loss_agg="seq_mean_token_mean", overlong="none").resolved()
    assert (cfg.clip_high, cfg.loss_agg, cfg.overlong) == (0.3, "seq_mean_token_mean", "none")


@pytest.mark.parametrize("kw,msg", [
    (dict(name="ppo"), "one of grpo, dr_grpo, dapo"),
    (dict(loss="sac"), "one of '', ppo_clip, gspo, cispo"),
    (dict(advantage="gae"), "rloo"),
    (dict(loss_agg="sum"), "seq_mean_token_sum_norm"),
    (dict(kl_estimator="k4"), "k1, k2, k3"),
    (dict(mis_level="batch"), "geometric"),
    (dict(clip_ratio_c=0.9), "clip_ratio_c"),
    (dict(mis_low=1.2, mis_high=2.0), r"mis_low must be in \[0, 1\]"),
    (dict(mis_low=0.5, mis_high=0.8), "mis_low <= 1 <= mis_high"),
    (dict(decoupled=True, tis_cap=2.0), "decoupled"),
    (dict(clip_low=-0.1), "clip_low"),
])
def test_invalid_config_is_an_error_naming_the_valid_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        AlgorithmConfig(**kw)


# ---- DAPO overlong handling ----------------------------------------------------------

def ref_soft_overlong(length, L_max, L_cache):
    """DAPO eq. 13."""
    if length <= L_max - L_cache:
        return 0.0
    if length <= L_max:
        return ((L_max - L_cache) - length) / L_cache
    return -1.0


@pytest.mark.parametrize("buffer", [0, 6])
def test_soft_overlong_penalty(buffer):
    lengths = np.array([1, 14, 16, 17, 19, 20])
    rewards = np.linspace(0, 1, 6)
    truncated = torch.tensor(lengths == 20)
    mask = torch.ones(6, 20, dtype=torch.float64)
    cfg = AlgorithmConfig(name="dapo", overlong_buffer=buffer, overlong_penalty=0.5)
    r, m = shape_overlong(cfg, torch.tensor(rewards), mask, torch.tensor(lengths), truncated, 20)
    cache = buffer or 4  # default: a fifth of the limit
    expected = rewards + 0.5 * np.array([ref_soft_overlong(n, 20, cache) for n in lengths])
    np.testing.assert_allclose(r.numpy(), expected)
    assert torch.equal(m, mask) and expected[-1] == rewards[-1] - 0.5


def test_overlong_mask_drops_truncated_rows_and_none_is_identity():
    rewards, mask = torch.rand(3), torch.ones(3, 4)
    args = (rewards, mask, torch.tensor([4, 2, 4]), torch.tensor([True, False, False]), 4)
    r, m = shape_overlong(AlgorithmConfig(overlong="mask"), *args)
    assert torch.equal(r, rewards) and m.sum(1).tolist() == [0.0, 4.0, 4.0]
    r, m = shape_overlong(AlgorithmConfig(), *args)
    assert r is rewards and m is mask


def test_approx_kl_estimates_kl_old_to_new_on_tokens_sampled_from_old():
    """approx_kl on tokens drawn from pi_old converges to the exact KL(pi_old || pi)."""
    rng = np.random.default_rng(0)
    old_p = rng.dirichlet(np.ones(8))
    new_p = rng.dirichlet(np.ones(8))
    exact = float(np.sum(old_p * (np.log(old_p) - np.log(new_p))))
    tokens = rng.choice(8, size=(400, 50), p=old_p)
    lp, old = np.log(new_p)[tokens], np.log(old_p)[tokens]
    _, metrics = policy_loss(AlgorithmConfig(), torch.tensor(lp, requires_grad=True), torch.tensor(old),
                             torch.zeros(lp.shape, dtype=torch.float64), torch.ones(lp.shape, dtype=torch.float64))
    assert metrics["approx_kl"] == pytest.approx(exact, rel=0.05)


def test_dr_grpo_norm_length_defaults_to_the_generation_limit():
    cfg = AlgorithmConfig(name="dr_grpo").resolved()
    assert cfg.for_generation_limit(64).norm_length == 64           # constant across steps
    assert AlgorithmConfig(norm_length=9).for_generation_limit(64).norm_length == 9   # an explicit value wins
    assert cfg.for_generation_limit(0).norm_length == 0             # no limit known: the padded length
