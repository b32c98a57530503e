"""The embedded engine and trainer, and the rollout stage on a hand-made batch with a real engine actor."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from stages.agentflow.config import AgentConfig, SamplingConfig
from stages.agentflow.engine import HFEngine
from stages.agentflow.rollout import AgentFlowRollout
from stages.schema import table_from_columns
from stages.update.losses import AlgorithmConfig
from stages.update.step import lr_at, mini_batches, to_batch
from stages.update.trainer import TorchTrainer, TrainerConfig
from tests.support.runs import served_weights


def _requests(eng, prompts, **kw):
    return [{"prompt_ids": eng.tok(p, add_special_tokens=False)["input_ids"], "max_new_tokens": 5,
             "temperature": 1.0} | kw for p in prompts]


def test_engine_logprobs_match_trainer_and_versions_advance(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=1)
    outs = eng.generate(_requests(eng, ["12+7=", "3+45=", "99+9="]))
    assert all(len(o["response_ids"]) == len(o["logprobs"]) == len(o["versions"]) > 0 for o in outs)
    assert all(set(o["versions"]) == {0} for o in outs)
    assert {o["status"] for o in outs} <= {"completed", "truncated"}
    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1), AlgorithmConfig())
    rows = [{"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
             "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": 1.0 * i,
             "group_id": 0, "status": o["status"]}
            for i, (r, o) in enumerate(zip(_requests(eng, ["12+7=", "3+45=", "99+9="]), outs))]
    b = to_batch(pa.Table.from_pylist(rows), tr.pad_id)
    with torch.no_grad():
        lp = tr.logprobs(tr.model, b)[0]
    assert ((lp - b.engine_lp).abs() * b.mask).max() < 1e-4     # same distribution as the engine sampled from
    before = {n: t.clone() for n, t in tr.model.state_dict().items()}
    m = tr.train_step(pa.Table.from_pylist(rows))
    assert torch.isfinite(torch.tensor(m["train/loss"])) and m["version"] == 1
    assert any(not torch.equal(before[n], t) for n, t in tr.model.state_dict().items())
    eng.load_weights(tr.state_dict(), 1)
    assert eng.weight_version() == 1
    assert all(set(o["versions"]) == {1} for o in eng.generate(_requests(eng, ["1+1="])))



def test_lr_schedules_warm_up_decay_to_their_floor_and_reject_bad_settings():
    at = lambda **kw: [lr_at(TrainerConfig(lr=1.0, **kw), s) for s in range(12)]  # noqa: E731
    assert at() == [1.0] * 12
    assert at(lr_warmup_steps=4)[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    lin = at(lr_schedule="linear", lr_decay_steps=10, lr_min_ratio=0.1)
    assert lin[0] == 1.0 and abs(lin[5] - 0.55) < 1e-12 and lin[10] == lin[11] == pytest.approx(0.1)
    cos = at(lr_schedule="cosine", lr_warmup_steps=2, lr_decay_steps=10)
    assert cos[:2] == [0.5, 1.0] and cos[6] == pytest.approx(0.5) and cos[10] == cos[11] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(cos[1:], cos[2:]))           # never rises again after warm-up
    for bad, key in [({"lr_schedule": "step"}, "lr_schedule"), ({"lr_min_ratio": 1.5}, "lr_min_ratio"),
                     ({"lr_warmup_steps": -1}, "lr_warmup_steps")]:
        with pytest.raises(ValueError, match=key):
            TrainerConfig(**bad)


def test_trainer_steps_follow_the_lr_schedule_and_a_restored_version_resumes_it(tiny_model_dir, tmp_path):
    eng = HFEngine(tiny_model_dir, seed=3)
    reqs = _requests(eng, ["12+7=", "3+45="] * 2)
    rows = [{"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
             "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": float(i % 2),
             "group_id": i // 2, "status": o["status"]} for i, (r, o) in enumerate(zip(reqs, eng.generate(reqs)))]
    table = pa.Table.from_pylist(rows)
    cfg = TrainerConfig(num_threads=1, lr=1e-3, lr_schedule="linear", lr_warmup_steps=1, lr_decay_steps=3)
    tr = TorchTrainer(tiny_model_dir, cfg, AlgorithmConfig())
    # step 0 warms up (1 step), step 1 starts the decay at lr, which ends at step 3
    seen = [tr.train_step(table)["train/lr"] for _ in range(3)]
    assert seen == [pytest.approx(1e-3), pytest.approx(1e-3), pytest.approx(5e-4)]
    assert tr.opt.param_groups[0]["lr"] == pytest.approx(5e-4)       # what the optimizer stepped with
    tr.save(str(tmp_path / "ck"))
    resumed = TorchTrainer(tiny_model_dir, cfg, AlgorithmConfig())
    assert resumed.load_state(str(tmp_path / "ck")) == 3
    assert resumed.train_step(table)["train/lr"] == 0.0 == tr.train_step(table)["train/lr"]


def test_decoupled_trainer_skips_the_recompute_and_still_measures_the_gap(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=2)
    reqs = _requests(eng, ["12+7=", "3+45=", "99+9=", "8+8="] * 2)
    rows = [{"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
             "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": float(i % 2),
             "group_id": i // 4, "status": o["status"]} for i, (r, o) in enumerate(zip(reqs, eng.generate(reqs)))]
    table = pa.Table.from_pylist(rows)
    out = {}
    for decoupled in (False, True):
        tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, mini_batch_size=4),
                          AlgorithmConfig(decoupled=decoupled))
        calls = []      # per forward pass of the policy: was autograd on
        tr.model.model.register_forward_pre_hook(lambda _mod, _args, seen=calls: seen.append(torch.is_grad_enabled()))
        out[decoupled] = tr.train_step(table)
        assert calls.count(False) == (0 if decoupled else 1)      # the no-grad recompute over the whole step
        assert calls.count(True) == 2                               # one forward per mini-batch
    for m in out.values():   # engine and trainer sample the same distribution: the measured gap is numerics
        assert 0 <= m["mismatch/abs_diff_max"] < 1e-4 and m["mismatch/stale_frac"] == 0


@pytest.mark.parametrize("loss_agg,extra", [
    ("token_mean", {}), ("seq_mean_token_mean", {}), ("seq_mean_token_sum_norm", {}),
    # an entropy penalty kept to the trained rows reaches no zero-advantage row either
    ("token_mean", {"entropy_coef": -0.05, "entropy_rows": "trained"})])
def test_rows_with_zero_advantage_are_not_forwarded_and_the_update_is_the_same(tiny_model_dir, loss_agg, extra):
    eng = HFEngine(tiny_model_dir, seed=4)
    reqs = _requests(eng, ["12+7=", "3+45=", "99+9=", "8+8="] * 4)
    # groups of 4: group 0 all rewarded 1, group 1 all 0 (zero advantage); groups 2, 3 mixed
    reward = lambda i: 1.0 if i < 4 else 0.0 if i < 8 else float(i % 2)  # noqa: E731
    rows = [{"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
             "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": reward(i),
             "group_id": i // 4, "status": o["status"]} for i, (r, o) in enumerate(zip(reqs, eng.generate(reqs)))]
    table = pa.Table.from_pylist(rows)
    out, weights, forwards = {}, {}, {}
    for skip in (False, True):
        tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, mini_batch_size=4, lr=1e-3, share_prompts=False,
                                                        skip_zero_advantage=skip),
                          AlgorithmConfig(decoupled=True, loss_agg=loss_agg, **extra))
        rows_seen = []
        # the base model's forward (the LM head then runs on response positions only)
        tr.model.model.register_forward_pre_hook(
            lambda _m, _a, kw, seen=rows_seen: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
        out[skip] = [tr.train_step(table) for _ in range(2)]
        weights[skip], forwards[skip] = tr.model.state_dict(), sum(rows_seen)
    assert forwards[False] == 32 and forwards[True] < 32          # 16 rows x 2 steps; fewer with the skip
    assert out[True][0]["train/rows_not_forwarded"] == 32 - forwards[True] - out[True][1]["train/rows_not_forwarded"]
    # the same update: zero-advantage rows add no gradient. (The key biases' true gradient is 0 -- softmax
    # ignores a shift shared by all keys -- so AdamW turns both runs' float noise in it into ~1e-6 steps.)
    for name, t in weights[False].items():
        torch.testing.assert_close(weights[True][name], t, rtol=1e-5, atol=1e-5 if "k_proj.bias" in name else 1e-6,
                                   msg=name)
    for a, b in zip(out[False], out[True]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5, abs=1e-7)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
        # measured on every row of the first mini-batch, as without the skip
        assert a["mismatch/abs_diff_max"] == pytest.approx(b["mismatch/abs_diff_max"], rel=1e-5)
        if extra:       # the term was there (the same loss and weights, above, with or without the skip)
            assert a["train/entropy"] > 0 and b["train/entropy"] > 0
    if extra:
        return
    # a term that reaches zero-advantage rows (entropy) turns the skip off
    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, mini_batch_size=4),
                      AlgorithmConfig(decoupled=True, entropy_coef=0.01))
    assert tr.train_step(table)["train/rows_not_forwarded"] == 0
    # an entropy penalty (entropy_coef < 0) is a term too: computed, and the skip off
    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, mini_batch_size=4),
                      AlgorithmConfig(decoupled=True, entropy_coef=-0.01))
    m = tr.train_step(table)
    assert m["train/rows_not_forwarded"] == 0 and m["train/entropy"] > 0


def test_a_groups_prompt_packed_once_gives_the_padded_batchs_logprobs_and_gradients(tiny_model_dir):
    from stages.update.trainer import pack_shared_prompts

    eng = HFEngine(tiny_model_dir, seed=5)
    reqs = _requests(eng, ["12+7=", "3+45=", "99+9="] * 3 + ["1+1="])   # 3 prompts x 3 samples, 1 alone
    outs = eng.generate(reqs)
    rows = [{"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
             "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": 0.0,
             "group_id": i % 3 if i < 9 else 3, "status": o["status"]} for i, (r, o) in enumerate(zip(reqs, outs))]
    assert len({len(o["response_ids"]) for o in outs}) > 1            # ragged responses
    table = pa.Table.from_pylist(rows)
    lps, grads = {}, {}
    for share in (False, True):
        tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, share_prompts=share), AlgorithmConfig())
        b = to_batch(table, tr.pad_id)
        sub = torch.tensor([0, 1, 3, 4, 6, 9])      # prompt 0 x3, prompt 1 x2, the lone prompt
        if share:
            packed = pack_shared_prompts(b, sub, tr.pad_id)
            assert packed.input_ids.shape[0] == 3                # one sequence per distinct prompt
            assert packed.input_ids.numel() < b.input_ids[sub].numel()
            assert pack_shared_prompts(b, torch.tensor([0, 1, 9]), tr.pad_id) is None   # nothing shared
        lp, ent, _ = tr.logprobs(tr.model, b, sub, with_entropy=True)
        (lp * b.mask[sub]).sum().backward()
        lps[share] = (lp * b.mask[sub], ent * b.mask[sub])
        grads[share] = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    torch.testing.assert_close(lps[True][0], lps[False][0], rtol=0, atol=2e-5)
    torch.testing.assert_close(lps[True][1], lps[False][1], rtol=0, atol=2e-5)
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, rtol=1e-4, atol=1e-5, msg=n)


def test_mini_batches_of_whole_groups_and_a_bad_split_is_rejected(tiny_model_dir):
    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, mini_batch_split="groups", mini_batch_size=8),
                      AlgorithmConfig())
    t = pa.Table.from_pylist([{"prompt_ids": [3, 4 + g], "response_ids": [5, 1], "response_logprobs": [-1.0, -1.0],
                               "loss_mask": [1, 1], "token_versions": [0, 0], "reward": float(i % 2), "group_id": g,
                               "status": "completed"} for g in range(6) for i in range(4)])
    b = to_batch(t, 0)
    parts = mini_batches(tr.cfg, tr.rng, b)
    assert len(parts) == 3 and sorted(np.concatenate(parts).tolist()) == list(range(24))
    for idx in parts:      # two whole groups each
        assert len(set(b.group_ids[idx].tolist())) == 2 and len(idx) == 8
    with pytest.raises(ValueError, match="mini_batch_split"):
        TrainerConfig(mini_batch_split="tokens")


def test_greedy_is_deterministic_and_failed_rows_are_not_trained(tiny_model_dir):
    eng = HFEngine(tiny_model_dir)
    a = eng.generate(_requests(eng, ["5+5="], temperature=0.0))
    b = eng.generate(_requests(eng, ["5+5="], temperature=0.0))
    assert a[0]["response_ids"] == b[0]["response_ids"]
    t = pa.Table.from_pylist([{"prompt_ids": [3, 4], "response_ids": [5, 1], "response_logprobs": [-1.0, -1.0],
                               "loss_mask": [1, 1], "token_versions": [0, 0], "reward": 1.0, "group_id": 0,
                               "status": s} for s in ("completed", "failed")])
    assert to_batch(t, 0).mask.sum(1).tolist() == [2.0, 0.0]


def test_to_batch_lays_out_ragged_rows_right_padded(tiny_model_dir):
    rows = [{"prompt_ids": p, "response_ids": r, "response_logprobs": [-0.5] * len(r), "loss_mask": m,
             "token_versions": list(range(len(r))), "reward": float(i), "group_id": i // 2, "status": s}
            for i, (p, r, m, s) in enumerate([([3, 4, 5], [6, 1], [1, 1], "completed"),
                                              ([3], [7, 8, 9], [1, 0, 1], "truncated"),
                                              ([4, 4], [], [], "failed"),
                                              ([5, 6, 7, 8], [9], [1], "aborted")])]
    # two chunks, the second sliced: Arrow offsets that do not start at 0
    table = pa.concat_tables([pa.Table.from_pylist(rows[:1]), pa.Table.from_pylist(rows).slice(1)])
    b = to_batch(table, pad_id=0)
    assert b.input_ids.tolist() == [[3, 4, 5, 6, 1], [3, 7, 8, 9, 0], [4, 4, 0, 0, 0], [5, 6, 7, 8, 9]]
    assert b.attn.sum(1).tolist() == [5, 4, 2, 5]
    assert b.resp_pos.tolist() == [[2, 3, 0], [0, 1, 2], [0, 0, 0], [3, 0, 0]]
    assert b.resp_ids.tolist() == [[6, 1, 0], [7, 8, 9], [0, 0, 0], [9, 0, 0]]
    assert b.mask.tolist() == [[1, 1, 0], [1, 0, 1], [0, 0, 0], [0, 0, 0]]    # aborted/failed: never trained
    assert b.versions.tolist() == [[0, 1, -1], [0, 1, 2], [-1, -1, -1], [0, -1, -1]]
    assert b.engine_lp[1].tolist() == [-0.5] * 3 and b.engine_lp[2].tolist() == [0.0] * 3
    assert b.lengths.tolist() == [2, 3, 0, 1] and b.truncated.tolist() == [False, True, False, False]
    assert b.group_ids.tolist() == [0, 0, 1, 1] and b.rewards.tolist() == [0.0, 1.0, 2.0, 3.0]
    # the trainer runs without an attention mask: causal attention alone must give the log-probs
    # of the masked model at every response position (pads only ever follow real tokens)
    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1), AlgorithmConfig())
    with torch.no_grad():
        lp = tr.logprobs(tr.model, b)[0]
        logits = tr.model(input_ids=b.input_ids, attention_mask=b.attn).logits
    ref = torch.log_softmax(logits.gather(1, b.resp_pos[..., None].expand(-1, -1, logits.shape[-1])), -1)
    ref = ref.gather(-1, b.resp_ids[..., None])[..., 0]
    real = torch.arange(3)[None, :] < b.lengths[:, None]
    assert torch.equal(lp[real], ref[real])


def test_inverse_cdf_samples_the_distribution_and_never_a_zero_probability_token():
    from stages.agentflow.sampling import inverse_cdf

    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3]])
    u = torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tok = inverse_cdf(probs.expand(len(u), -1), 1.0 - u)
    freq = torch.bincount(tok, minlength=5) / len(u)
    assert freq[0] == freq[2] == 0 and (freq - probs[0]).abs().max() < 0.015
    edges = torch.tensor([2.0 ** -53, 0.2, 0.2 + 1e-12, 1.0], dtype=torch.float64)
    assert inverse_cdf(probs.expand(4, -1), edges).tolist() == [1, 1, 3, 4]
    cut = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.0]])       # a top-p cut: rows need not sum to 1
    assert inverse_cdf(cut, torch.tensor([1.0], dtype=torch.float64)).tolist() == [3]


def test_seeded_uniforms_are_a_function_of_seed_and_step():
    from stages.agentflow.sampling import seeded_uniform

    u = seeded_uniform([7] * 1000 + list(range(1000)), list(range(1000, 2000)) + [3] * 1000)
    assert ((u > 0) & (u <= 1)).all() and len(set(u.tolist())) == 2000
    assert abs(u.mean() - 0.5) < 0.03 and abs((u < 0.1).mean() - 0.1) < 0.03
    assert seeded_uniform([7, -5, 2 ** 70], [3, 3, 3]).tolist()[0] == seeded_uniform([7], [3]).tolist()[0]


def test_a_seeded_request_samples_the_same_tokens_alone_batched_or_resumed(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=5)
    req = _requests(eng, ["12+7="], max_new_tokens=6, seed=11)[0]
    alone = eng.generate([req])[0]
    batched = eng.generate(_requests(eng, ["3+45=", "99+9="], seed=4) + [req])[2]
    assert batched["response_ids"] == alone["response_ids"]
    assert torch.allclose(torch.tensor(batched["logprobs"]), torch.tensor(alone["logprobs"]), atol=1e-5)
    k = 2       # a partial rollout resumed after k tokens continues as if it had never stopped
    resumed = eng.generate([req | {"prefix_ids": alone["response_ids"][:k], "prefix_logprobs": alone["logprobs"][:k],
                                   "prefix_versions": alone["versions"][:k]}])[0]
    assert resumed["response_ids"] == alone["response_ids"]
    other = [eng.generate([req | {"seed": s}])[0] for s in range(12, 20)]
    assert any(o["response_ids"] != alone["response_ids"] for o in other)     # the seed matters
    # a group (one prompt, N seeds) shares one prefill in a batch: each sample as if it ran alone
    group = eng.generate([req | {"seed": s} for s in range(12, 20)] + _requests(eng, ["3+45="], seed=4))
    for g, o in zip(group, other):
        assert g["response_ids"] == o["response_ids"]
        assert torch.allclose(torch.tensor(g["logprobs"]), torch.tensor(o["logprobs"]), atol=1e-5)


class Exploding:
    async def run(self, ctx, sample):
        if sample["sample_idx"] == 1:
            raise RuntimeError("agent exploded")
        await ctx.generate()


def test_rollout_stage_on_a_hand_made_batch(ray_session, tiny_model_dir):
    ray = ray_session
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=4).remote(tiny_model_dir)
    batch = table_from_columns({"prompt_id": ["p0"] * 3, "group_id": [0, 0, 0], "sample_idx": [0, 1, 2],
                                "prompt": ["12+30="] * 3})
    stage = AgentFlowRollout([eng], None, tiny_model_dir, sampling=SamplingConfig(max_new_tokens=4),
                             agent=AgentConfig(name="tests.test_engine_trainer.Exploding"))
    out = stage(batch)
    assert set(AgentFlowRollout.outputs) <= set(out.column_names)
    rows = out.to_pylist()
    assert [r["status"] for r in rows][1] == "failed" and "agent exploded" in rows[1]["error"]
    for r in (rows[0], rows[2]):
        assert r["status"] in ("completed", "truncated") and r["error"] == ""
        assert len(r["response_ids"]) == len(r["token_versions"]) == len(r["loss_mask"]) > 0
        assert r["version_start"] == r["version_end"] == 0 and r["t_done"] >= r["t_dispatch"]
    ray.kill(eng)


def test_bad_agent_path_fails_at_start():
    from stages.agentflow.rollout import load_agent

    with pytest.raises(ValueError, match="agent.name 'no.such:Agent' does not import"):
        load_agent("no.such:Agent")


def test_trainer_keeps_its_weights_in_the_shared_segment(ray_session, tiny_model_dir, tmp_path):
    """Over shm the torch trainer adopts the sender's segment on the first publish (any size
    here; by default only weights of 64 MiB or more): later
    versions are published with no copy on the trainer (transfer/zero_copy), the engine
    lands bit-exact weights after a real optimizer step, and save() still writes every
    tensor (the parameters are now views of one shared buffer)."""
    import ray

    import transfer
    from stages.model import load_model
    from stages.transfer_config import TransferConfig

    trainer = ray.remote(TorchTrainer).options(num_cpus=0.1, max_concurrency=2).remote(
        tiny_model_dir, TrainerConfig(num_threads=1, lr=1e-3), AlgorithmConfig())
    engine = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=4).remote(tiny_model_dir, seed=3)
    mesh = transfer.TransferMesh(trainer, {"engine": engine},
                                 TransferConfig(transport="shm", bucket_bytes=64 << 10,
                                                         adopt_min_bytes=0))
    first = mesh.publish(1)
    eng = HFEngine(tiny_model_dir)
    reqs = _requests(eng, ["12+7=", "3+45=", "9+9=", "40+2="])
    outs = ray.get(engine.generate.remote(reqs))
    rows = [{"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
             "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": float(i % 2),
             "group_id": 0, "status": o["status"]} for i, (r, o) in enumerate(zip(reqs, outs))]
    before = ray.get(trainer.state_dict.remote())
    ray.get(trainer.train_step.remote(pa.Table.from_pylist(rows)))
    second = mesh.publish(2)
    assert second["transfer/zero_copy"] == 1.0 and "transfer/zero_copy" in first
    after = ray.get(trainer.state_dict.remote())
    assert any(not torch.equal(before[n], t) for n, t in after.items())      # the step changed weights
    served = ray.get(served_weights(engine))
    assert all(torch.equal(after[n], served[n]) for n in after)
    assert ray.get(engine.weight_version.remote()) == 2
    p = mesh.publish_begin(3)       # engines read the trainer's own weights: it must not step yet
    assert p.sender_free is False
    assert mesh.publish_end(p)["transfer/receivers"] == 1
    ray.get(trainer.save.remote(str(tmp_path / "saved"), tiny_model_dir, False))
    saved = load_model(str(tmp_path / "saved"), "float32").state_dict()
    assert all(torch.equal(after[n], saved[n]) for n in after)
    mesh.close()
    for a in (trainer, engine):
        ray.kill(a)


def test_rollout_nice_lowers_an_actor_once_and_never_the_calling_process(ray_session):
    import os

    from stages.priority import lower_priority

    before = os.nice(0)
    lower_priority(5)               # not in an actor (a test, a notebook): left alone
    assert os.nice(0) == before

    @ray_session.remote(num_cpus=0)
    class Probe:
        def lowered(self, n):
            start = os.nice(0)
            lower_priority(n)
            lower_priority(n)       # a second stage in the same process: no further drop
            return start, os.nice(0)

    probe = Probe.remote()
    start, now = ray_session.get(probe.lowered.remote(5))
    assert now == max(start, 5)
    ray_session.kill(probe)


def _failed_rows(n: int, group: int = 0) -> list[dict]:
    """Trajectories that failed before their first model call: no tokens at all."""
    return [{"prompt_ids": [], "response_ids": [], "response_logprobs": [], "loss_mask": [], "token_versions": [],
             "reward": 0.0, "group_id": group, "status": "failed"} for _ in range(n)]


def test_a_step_with_no_trainable_row_is_skipped_counted_and_the_clock_moves_on(tiny_model_dir, tmp_path):
    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, mini_batch_size=2, lr_warmup_steps=4),
                      AlgorithmConfig())
    before = {n: t.clone() for n, t in tr.model.state_dict().items()}
    for step in (1, 2):
        m = tr.train_step(pa.Table.from_pylist(_failed_rows(4)))
        assert m["train/skipped_steps"] == step and m["version"] == step and m["train/tokens"] == 0
        assert "train/loss" not in m and m["train/lr"] == lr_at(tr.cfg, step - 1)   # the schedule keeps its place
    assert all(torch.equal(before[n], t) for n, t in tr.model.state_dict().items())   # no update
    assert not tr.opt.state                                                          # AdamW never stepped
    # a step with some failed rows and some trained ones trains as usual; the count carries on
    rows = [{"prompt_ids": [3, 4], "response_ids": [5, 1], "response_logprobs": [-1.0, -1.0], "loss_mask": [1, 1],
             "token_versions": [2, 2], "reward": float(i), "group_id": 1, "status": "completed"} for i in range(2)]
    m = tr.train_step(pa.Table.from_pylist(_failed_rows(2) + rows))
    assert m["version"] == 3 and m["train/skipped_steps"] == 2 and m["train/tokens"] == 4 and "train/loss" in m
    # a resumed trainer keeps the count
    tr.save(str(tmp_path / "ck"))
    again = TorchTrainer(str(tmp_path / "ck"), tr.cfg, AlgorithmConfig())
    assert again.load_state(str(tmp_path / "ck")) == 3 and again.skipped_steps == 2


def test_sampling_in_row_chunks_gives_the_whole_batchs_tokens_and_logprobs(raw_model_dir, monkeypatch):
    """The sampler takes a large vocabulary's rows a few at a time (each [64, 151k] tensor of its math is
    39 MB): the same tokens and log-probs, seeded rows and the engine's own draws alike, top-p or not."""
    import stages.agentflow.sampling as sampling
    from stages.agentflow.engine import _Row

    eng = HFEngine(raw_model_dir, seed=5)
    logits = torch.randn(23, 300, generator=torch.Generator().manual_seed(1))

    def sampled(temp, top_p):
        rows = [_Row([1], [0] * i, [], [], 1, None if i % 3 == 0 else 100 + i, temp, top_p, 0.0) for i in range(23)]
        eng._gen.manual_seed(7)
        return sampling.sample(logits, torch.tensor([temp] * 23), torch.tensor([top_p] * 23), eng._uniforms(rows))

    cases = [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)]
    whole = [sampled(*c) for c in cases]
    monkeypatch.setattr(sampling, "CDF_CELLS", 1000)      # 3 rows a chunk
    for (tok, lp), (tok_c, lp_c) in zip(whole, [sampled(*c) for c in cases]):
        assert torch.equal(tok, tok_c) and torch.equal(lp, lp_c)
