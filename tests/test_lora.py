"""LoRA RL (trainer.lora, stages/lora.py): adapters trained, synced, served, checkpointed, exported.

* the engines' log-probs after an adapter sync are the trainer's (mismatch k3 on fresh tokens
  as small as full fine-tuning's, measured side by side), served merged or through peft;
* a sync moves the adapter's bytes, not the model's;
* a run resumed from a LoRA checkpoint continues exactly as the uninterrupted one;
* `loongsage export --merge` writes a plain HF model equal to base + adapter;
* bad settings fail at start with one message naming the key.
The SGLang adapter path needs a GPU (benchmarks/gpu/sglang_lora_check.py); here its CPU-side
parts: the adapter directory it loads, its launch flags, its per-request version tags.
"""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from pipeline.config import ConfigError, load_config
from pipeline.controller import Controller
from pipeline.metrics import read_metrics
from stages.agentflow.engine import HFEngine
from stages.agentflow.sglang_engine import check_lora_targets, lora_module_names, lora_server_args, parse_output
from stages.lora import LoraConfig, MergedAdapter, adapter_specs, check_targets, write_adapter
from stages.model import load_model
from stages.transfer_config import TransferConfig
from stages.update.losses import AlgorithmConfig
from stages.update.trainer import TorchTrainer, TrainerConfig
from transfer import TransferMesh

LORA = LoraConfig(enabled=True, rank=8, alpha=16.0)
LORA_NORM = dataclasses.replace(LORA, modules_to_save=("model.norm",))   # + the final norm trained in full
PROMPTS = ["12+7=", "3+45=", "99+9=", "8+8=", "40+2=", "7+70="] * 2


def _requests(tok, seed0: int = 0) -> list[dict]:
    return [{"prompt_ids": tok(p, add_special_tokens=False)["input_ids"], "max_new_tokens": 5, "temperature": 1.0,
             "seed": seed0 + i} for i, p in enumerate(PROMPTS)]


