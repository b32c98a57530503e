"""Mismatch metrics and IS corrections against float64 NumPy references."""
import numpy as np
import pytest
import torch

from stages.update.correction import is_weights, mismatch_metrics, old_policy_logprobs
from stages.update.losses import AlgorithmConfig

B, T = 12, 6


def random_inputs(seed: int, noise=0.6):
    """Trainer/engine log-probs with a gap, a mask with holes, a length-1 and an empty row."""
    rng = np.random.default_rng(seed)
    engine = np.log(rng.uniform(0.05, 1.0, size=(B, T)))
    trainer = engine + rng.normal(scale=noise, size=(B, T))
    mask = (rng.random((B, T)) > 0.2).astype(float)
    mask[0] = 0.0
    mask[1] = 0.0
    mask[1, 2] = 1.0
    stale = rng.random((B, T)) < 0.4
    return trainer, engine, mask, stale


def ref_mismatch(trainer, engine, sel):
    d = trainer[sel] - engine[sel]
    r = np.exp(d)   # pi_trainer / pi_engine on tokens the engine sampled
    return {"abs_diff_mean": np.abs(d).mean(), "abs_diff_max": np.abs(d).max(),
            "k3_kl": np.mean(r - 1 - np.log(r)), "ratio_outside_frac": np.mean((r < 0.5) | (r > 2))}


def t(x):
    return torch.tensor(x)


@pytest.mark.parametrize("seed", range(3))
def test_mismatch_metrics_split_by_staleness(seed):
    trainer, engine, mask, stale = random_inputs(seed)
    got = mismatch_metrics(t(trainer), t(engine), t(mask), t(stale))
    valid = mask > 0
    for suffix, sel in {"": valid, "/fresh": valid & ~stale, "/stale": valid & stale}.items():
        for k, v in ref_mismatch(trainer, engine, sel).items():
            np.testing.assert_allclose(got[f"mismatch/{k}{suffix}"], v, rtol=1e-12)
    np.testing.assert_allclose(got["mismatch/stale_frac"], (valid & stale).sum() / valid.sum())
    assert 0 < got["mismatch/ratio_outside_frac"] < 1


def test_mismatch_metrics_without_split_and_with_empty_subset():
    trainer, engine, mask, _ = random_inputs(4)
    plain = mismatch_metrics(t(trainer), t(engine), t(mask))
    assert set(plain) == {f"mismatch/{k}" for k in ref_mismatch(trainer, engine, mask > 0)}
    all_fresh = mismatch_metrics(t(trainer), t(engine), t(mask), torch.zeros(B, T, dtype=torch.bool))
    assert not any(k.endswith("/stale") for k in all_fresh) and all_fresh["mismatch/stale_frac"] == 0
    assert all_fresh["mismatch/k3_kl/fresh"] == plain["mismatch/k3_kl"] > 0


# ---- IS weights ----------------------------------------------------------------------

def ref_weights(old, engine, mask, tis_cap=0.0, geo=False, mis=None, level="token"):
    """Loop over sequences: TIS (min(rho_t, C)), geometric-mean sequence IS, and MIS
    (keep a token / whole sequence only if its ratio lies in [low, high])."""
    w, keep = np.zeros((B, T)), np.zeros((B, T))
    for i in range(B):
        v = mask[i] > 0
        if not v.any():
            continue
        rho = np.exp(old[i] - engine[i])
        seq = {"token": rho, "sequence": np.full(T, np.prod(rho[v])),
               "geometric": np.full(T, np.prod(rho[v]) ** (1 / v.sum()))}
        keep[i] = v & ((seq[level] >= mis[0]) & (seq[level] <= mis[1]) if mis else True)
        wi = seq["geometric"] if geo else rho if tis_cap else np.ones(T)
        w[i] = (np.minimum(wi, tis_cap) if tis_cap else wi) * keep[i]
    return w, keep


CASES = [
    dict(tis_cap=2.0),
    dict(tis_cap=1.2),
    dict(geo_is=True),
    dict(geo_is=True, tis_cap=1.1),
    dict(mis_low=0.7, mis_high=1.5),
    dict(mis_low=0.5, mis_high=2.0, mis_level="sequence"),
    dict(mis_low=0.9, mis_high=1.1, mis_level="geometric"),
    dict(mis_low=0.0, mis_high=2.0, tis_cap=1.2),
    dict(mis_low=0.8, mis_high=1.25, mis_level="geometric", geo_is=True),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("seed", range(3))
def test_is_weights_match_reference(kw, seed):
    old, engine, mask, _ = random_inputs(seed)
    cfg = AlgorithmConfig(**kw)
    mis = (cfg.mis_low, cfg.mis_high) if cfg.mis_high else None
    w, new_mask, metrics = is_weights(cfg, t(old).requires_grad_(), t(engine), t(mask))
    ref_w, ref_keep = ref_weights(old, engine, mask, cfg.tis_cap, cfg.geo_is, mis, cfg.mis_level)
    assert not w.requires_grad
    np.testing.assert_allclose(w.numpy(), ref_w, rtol=1e-12)
    np.testing.assert_array_equal(new_mask.numpy(), mask * ref_keep)
    if mis:   # the band must really cut something, and leave something
        dropped = (mask > 0) & (ref_keep == 0)
        assert 0 < dropped.sum() < (mask > 0).sum()
        np.testing.assert_allclose(metrics["mis/dropped_token_frac"], dropped.sum() / (mask > 0).sum())
    if cfg.tis_cap:
        assert np.any(ref_w == cfg.tis_cap) and metrics["is/weight_max"] <= cfg.tis_cap
    if cfg.tis_cap or cfg.geo_is:
        np.testing.assert_allclose(metrics["is/weight_mean"], ref_w[ref_keep > 0].mean())


def test_no_correction_is_identity():
    old, engine, mask, _ = random_inputs(0)
    w, new_mask, metrics = is_weights(AlgorithmConfig(), t(old), t(engine), t(mask).float())
    assert torch.equal(w, t(mask)) and torch.equal(new_mask, t(mask).float()) and metrics == {}


def test_sequence_mis_survives_ratios_that_overflow_a_product():
    old, engine, mask = torch.zeros(2, 400), torch.full((2, 400), -3.0), torch.ones(2, 400)
    old[1] = engine[1]                          # row 0: prod of ratios = e^1200, row 1: exactly 1
    w, new_mask, m = is_weights(AlgorithmConfig(mis_low=0.5, mis_high=2.0, mis_level="sequence"), old, engine, mask)
    assert new_mask.sum(1).tolist() == [0.0, 400.0] and m["mis/dropped_seq_frac"] == 0.5
    assert w.dtype == torch.float32


def test_old_policy_logprobs_decoupled_uses_engine():
    recomputed, engine = torch.zeros(2, 3), torch.ones(2, 3)
    assert old_policy_logprobs(AlgorithmConfig(decoupled=True), None, engine) is engine
    assert old_policy_logprobs(AlgorithmConfig(), recomputed, engine) is recomputed
