"""Advantage estimators against float64 NumPy references written from the papers' formulas."""
import numpy as np
import pytest
import torch

from stages.update.advantages import ESTIMATORS, compute_advantages

EPS = 1e-6


def random_batch(seed: int, T: int = 7):
    """Groups of unequal size (incl. a singleton and an all-equal group), shuffled and with
    non-contiguous ids; masks with holes (tool tokens), a length-1 response and an empty row."""
    rng = np.random.default_rng(seed)
    sizes = [4, 3, 1, 5, 2]
    gids = np.concatenate([np.full(s, 10 * g + 3) for g, s in enumerate(sizes)])
    rewards = rng.normal(size=len(gids))
    rewards[gids == 33] = 0.7                       # the group of 5: everyone agrees
    rewards[rng.random(len(gids)) < 0.3] = 1.0      # repeated values inside groups too
    lengths = rng.integers(1, T + 1, size=len(gids))
    lengths[0], lengths[1] = 1, 0
    mask = (np.arange(T)[None] < lengths[:, None]).astype(float)
    mask[rng.random(mask.shape) < 0.15] = 0.0
    perm = rng.permutation(len(gids))
    return rewards[perm], gids[perm], mask[perm]


def _groups(gids):
    return {g: np.flatnonzero(gids == g) for g in np.unique(gids)}


def ref_grpo(r, gids, mask):
    a = np.zeros_like(r)
    for idx in _groups(gids).values():
        if len(idx) > 1:
            a[idx] = (r[idx] - r[idx].mean()) / (r[idx].std(ddof=1) + EPS)
    return a[:, None] * mask


def ref_dr_grpo(r, gids, mask):
    a = np.zeros_like(r)
    for idx in _groups(gids).values():
        a[idx] = r[idx] - r[idx].mean()
    return a[:, None] * mask


def ref_rloo(r, gids, mask):
    a = np.zeros_like(r)
    for idx in _groups(gids).values():
        for i in idx:
            others = [j for j in idx if j != i]
            a[i] = r[i] - np.mean(r[others]) if others else 0.0
    return a[:, None] * mask


def ref_reinforce_pp(r, gids, mask):
    G = np.repeat(r[:, None], mask.shape[1], axis=1)     # the return of every token: the outcome reward
    vals = G[mask > 0]
    return (G - vals.mean()) / (vals.std() + EPS) * mask


def ref_reinforce_pp_baseline(r, gids, mask):
    base = r.copy()
    for idx in _groups(gids).values():
        base[idx] = r[idx] - r[idx].mean()
    return ref_reinforce_pp(base, gids, mask)


REFS = {"grpo": ref_grpo, "dr_grpo": ref_dr_grpo, "rloo": ref_rloo,
        "reinforce_pp": ref_reinforce_pp, "reinforce_pp_baseline": ref_reinforce_pp_baseline}


def _run(name, r, gids, mask):
    return compute_advantages(name, torch.from_numpy(r), torch.from_numpy(gids), torch.from_numpy(mask),
                              eps=EPS).numpy()


def test_every_estimator_has_a_reference():
    assert set(REFS) == set(ESTIMATORS)


@pytest.mark.parametrize("name", sorted(REFS))
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference(name, seed):
    r, gids, mask = random_batch(seed)
    np.testing.assert_allclose(_run(name, r, gids, mask), REFS[name](r, gids, mask), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_whitens_over_the_batchs_tokens(name):
    r, gids, mask = random_batch(5)
    vals = _run(name, r, gids, mask)[mask > 0]
    assert abs(vals.mean()) < 1e-9 and abs(vals.std() - 1) < 1e-4


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_agreeing_or_singleton_groups_get_zero(name):
    r = np.array([0.3, 0.3, 0.3, 1.0, 0.0, 2.5])
    gids = np.array([0, 0, 0, 1, 1, 2])
    adv = _run(name, r, gids, np.ones((6, 3)))
    assert np.abs(adv[[0, 1, 2, 5]]).max() < 1e-9
    assert adv[3, 0] > 0 > adv[4, 0]


def test_grpo_invariant_to_affine_rewards():
    r, gids, mask = random_batch(7)
    np.testing.assert_allclose(_run("grpo", 3.0 * r - 2.0, gids, mask), _run("grpo", r, gids, mask), atol=1e-5)


def test_masked_tokens_are_zero_and_dtype_follows_inputs():
    r, gids, mask = random_batch(8)
    for name in ESTIMATORS:
        assert np.all(_run(name, r, gids, mask)[mask == 0] == 0)
    out = compute_advantages("grpo", torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool))  # noqa: E501
    assert out.dtype == torch.float32