def _rows(reqs: list[dict], outs: list[dict]) -> pa.Table:
    """One training step's table from engine outputs (groups of 4, rewards alternating)."""
    return pa.Table.from_pylist([
        {"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
         "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": float(i % 2),
         "group_id": i // 4, "status": o["status"]} for i, (r, o) in enumerate(zip(reqs, outs))])


# ---- bad input: one message at start, naming the key --------------------------------------------

@pytest.mark.parametrize("override, match", [
    ("trainer.lora.rank=0", "trainer.lora.rank must be > 0"),
    ("trainer.lora.rank=-4", "trainer.lora.rank must be > 0"),
    ("trainer.lora.target_regex='(q'", "trainer.lora.target_regex='\\(q' is not a valid regex"),
    ("trainer.lora.serve=fused", "trainer.lora.serve"),
    ("trainer.backend=megatron", "trainer.lora.enabled needs trainer.backend=torch"),
])
def test_bad_lora_settings_fail_when_the_config_is_read(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/quickstart_lora.yaml", [override])


@pytest.mark.parametrize("override, match", [
    ("trainer.lora.target_modules=[qproj]", r"target_modules=\['qproj'\] matches no module .* q_proj, k_proj"),
    ("trainer.lora.target_regex=.*mlp", r"target_regex='\.\*mlp' matches modules that are not linear .*Qwen2MLP"),
    ("trainer.lora.target_modules=[lm_head]", "tie_word_embeddings"),
    ("trainer.lora.modules_to_save=[nrm]", "trainer.lora.modules_to_save: 'nrm' matches no module"),
    ("trainer.lora.modules_to_save=[embed_tokens]", "modules_to_save: model.embed_tokens holds the embedding tied"),
])
def test_targets_that_match_no_linear_layer_fail_before_any_actor(tiny_model_dir, tmp_path, override, match):
    cfg = load_config("configs/quickstart_lora.yaml", [f"model.path={tiny_model_dir}", override])
    with pytest.raises(ConfigError, match=match):
        Controller(cfg, tmp_path / "r", log=lambda *_: None)


def test_targets_by_name_and_by_regex_pick_the_same_layers(tiny_model_dir):
    by_name = check_targets(dataclasses.replace(LORA, target_modules=("q_proj", "v_proj")), tiny_model_dir)
    by_regex = check_targets(dataclasses.replace(LORA, target_regex=r"model\.layers\.\d+\.self_attn\.(q|v)_proj"),
                             tiny_model_dir)
    assert by_name == by_regex and len(by_name) == 8       # 4 layers x (q, v)
    odd = check_targets(dataclasses.replace(LORA, target_regex=r"model\.layers\.[13]\.mlp\.down_proj"), tiny_model_dir)
    assert odd == ["model.layers.1.mlp.down_proj", "model.layers.3.mlp.down_proj"]


# ---- the sync: engine = trainer, a fraction of the bytes ------------------------------------------

@pytest.fixture(scope="module")
def synced(ray_session, tiny_model_dir):
    """Trainer -> engine loops of 2 steps each, on the same recipe of rows: LoRA through the TransferMesh
    to a merging and a peft-serving engine (actors), and full fine-tuning for comparison (in-process,
    the engine loading the trainer's state dict). Returns what each step measured."""
    from stages.model import load_tokenizer

    reqs = _requests(load_tokenizer(tiny_model_dir))
    opts = {"num_cpus": 0.1}
    cfg = TrainerConfig(num_threads=1, lr=1e-2, mini_batch_size=0, lora=LORA_NORM)
    trainer = ray.remote(TorchTrainer).options(**opts).remote(tiny_model_dir, cfg, AlgorithmConfig())
    engines = {serve: ray.remote(HFEngine).options(**opts, max_concurrency=4).remote(
        tiny_model_dir, "float32", 1, 1, serve, 0, dataclasses.replace(LORA_NORM, serve=serve))
        for serve in ("merge", "peft")}
    mesh = TransferMesh(trainer, engines, TransferConfig())
    mesh.discover()
    full_trainer = TorchTrainer(tiny_model_dir, dataclasses.replace(cfg, lr=1e-4, lora=LoraConfig()), AlgorithmConfig())
    full_engine = HFEngine(tiny_model_dir, seed=1)
    out = {"lora": {"steps": [], "syncs": []}, "full": {"steps": [], "syncs": []}}
    first = outs = ray.get(engines["merge"].generate.remote(reqs))
    full_outs = full_engine.generate(reqs)
    for v in (1, 2):
        out["lora"]["steps"].append(ray.get(trainer.train_step.remote(_rows(reqs, outs))))
        out["lora"]["syncs"].append(mesh.publish(v))
        outs = ray.get(engines["merge"].generate.remote(reqs))
        out["full"]["steps"].append(full_trainer.train_step(_rows(reqs, full_outs)))
        full_engine.load_weights(full_trainer.state_dict(), v)
        full_outs = full_engine.generate(reqs)
    served = {n: ray.get(e.generate.remote(reqs)) for n, e in engines.items()}
    # the gap at version 2: fresh tokens sampled after the second sync, recomputed by the trainer at version 2
    out["lora"]["steps"].append(ray.get(trainer.train_step.remote(_rows(reqs, outs))))
    out["full"]["steps"].append(full_trainer.train_step(_rows(reqs, full_outs)))
    out["lora"] |= {"first": first, "served": served, "memory": ray.get(trainer.memory.remote()),
                    "adapter": ray.get(trainer.state_dict.remote())}
    out["full"] |= {"memory": full_trainer.memory(), "model_bytes": sum(
        t.numel() * t.element_size() for t in full_trainer.published().values())}
    mesh.close()
    for h in (trainer, *engines.values()):
        ray.kill(h)
    return out


def test_engine_logprobs_after_a_lora_sync_are_the_trainers(synced):
    full, lora = synced["full"]["steps"][-1], synced["lora"]["steps"][-1]
    # fresh tokens (version 2, sampled after the second sync), recomputed by the trainer at version 2
    assert full["mismatch/stale_frac"] == lora["mismatch/stale_frac"] == 0
    assert lora["mismatch/k3_kl/fresh"] < 1e-10 and lora["mismatch/abs_diff_max"] < 1e-4
    assert lora["mismatch/k3_kl/fresh"] <= 10 * full["mismatch/k3_kl/fresh"] + 1e-13, (lora, full)
    # not vacuous: the adapter moved the policy the engine samples from (same seeds, other tokens / log-probs)
    first, after = synced["lora"]["first"], synced["lora"]["served"]["merge"]
    assert max(abs(a - b) for f, s in zip(first, after) for a, b in zip(f["logprobs"], s["logprobs"])) > 1e-2
    # merged into the weights or served by peft's layers: the same samples, the same log-probs
    merge, peft = synced["lora"]["served"]["merge"], synced["lora"]["served"]["peft"]
    assert [o["response_ids"] for o in merge] == [o["response_ids"] for o in peft]
    assert max(abs(a - b) for m, p in zip(merge, peft) for a, b in zip(m["logprobs"], p["logprobs"])) < 1e-5
    assert {v for o in merge for v in o["versions"]} == {2}


def test_a_lora_sync_moves_the_adapters_bytes(synced):
    adapter = synced["lora"]["adapter"]
    size = sum(t.numel() * t.element_size() for t in adapter.values())
    assert size == synced["lora"]["memory"]["trainable_bytes"]
    for m in synced["lora"]["syncs"]:
        assert m["transfer/payload_bytes"] == size
        assert size <= m["transfer/state_bytes"] < size + 64 * len(adapter)     # + alignment padding at most
        assert m["transfer/receivers"] == 2 and m["transfer/bytes"] == 2 * m["transfer/state_bytes"]
    full = synced["full"]["model_bytes"]        # what a full fine-tuning sync sends
    assert size < 0.15 * full, (size, full)
    # and only the adapters have optimizer state (2 Adam moments each, + step counters)
    lora_opt, full_opt = synced["lora"]["memory"]["optimizer_state_bytes"], synced["full"]["memory"][
        "optimizer_state_bytes"]
    assert 2 * size <= lora_opt < 2 * size + 8 * len(adapter) and lora_opt < 0.15 * full_opt


def test_merged_serving_unmerges_exactly(tiny_model_dir):
    """Each version is written from the kept base copy: after any number of versions, a zero adapter
    gives back the base weights bit for bit (no drift from merging and unmerging)."""
    base = load_model(tiny_model_dir).state_dict()
    eng = HFEngine(tiny_model_dir, lora=LORA)
    assert isinstance(eng.adapter, MergedAdapter)
    g = torch.Generator().manual_seed(0)
    for v in (1, 2, 3):
        eng.load_weights({n: torch.randn(t.shape, generator=g) * 0.1 for n, t in eng.adapter.buffers.items()}, v)
    live = eng.model.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(live[q], base[q])
    eng.load_weights({n: torch.zeros_like(t) for n, t in eng.adapter.buffers.items()}, 4)
    assert all(torch.equal(live[n], base[n]) for n in base) and eng.weight_version() == 4


# ---- checkpoints: resume and export -------------------------------------------------------------

FAST = ["batcher.groups_per_step=2", "rollout.n_samples=4", "sampling.max_new_tokens=5", "eval.num_prompts=0",
        "data.train_size=5", "reward.fn=stages.tasks.rewards:digit_match", "trainer.mini_batch_size=0",
        "trainer.lr=0.01", "trainer.lr_schedule=cosine", "trainer.lr_decay_steps=4", "trainer.lr_min_ratio=0.5"]


def test_a_lora_trainer_restored_from_its_checkpoint_steps_as_if_never_stopped(tiny_model_dir, tmp_path):
    """Adapter, Adam state, RNGs and clock: 2 steps, save, a fresh trainer restores and takes steps
    3-4, exactly as the trainer that never stopped (and only the adapter is in the checkpoint)."""
    eng = HFEngine(tiny_model_dir, seed=5)
    tables = [_rows(reqs, eng.generate(reqs)) for reqs in (_requests(eng.tok, 100 * k) for k in range(4))]
    cfg = TrainerConfig(num_threads=1, lr=1e-2, mini_batch_size=4, lr_schedule="cosine", lr_decay_steps=4,
                        lora=LORA_NORM)
    make = lambda: TorchTrainer(tiny_model_dir, cfg, AlgorithmConfig())  # noqa: E731
    never = make()
    want = [never.train_step(t) for t in tables]
    stopped = make()
    for t in tables[:2]:
        stopped.train_step(t)
    ckpt = stopped.save(str(tmp_path / "ck"), tiny_model_dir)
    assert (tmp_path / "ck" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "ck" / "model.safetensors").exists()
    resumed = make()
    assert resumed.load_state(ckpt) == 2
    got = [resumed.train_step(t) for t in tables[2:]]
    for a, b in zip(got, want[2:]):
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
        assert a["train/lr"] == b["train/lr"] and a["version"] == b["version"]
    assert all(torch.equal(resumed.adapter[n], never.adapter[n]) for n in never.adapter)


def test_resuming_checks_the_checkpoint_is_an_adapter_of_this_base(tiny_model_dir, tmp_path):
    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, lora=LORA), AlgorithmConfig())
    ckpt = tmp_path / "ck"
    tr.save(str(ckpt), tiny_model_dir)
    (ckpt / "controller.json").write_text(json.dumps({"step": 0, "version": 0, "done_seqs": []}))
    over = [f"model.path={tiny_model_dir}", f"run.resume_from={ckpt}"]
    ctl = Controller(load_config("configs/quickstart_lora.yaml", over), tmp_path / "r", log=lambda *_: None)
    assert ctl.model_path == tiny_model_dir       # engines and trainer start from the base, not the checkpoint
    with pytest.raises(ConfigError, match="resume it with trainer.lora.enabled=true"):
        Controller(load_config("configs/quickstart.yaml", over), tmp_path / "r", log=lambda *_: None)
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(json.dumps(cfg | {"base_model_name_or_path": str(tmp_path)}))
    with pytest.raises(ConfigError, match="its adapter was trained on"):
        Controller(load_config("configs/quickstart_lora.yaml", over), tmp_path / "r", log=lambda *_: None)


# 45 s (2 min on a loaded 2-core machine); the default tier covers the trainer's restore exactly
# (test_a_lora_trainer_restored_from_its_checkpoint_steps_as_if_never_stopped) and the controller's
# resume checks (test_resuming_checks_the_checkpoint_is_an_adapter_of_this_base)
@pytest.mark.slow
def test_a_resumed_lora_run_continues_exactly(ray_session, tiny_model_dir, tmp_path):
    """As test_pipeline's resume test, with LoRA: 4 steps uninterrupted (checkpoint at step 2) vs a
    run resumed from that checkpoint for steps 3-4: the same prompts, losses, grad norms and lr."""
    base = FAST + [f"model.path={tiny_model_dir}", "run.steps=4"]
    full = Controller(load_config("configs/quickstart_lora.yaml", base + ["run.checkpoint_every=2"]),
                      tmp_path / "full", log=lambda *_: None)
    try:
        full.run()
    finally:
        full.stop()
    ckpt = tmp_path / "full" / "checkpoints" / "step_000002"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_model_dir
    second = Controller(load_config("configs/quickstart_lora.yaml", base + [f"run.resume_from={ckpt}"]),
                        tmp_path / "b", log=lambda *_: None)
    try:
        summary = second.run()
        assert summary["version"] == 4 and ray.get(second.engines[0].weight_version.remote()) == 4
    finally:
        second.stop()
    trained = lambda d, ks: [pq.read_table(d / "rollouts" / f"step={k:06d}").column("prompt_id").to_pylist()  # noqa: E731
                             for k in ks]
    assert trained(tmp_path / "b", [3, 4]) == trained(tmp_path / "full", [3, 4])
    # by step: a step whose groups all drew equal rewards has no gradient, so no loss line
    steps = lambda d: {m["step"]: m for m in read_metrics(d) if "train/skipped_steps" in m}  # noqa: E731
    resumed, uninterrupted = steps(tmp_path / "b"), steps(tmp_path / "full")
    assert sorted(resumed) == [3, 4] and sorted(uninterrupted) == [1, 2, 3, 4]
    for k in (3, 4):
        a, b = resumed[k], uninterrupted[k]
        assert ("train/loss" in a) == ("train/loss" in b)
        if "train/loss" in a:
            assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-3, abs=1e-5)
            assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-3)
        assert a["train/lr"] == b["train/lr"]
        # the resumed engine was sent the checkpoint's adapter: it samples what the trainer computes
        assert a["mismatch/abs_diff_max"] < 1e-4
    assert any("train/loss" in resumed[k] for k in (3, 4))
    lora = load_config("configs/quickstart_lora.yaml").trainer.lora
    adapter_bytes = sum(math.prod(shape) * dtype.itemsize
                        for shape, dtype in adapter_specs(load_model(tiny_model_dir), lora).values())
    assert {m["transfer/payload_bytes"] for m in [*uninterrupted.values(), *resumed.values()]} == {adapter_bytes}


