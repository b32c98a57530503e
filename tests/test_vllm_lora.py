"""trainer.lora with vLLM serving (stages/agentflow/vllm_engine.py): each published adapter version
is a LoRARequest; rows keep the adapter they started with; the engine's log-probs are the LoRA
trainer's (k3 on fresh tokens, as the trainer measures it)."""
from __future__ import annotations

import time

import pyarrow as pa
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import ray  # noqa: E402

import transfer  # noqa: E402
from stages.agentflow.vllm_engine import VLLMConfig, VLLMEngine  # noqa: E402
from stages.lora import LoraConfig  # noqa: E402
from stages.model import load_tokenizer  # noqa: E402
from stages.transfer_config import TransferConfig  # noqa: E402
from stages.update.losses import AlgorithmConfig  # noqa: E402
from stages.update.trainer import TorchTrainer, TrainerConfig  # noqa: E402

LORA = LoraConfig(enabled=True, rank=8)
PROMPTS = ["12+7=", "3+45=", "99+9=", "40+2=", "5+5=", "61+30=", "8+88=", "23+23="]


def _reqs(tok, n: int = 4, **kw):
    return [{"prompt_ids": tok(p, add_special_tokens=False)["input_ids"], "max_new_tokens": 6,
             "temperature": 1.0, "seed": i} | kw for i, p in enumerate(PROMPTS * n)]


def _rows(reqs, outs) -> pa.Table:
    return pa.Table.from_pylist([
        {"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
         "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": float(i % 3 == 0),
         "group_id": i // 4, "status": o["status"]} for i, (r, o) in enumerate(zip(reqs, outs))])


def test_lora_versions_are_served_as_adapters_that_rows_keep(ray_session, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    cfg = TrainerConfig(num_threads=1, lr=1e-2, mini_batch_size=0, lora=LORA)
    trainer = ray.remote(TorchTrainer).options(num_cpus=0.1, max_concurrency=2).remote(
        tiny_model_dir, cfg, AlgorithmConfig())
    engine = ray.remote(VLLMEngine).options(num_cpus=0.1, max_concurrency=16).remote(
        tiny_model_dir, "float32", 0, 1, "engine0", VLLMConfig(kv_cache_mb=64), LORA)
    mesh = transfer.TransferMesh(trainer, {"engine0": engine}, TransferConfig(transport="shm"))
    reqs = _reqs(tok)
    base = outs = ray.get(engine.generate.remote(reqs))
    assert {v for o in outs for v in o["versions"]} == {0}
    for v in (1, 2):
        ray.get(trainer.train_step.remote(_rows(reqs, outs)))
        mesh.publish(v)
        outs = ray.get(engine.generate.remote(reqs))
        assert {x for o in outs for x in o["versions"]} == {v}
    # the trainer at version 2 recomputes the engine's version-2 tokens: the same distribution
    m = ray.get(trainer.train_step.remote(_rows(reqs, outs)))
    assert m["mismatch/stale_frac"] == 0 and m["mismatch/k3_kl/fresh"] <= 1e-4, m
    assert max(abs(a - b) for f, s in zip(base, outs) for a, b in zip(f["logprobs"], s["logprobs"])) > 1e-2
    # rows in flight when adapter v3 arrives finish on the adapter they started with
    long = [{"prompt_ids": tok("1+", add_special_tokens=False)["input_ids"], "max_new_tokens": 60,
             "temperature": 2.0, "seed": i} for i in range(96)]
    ref = engine.generate.remote(long)
    time.sleep(0.05)
    mesh.publish(3)
    assert all(set(o["versions"]) == {2} for o in ray.get(ref))
    assert {x for o in ray.get(engine.generate.remote(reqs[:4])) for x in o["versions"]} == {3}
    mesh.close()
    for a in (trainer, engine):
        ray.kill(a)

