"""Megatron-core trainer backend on CPU (gloo): weight mapping, logits, one GRPO step,
and TP / DP / PP runs against a single rank.

Megatron ranks run as Ray actors (their own processes: megatron's parallel state and the
CPU shim are process-wide). The HF models are tiny random Qwen2 (tied embeddings, QKV
bias, GQA) and Llama (untied, llama3 RoPE scaling) with a vocabulary that TP must pad.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from stages.tasks.models import build_char_tokenizer
from stages.update.losses import AlgorithmConfig
from stages.update.megatron.config import MegatronConfig
from stages.update.trainer import TorchTrainer, TrainerConfig
from tests.support.runs import served_weights

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
ray = pytest.importorskip("ray")

from stages.update.megatron.convert import Arch, hf_order, to_hf, to_megatron  # noqa: E402

OWN_RAY = True      # a Ray of its own (ray_local): it starts without the shared Ray

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 37                          # not a multiple of 2 or 4: exercises vocab padding


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))


BUILDERS = {"qwen2": _qwen2, "llama": _llama}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(1)
        model = build()
        with torch.no_grad():       # non-trivial norms, so a swapped norm would show
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456+").save_pretrained(path)   # 3 + 34 = VOCAB
        out[name] = str(path)
    return out


def hf_state(path: str) -> dict[str, torch.Tensor]:
    from stages.model import load_model

    return load_model(path).state_dict()


def step_table(n_groups: int = 3, k: int = 4, seed: int = 0) -> pa.Table:
    """One step's trajectories: groups of k responses, mixed rewards, a truncated row, a
    masked token, and a failed row (recorded, never trained)."""
    g = np.random.default_rng(seed)
    rows = []
    for gi in range(n_groups):
        prompt = g.integers(3, VOCAB, g.integers(3, 7)).tolist()
        for s in range(k):
            resp = g.integers(3, VOCAB, g.integers(2, 7)).tolist()
            mask = [1] * len(resp)
            mask[0] = 0 if s == 1 else 1
            rows.append(dict(prompt_ids=prompt, response_ids=resp,
                             response_logprobs=(-g.random(len(resp)) * 3).tolist(), loss_mask=mask,
                             token_versions=[0] * len(resp), reward=float(g.integers(0, 2)), group_id=gi,
                             status=["completed", "truncated", "completed", "failed"][s]))
    return pa.Table.from_pylist(rows)


# ---- pure weight mapping ----------------------------------------------------------------

@pytest.mark.parametrize("arch_name", list(BUILDERS))
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_round_trip_is_bit_exact(models, arch_name, tp):
    from stages.model import load_model

    model = load_model(models[arch_name])
    arch = Arch.from_hf(model.config)
    hf = model.state_dict()
    names = _megatron_names(arch)
    shards = [to_megatron(names, hf.__getitem__, arch, rank, tp) for rank in range(tp)]
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] == arch.padded_vocab(tp) // tp
    back = hf_order(to_hf(shards, arch), arch)
    assert list(back) == list(hf)
    for n in hf:
        assert torch.equal(back[n], hf[n]), n


def test_fused_qkv_groups_query_heads_with_their_kv_head(models):
    from stages.model import load_model

    model = load_model(models["qwen2"])
    arch = Arch.from_hf(model.config)
    hf = model.state_dict()
    d, g = arch.head_dim, arch.heads // arch.kv_heads
    qkv = to_megatron(["decoder.layers.0.self_attention.linear_qkv.weight"], hf.__getitem__, arch, 1, 2)
    rank1 = qkv["decoder.layers.0.self_attention.linear_qkv.weight"]
    # TP rank 1 of 2 holds KV group 1: query heads 2..3, then key head 1, then value head 1
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(rank1[: g * d], q[g * d: 2 * g * d])
    assert torch.equal(rank1[g * d: g * d + d], hf["model.layers.0.self_attn.k_proj.weight"][d: 2 * d])
    assert torch.equal(rank1[g * d + d:], hf["model.layers.0.self_attn.v_proj.weight"][d: 2 * d])


def _megatron_names(arch: Arch) -> list[str]:
    per_layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    if arch.qkv_bias:
        per_layer.append("self_attention.linear_qkv.bias")
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    names += [f"decoder.layers.{i}.{n}" for i in range(arch.num_layers) for n in per_layer]
    return names + ([] if arch.tied else ["output_layer.weight"])


def test_unsupported_configs_are_rejected_with_the_reason(models):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(models["qwen2"])
    with pytest.raises(ValueError, match="tensor_parallel=4 must divide kv heads"):
        Arch.from_hf(cfg).check_tp(4)
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        Arch.from_hf(cfg)
    with pytest.raises(ValueError, match="megatron.tensor_parallel must be >= 1"):
        MegatronConfig(tensor_parallel=0)
    assert MegatronConfig(tensor_parallel=2, pipeline_parallel=2, data_parallel=3).world_size == 12


# ---- Megatron ranks in Ray actors ---------------------------------------------------------



TRAIN = TrainerConfig(lr=1e-3, num_threads=1)


def launch(path: str, mcfg: MegatronConfig | None = None, algo: AlgorithmConfig | None = None,
           train: TrainerConfig = TRAIN):
    from stages.update.megatron.launch import launch as start

    return start(path, train, algo or AlgorithmConfig(), mcfg or MegatronConfig(), num_cpus=0.25)


def megatron_logits(leader, ids: torch.Tensor) -> torch.Tensor:
    """The leader's full-vocab logits (single rank), run inside its actor."""
    def forward(trainer, ids):
        with trainer._ctx(), torch.no_grad():
            L = ids.shape[1]
            causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)[None, None]
            out = trainer.module(ids, torch.arange(L).expand_as(ids), attention_mask=causal)
            head = trainer._heads.get(id(trainer.module))    # deferred: out is the last hidden states
            return out if head is None else head(out.reshape(-1, out.shape[-1])).reshape(*ids.shape, -1)
    return ray.get(leader.__ray_call__.remote(forward, ids))