def test_export_merged_equals_base_plus_adapter(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from pipeline.cli import main

    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, lr=1e-2, lora=LORA_NORM), AlgorithmConfig())
    eng = HFEngine(tiny_model_dir, seed=3)
    reqs = _requests(eng.tok)
    for _ in range(2):
        tr.train_step(_rows(reqs, eng.generate(reqs)))
    ckpt = tr.save(str(tmp_path / "ckpt"), tiny_model_dir)
    assert main(["export", ckpt, str(tmp_path / "no")]) == 2
    assert "pass --merge" in capsys.readouterr().err
    assert main(["export", "--merge", ckpt, str(tmp_path / "out")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert not any("lora" in n for n in merged.state_dict())
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [5, 5, 6, 7, 3, 4, 11, 12]])
    tr.model.eval()
    with torch.no_grad():
        want = tr.model(input_ids=ids).logits
        with tr.model.disable_adapter():
            base = tr.model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-4 < (base - want).abs().max()
    assert (tmp_path / "out" / "tokenizer.json").is_file()


# ---- SGLang's adapter path, the parts that run without a GPU --------------------------------------

def test_the_adapter_sglang_loads_is_a_peft_adapter_of_the_trainers_tensors(tiny_model_dir, tmp_path):
    from peft import PeftModel

    from stages import lora as lora_lib

    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1, lora=LORA), AlgorithmConfig())
    with torch.no_grad():
        for p in tr.adapter.values():
            p.add_(torch.randn_like(p) * 0.1)
    published = tr.published()
    write_adapter(published, LORA, tiny_model_dir, tmp_path / "v1")
    loaded = PeftModel.from_pretrained(load_model(tiny_model_dir), str(tmp_path / "v1"))
    got = lora_lib.adapter_params(loaded)
    assert set(got) == set(published) and all(torch.equal(got[n], published[n]) for n in published)


