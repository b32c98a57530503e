"""The Megatron trainer never applies a non-finite update (issue 17, item 2), on CPU (gloo):
a NaN loss / gradient mini-batch is skipped on every rank and counted, or stops the run
with an error naming the step (trainer.on_nonfinite=stop)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from stages.update.losses import AlgorithmConfig
from stages.update.megatron.config import MegatronConfig
from stages.update.trainer import TrainerConfig

OWN_RAY = True      # a Ray of its own (ray_local): it starts without the shared Ray

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 37


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stages.tasks.models import build_char_tokenizer

    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0))
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456+").save_pretrained(path)
    return str(path)




def _table(rewards: list[float], seed: int = 0) -> pa.Table:
    g = np.random.default_rng(seed)
    rows = []
    for i, reward in enumerate(rewards):
        resp = g.integers(3, VOCAB, 4).tolist()
        rows.append(dict(prompt_ids=g.integers(3, VOCAB, 5).tolist(), response_ids=resp,
                         response_logprobs=(-g.random(4) * 3).tolist(), loss_mask=[1] * 4, token_versions=[0] * 4,
                         reward=reward, group_id=i // 2, status="completed"))
    return pa.Table.from_pylist(rows)


def test_megatron_skips_a_non_finite_update_on_every_rank_or_stops(qwen2_dir, ray_local):
    from stages.update.megatron.launch import launch

    leader = launch(qwen2_dir, TrainerConfig(lr=1e-3, num_threads=1, ppo_epochs=2), AlgorithmConfig(),
                    MegatronConfig(), num_cpus=0.25)
    before = ray.get(leader.state_dict.remote())
    m = ray.get(leader.train_step.remote(_table([1.0, float("nan"), 0.0, 1.0])))
    after = ray.get(leader.state_dict.remote())
    assert all(torch.equal(before[n], after[n]) for n in before), "a NaN step moved the weights"
    assert m["train/nonfinite_skipped"] == 2 and m["version"] == 1      # one mini-batch, two epochs
    assert "train/loss" not in m and all(not (isinstance(v, float) and math.isnan(v)) for v in m.values()), m
    m = ray.get(leader.train_step.remote(_table([1.0, 0.0, 0.0, 1.0])))
    assert m["train/nonfinite_skipped"] == 0 and math.isfinite(m["train/loss"])
    moved = ray.get(leader.state_dict.remote())
    assert any(not torch.equal(after[n], moved[n]) for n in after), "a finite step after a skip did not train"
    ray.get(leader.__ray_call__.remote(
        lambda t: setattr(t, "cfg", dataclasses.replace(t.cfg, on_nonfinite="stop"))))
    with pytest.raises(ray.exceptions.RayTaskError, match=r"NonFiniteUpdate.*training step 2 .*mini-batch 1"):
        ray.get(leader.train_step.remote(_table([float("inf"), 0.0, 0.0, 1.0])))
    stopped = ray.get(leader.state_dict.remote())
    assert all(torch.equal(moved[n], stopped[n]) for n in moved)
    ray.kill(leader)