@pytest.mark.parametrize("arch_name", list(BUILDERS))
def test_logits_and_weights_match_hf(models, ray_local, arch_name):
    from stages.model import load_model

    path = models[arch_name]
    leader = launch(path)
    hf = load_model(path)
    ids = torch.randint(3, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = megatron_logits(leader, ids)
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, f"max |logit diff| {diff:.2e}"
    back = ray.get(leader.state_dict.remote())           # HF -> GPTModel -> HF
    assert list(back) == list(hf.state_dict())
    assert all(torch.equal(back[n], t) for n, t in hf.state_dict().items())
    ray.kill(leader)


@pytest.mark.parametrize("algo", [AlgorithmConfig(name="grpo"),
                                  AlgorithmConfig(name="dr_grpo", kl_coef=0.1, entropy_coef=0.01)],
                         ids=["grpo", "dr_grpo+kl+entropy"])
def test_one_step_matches_the_torch_trainer(models, ray_local, tmp_path, algo):
    path = models["qwen2"]
    table = step_table()
    torch.manual_seed(0)
    reference = TorchTrainer(path, TRAIN, algo)
    want = reference.train_step(table)
    leader = launch(path, algo=algo)
    got = ray.get(leader.train_step.remote(table))
    for key in ("train/loss", "train/pg_loss", "train/tokens", "train/adv_abs_mean", "mismatch/abs_diff_mean",
                "mismatch/k3_kl", "train/kl_ref", "train/entropy"):
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    assert got["version"] == want["version"] == 1
    before, after, theirs = hf_state(path), ray.get(leader.state_dict.remote()), reference.state_dict()
    moved = max((after[n] - before[n]).abs().max().item() for n in before)
    apart = max((after[n] - theirs[n]).abs().max().item() for n in before)
    assert moved > 5e-4, "the step did not move the weights"
    assert apart < 0.05 * moved, f"updates differ by {apart:.2e} (moved {moved:.2e})"
    saved = ray.get(leader.save.remote(str(tmp_path / "ckpt")))
    reloaded = hf_state(saved)
    assert all(torch.equal(reloaded[n], after[n]) for n in after)
    ray.kill(leader)


def test_chunked_head_gives_the_full_heads_step(models, ray_local):
    """The output layer applied to 2 response positions at a time (each chunk recomputed in the
    backward) against the torch trainer computing all of them at once: the same step."""
    import dataclasses

    path, table = models["qwen2"], step_table()
    algo = AlgorithmConfig(name="dr_grpo", kl_coef=0.1, entropy_coef=0.01)
    torch.manual_seed(0)
    reference = TorchTrainer(path, dataclasses.replace(TRAIN, logprob_chunk=0), algo)
    want = reference.train_step(table)
    leader = launch(path, algo=algo, train=dataclasses.replace(TRAIN, logprob_chunk=2))
    got = ray.get(leader.train_step.remote(table))
    for key in ("train/loss", "train/kl_ref", "train/entropy", "mismatch/abs_diff_mean"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    before, after, theirs = hf_state(path), ray.get(leader.state_dict.remote()), reference.state_dict()
    moved = max((after[n] - before[n]).abs().max().item() for n in before)
    assert max((after[n] - theirs[n]).abs().max().item() for n in before) < 0.05 * moved
    ray.kill(leader)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel=2), dict(data_parallel=2, micro_batch_size=2),
                                    dict(pipeline_parallel=2, micro_batch_size=4)], ids=["tp2", "dp2", "pp2"])