def test_sglang_launch_flags_and_targets(tiny_model_dir):
    targets = check_targets(LORA, tiny_model_dir)
    names = check_lora_targets(LORA, tiny_model_dir, targets)
    assert names == sorted(LORA.target_modules) == lora_module_names(adapter_specs(load_model(tiny_model_dir), LORA))
    flags = lora_server_args(LORA, names)
    assert flags["enable-lora"] is True and flags["max-lora-rank"] == 8 and flags["lora-target-modules"] == names
    some = dataclasses.replace(LORA, target_regex=r"model\.layers\.0\.self_attn\.q_proj")
    with pytest.raises(ValueError, match="adapts every layer's q_proj"):
        check_lora_targets(some, tiny_model_dir, check_targets(some, tiny_model_dir))
    with pytest.raises(ValueError, match="trainer.lora.modules_to_save: engine.kind=sglang serves LoRA adapters"):
        check_lora_targets(LORA_NORM, tiny_model_dir, targets)
    # a request bound to adapter v3 reports version 3 for every new token, whatever the server's clock
    out = {"meta_info": {"output_token_logprobs": [[-0.5, 7, None], [-0.1, 1, None]],
                         "finish_reason": {"type": "stop"}, "weight_version": "0"}}
    got = parse_output(out, {"prefix_ids": [5], "prefix_logprobs": [-0.2], "prefix_versions": [2]}, version=3)
    assert got["versions"] == [2, 3, 3] and got["response_ids"] == [5, 7, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang needs a CUDA GPU")
def test_sglang_serves_the_synced_adapters():
    """benchmarks/gpu/sglang_lora_check.py where a GPU is lent: base at v0, adapters loaded and
    served per version (log-probs = the peft model's), only the adapter's bytes sent."""
    pytest.importorskip("sglang")
    r = subprocess.run([sys.executable, "benchmarks/gpu/sglang_lora_check.py"], capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