def test_two_ranks_match_one(models, ray_local, layout):
    path, table = models["llama"], step_table(seed=3)
    single = launch(path)
    pair = launch(path, MegatronConfig(**layout))
    assert ray.get(pair.info.remote())["ranks"] == 2
    want, got = ray.get([single.train_step.remote(table), pair.train_step.remote(table)])
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5, abs=1e-7)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    a, b = ray.get([single.state_dict.remote(), pair.state_dict.remote()])
    assert list(a) == list(b)
    diff = max((a[n] - b[n]).abs().max().item() for n in a)
    assert diff < 5e-5, f"weights after one step differ by {diff:.2e}"
    for h in (single, pair):
        ray.get(h.shutdown.remote())
        ray.kill(h)


@pytest.mark.slow
def test_tp2_leader_publishes_hf_weights_through_the_transfer_mesh(models, ray_local):
    from stages.agentflow.engine import HFEngine
    from stages.transfer_config import TransferConfig
    from transfer import TransferMesh

    path = models["qwen2"]
    leader = launch(path, MegatronConfig(tensor_parallel=2))
    engine = ray.remote(HFEngine).options(num_cpus=0.25, max_concurrency=4).remote(path)
    ray.get(leader.train_step.remote(step_table()))
    mesh = TransferMesh(leader, {"engine0": engine}, TransferConfig())
    mesh.discover()
    metrics = mesh.publish(1)
    assert metrics["transfer/receivers"] == 1.0
    assert ray.get(engine.weight_version.remote()) == 1
    sent, landed = ray.get([leader.state_dict.remote(), served_weights(engine)])
    assert all(torch.equal(landed[n], sent[n]) for n in landed)
    assert not torch.equal(landed["model.norm.weight"], hf_state(path)["model.norm.weight"])
    mesh.close()
    ray.get(leader.shutdown.remote())
    ray.kill(leader)
    ray.kill(engine)


@pytest.mark.slow
def test_resume_continues_exactly_with_the_distributed_optimizer(models, ray_local, tmp_path):
    path, mcfg = models["qwen2"], MegatronConfig(data_parallel=2, use_distributed_optimizer=True)
    first = launch(path, mcfg)
    ray.get(first.train_step.remote(step_table(seed=1)))
    ckpt = ray.get(first.save.remote(str(tmp_path / "ckpt"), path))
    want = ray.get(first.train_step.remote(step_table(seed=2)))
    want_w = ray.get(first.state_dict.remote())
    ray.get(first.shutdown.remote())
    ray.kill(first)
    second = launch(ckpt, mcfg)              # weights from the checkpoint, state from load_state
    assert ray.get(second.load_state.remote(ckpt)) == 1
    got = ray.get(second.train_step.remote(step_table(seed=2)))
    assert (got["version"], got["train/loss"], got["train/grad_norm"]) == \
        (want["version"], want["train/loss"], want["train/grad_norm"])
    got_w = ray.get(second.state_dict.remote())
    assert all(torch.equal(got_w[n], want_w[n]) for n in want_w)
    with pytest.raises(ray.exceptions.RayTaskError, match="layout"):
        ray.get(launch(ckpt).load_state.remote(ckpt))      # a different layout is refused
    ray.get(second.shutdown.remote())
    ray.kill(second)
